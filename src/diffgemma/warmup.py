"""Warm a model up on the caches that will serve: compile its kernels and capture its denoise graphs first.

Why: on CUDA, the first denoise a cache makes at each context bucket captures that bucket's graphs (two eager runs,
the capture, the guarded twin), and the first launch of each Triton kernel in a process loads or compiles it. A
server that does this on its first requests makes those clients wait for it; warmed at start, they do not.

How: one short generation per bucket, with the settings requests will use, on the cache itself (graphs are kept per
cache), its prompt filler tokens that bring the cache's length into that bucket; then the cache is emptied. Tokens
never depend on it: a rewound cache masks every row past its length, and the GPU tests check that a warmed slot
gives a fresh one's tokens.

A server that batches also meets batched forwards of every size up to its batch, whose graphs are kept by shape
(model/engine_batch.py), not by cache, and so, where the engine graphs them, are the batched commits of lanes that
end a block in one round: `warm_up_batches` captures both at the lanes' common shape (one canvas length, every lane
in one context bucket) for each size, so that the sizes arrivals happen to make replay from the first request on
rather than running eagerly and capturing mid-stream.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .core.request import canvas_length
from .errors import InputError
from .generation import generate

FILLER_SEED = 0


def bucket_lengths(buckets: list[int]):
    """(bucket, the cache length a warm-up brings into it) for each context bucket, ascending: bucket k serves the
    lengths above bucket k-1 up to its own; a short prompt in the first, just past the one below in the others."""
    for low, top in zip([0] + buckets[:-1], buckets):
        yield top, min(8, top) if low == 0 else low + 1


def warm_up(model, cache, settings, *, progress: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> float:
    """Run one short generation in every context bucket `cache` can reach, then empty it. `settings` are those
    requests will use (their SC mode and sampler pick the graphs and kernels). `should_stop()` is asked before each
    bucket: True ends the warm-up there (the cache is emptied all the same). -> seconds taken."""
    if cache.length != 0:
        raise InputError(f"warm_up: the cache holds {cache.length} tokens; expected an empty one (it is emptied after)")
    t0 = time.perf_counter()
    canvas = canvas_length(model, settings)
    buckets = model.context_buckets(cache)
    filler = torch.Generator().manual_seed(FILLER_SEED)
    try:
        for top, target in bucket_lengths(buckets):
            if should_stop():
                break
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


def warm_up_batches(model, caches, settings, *, progress: Callable[[str], None] | None = None,
                    should_stop: Callable[[], bool] = lambda: False) -> float:
    """Capture the batched denoise graph of every batch size from 2 to len(caches) with all lanes in one context bucket
    and at the settings' canvas length, then, where the engine graphs them (options.batch_prefill_graphs), the batched
    commit of that many canvases (Engine.prefill_batch; each cache rewound after it), bucket by bucket from the
    lowest, as many as the engine keeps (no warmed graph pushes out another). Only on an engine that keeps batch
    graphs (CUDA with graphs on); elsewhere nothing runs. The caches must be empty and are emptied after.
    `should_stop()` is asked before each bucket. -> seconds taken."""
    if len(caches) < 2 or not getattr(model, "keeps_batch_graphs", False):
        return 0.0
    if any(c.length != 0 for c in caches):
        raise InputError("warm_up_batches: expected empty caches (they are emptied after)")
    t0 = time.perf_counter()
    canvas = canvas_length(model, settings)
    commits = model.options.batch_prefill_graphs  # an engine that keeps batch graphs has options
    sizes = range(2, len(caches) + 1)
    room = model.batch_graphs_kept // len(sizes)  # buckets whose sizes all fit among the kept graphs
    buckets = model.context_buckets(caches[0])[:room]
    filler = torch.Generator().manual_seed(FILLER_SEED)
    try:
        for _, target in bucket_lengths(buckets):
            if should_stop():
                break
            if target + canvas > caches[0].max_tokens:
                break
            if progress is not None:
                progress(f"batches of 2 to {len(caches)} at context {target}")
            for cache in caches:
                ids = torch.randint(0, model.config.vocab_size, (target - cache.length,), generator=filler)
                model.prefill(cache, ids.to(model.device))
            canvases = [torch.randint(0, model.config.vocab_size, (canvas,), generator=filler).to(model.device)
                        for _ in caches]
            for b in sizes:  # seen once (eager), then captured and replayed
                for _ in range(2):
                    model.denoise_batch_raw(caches[:b], canvases[:b])
            if not commits or canvas > min(c.slack for c in caches):  # no commit graphs, or one they cannot rewind
                continue
            for b in sizes:  # the commits of b lanes that end a block in one round, likewise
                for _ in range(2):
                    model.prefill_batch(caches[:b], canvases[:b])
                    for cache in caches[:b]:
                        cache.truncate(target)
    finally:
        for cache in caches:
            cache.truncate(0)
    return time.perf_counter() - t0
