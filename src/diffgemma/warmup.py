"""Warm a model up on the caches that will serve: compile its kernels and capture its denoise graphs first.

Why: on CUDA, the first denoise a cache makes at each context bucket captures that bucket's graphs (two eager runs,
the capture, the guarded twin), and the first launch of each Triton kernel in a process loads or compiles it. A
server that does this on its first requests makes those clients wait for it; warmed at start, they do not.

How: one short generation per bucket, with the settings requests will use, on the cache itself (graphs are kept per
cache), its prompt filler tokens that bring the cache's length into that bucket; then the cache is emptied. Tokens
never depend on it: a rewound cache masks every row past its length, and the GPU tests check that a warmed slot
gives a fresh one's tokens.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .errors import InputError
from .generation import generate

FILLER_SEED = 0


def warm_up(model, cache, settings, *, progress: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> float:
    """Run one short generation in every context bucket `cache` can reach, then empty it. `settings` are those
    requests will use (their SC mode and sampler pick the graphs and kernels). `should_stop()` is asked before each
    bucket: True ends the warm-up there (the cache is emptied all the same). -> seconds taken."""
    if cache.length != 0:
        raise InputError(f"warm_up: the cache holds {cache.length} tokens; expected an empty one (it is emptied after)")
    t0 = time.perf_counter()
    canvas = settings.canvas_length or model.config.canvas_length
    buckets = model.context_buckets(cache)
    filler = torch.Generator().manual_seed(FILLER_SEED)
    try:
        for low, top in zip([0] + buckets[:-1], buckets):  # bucket `top` serves cache lengths in (low, top]
            if should_stop():
                break
            # a short prompt in the first bucket; in the others, just past the one below
            target = min(8, top) if low == 0 else low + 1
            n = target - cache.length
            room = top - target  # the reply must not carry the cache into the next bucket
            if n < 1 or room < 1:  # nothing fits (a last bucket only a few tokens wide): nothing to capture there
                continue
            if progress is not None:
                progress(f"context {target}")
            ids = torch.randint(0, model.config.vocab_size, (n,), generator=filler)
            generate(model, ids, settings=settings, cache=cache, seed=0, max_new_tokens=min(canvas, room))
    finally:
        cache.truncate(0)
    return time.perf_counter() - t0
