"""Followers for the expert-parallel tests on the CPU, kept apart from the test module so that a follower imports
only this (its builder is pickled by reference)."""

import torch

from diffgemma import launch


def load_rank(group, threads: int, path, dtype):
    """launch.load_rank on `threads` torch threads. A follower starts on torch's default count, not the one rank 0
    runs on (one in the tests: tests/conftest.py), and the CPU's grouped expert GEMM (torch._grouped_mm) sums in
    another order on another count: the ranks' logits would then differ from one process's in the last bits."""
    torch.set_num_threads(threads)
    return launch.load_rank(group, path, dtype)
