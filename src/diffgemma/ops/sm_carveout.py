"""cuBLAS GEMMs that leave some SMs free, so a small kernel chain on another stream can run beside them.

At the denoise shape (256 rows) cuBLAS tiles the dense MLP's GEMMs into about one thread block per SM, each SM full.
A kernel launched beside them on another stream (the router chain: a few dozen small blocks) takes a few SMs first
and pushes the GEMM's last blocks into a second wave, so the two run one after the other. With the
GEMM told to target all SMs but a few (cuBLASLt's SM count target, which torch sets from its experimental SM
carveout), both fit at once.

  cublas_sm_carveout(sms)   a context: GEMMs called in it go through cuBLASLt and target all SMs but `sms`
                            (None: no change). The choice is made on the host when the GEMM is called, so a
                            CUDA graph captured in the block keeps it.
"""

from __future__ import annotations

import contextlib
import os

import torch

_quiet_done = False  # torch prints its "experimental" notices once a process; the first settings silence them


def _set(sms, lib):
    """Set the carveout and the preferred BLAS library; the first time with stderr (fd 2) silenced: torch writes a
    one-time C++ notice for each knob that it is experimental. This module is their one user and falls back to
    plain cuBLAS if they go away, so the notices would only alarm users."""
    global _quiet_done
    if _quiet_done:
        torch._C._set_sm_carveout_experimental(sms)
        torch.backends.cuda.preferred_blas_library(lib)
        return
    _quiet_done = True
    try:
        import sys

        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        saved = None
    try:
        if saved is not None:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
        torch._C._set_sm_carveout_experimental(sms)
        torch.backends.cuda.preferred_blas_library(lib)
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


def available() -> bool:
    return torch.cuda.is_available() and hasattr(torch._C, "_set_sm_carveout_experimental")


@contextlib.contextmanager
def cublas_sm_carveout(sms: int | None):
    if sms is None or not available():
        yield
        return
    old_sms = torch._C._get_sm_carveout_experimental()
    old_lib = torch.backends.cuda.preferred_blas_library()
    try:
        _set(sms, "cublaslt")
        changed = True
    except (RuntimeError, AttributeError):  # a build without cuBLASLt: plain cuBLAS on every SM
        torch._C._set_sm_carveout_experimental(old_sms)
        changed = False
    try:
        yield
    finally:
        if changed:
            torch._C._set_sm_carveout_experimental(old_sms)
            torch.backends.cuda.preferred_blas_library(old_lib)
