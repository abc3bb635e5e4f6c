"""diffgemma.generate_batch: several requests generated together, their denoise steps stacked into one forward.

Each input is one core.request.Request with its own settings, RNG stream, stop rules, SC state, re-rolls, block count
and KV cache; one engine core (core/engine.py) steps them: the first max_batch join (each prefills its prompt as it
joins), every round runs one forward over their canvases and one host wait for their statuses, a request whose turn
is over leaves and the next queued one joins. A request whose block converges does not wait for the others: its next
block's canvas is in the next round. The forward is batch invariant (docs/ARCHITECTURE.md, 'Batching'), so every
request gets exactly the tokens, steps and stop reasons `generate` gives it alone. A model that denoises one canvas
per forward (max_batch 1) runs the requests one after another through the same core. On the CUDA engine invariance
is checked by the GPU tests, not guaranteed (its kernels' reductions may follow the batch's row count:
docs/ARCHITECTURE.md, 'Batching').
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .core import EngineCore, Request, as_ids, batch_size, cache_need, resolve
from .errors import DiffgemmaError, InputError
from .events import ErrorEvent, GenerationResult
from .model.protocol import DenoiseModel
from .settings import GenerationSettings
from .slots import CachePool, Slot


def generate_batch(
    model: DenoiseModel,
    inputs: Sequence,
    *,
    seeds: Sequence[int] | None = None,
    settings: GenerationSettings | Sequence[GenerationSettings | None] | None = None,
    max_batch: int | None = None,
    on_event: Callable[[int, Any], None] | None = None,
    caches: Sequence | None = None,
    **overrides: Any,
) -> list[GenerationResult]:
    """Generate an answer for each of `inputs` (each a LongTensor [T] or a list of ids), batched.

    seeds: one per request (overrides each request's seed). settings: None (the model's generation_config <- env),
    one GenerationSettings for all, or one (or None) per request; **overrides apply to every request. max_batch: how
    many requests step together (default: all, within what the model's forward takes). on_event(i, event): request
    i's StepEvent, BlockEvent and final DoneEvent as they happen. caches: one KV cache per request (model.new_cache),
    each holding what request i's input follows, as generate's `cache`: on return it holds that plus the request's
    tokens (a cache's graphs are kept with it, so a reused cache is not captured again); without them the requests
    take caches from a slots.CachePool of max_batch caches.
    Returns one GenerationResult per request, in order; each equals `generate(model, inputs[i], cache=caches[i], ...)`
    with the same settings."""
    n = len(inputs)
    if n == 0:
        return []
    caches = _check_counts(n, seeds, caches, settings)
    per_request = list(settings) if isinstance(settings, (list, tuple)) else [settings] * n
    requests = []
    for i in range(n):  # every request checked before any runs
        extra = dict(overrides) if seeds is None else dict(overrides, seed=seeds[i])
        try:
            s = resolve(model, per_request[i], extra)
            ids = as_ids(inputs[i], model.config.vocab_size, model.embedding.device)
            if caches is None and ids.numel() == 0:
                raise InputError("input_ids: empty prompt; expected at least one token")
        except DiffgemmaError as e:
            raise type(e)(f"request {i}: {e}") from None
        sink = (lambda event, i=i: on_event(i, event)) if on_event is not None else (lambda event: None)
        requests.append(Request(s, prompt=ids, slot=None if caches is None else Slot(caches[i], ids=None),
                                sink=sink))
    cap = batch_size(model, max_batch)  # checked before any cache is made
    limit = cap if max_batch is not None else n if cap is None else min(n, cap)  # default: all that fit
    pool = None
    if caches is None:  # the requests' own caches, lent
        pool = CachePool(model, limit, need=lambda r: cache_need(model, len(r.prompt), r.settings))
    core = EngineCore(model, max_batch=limit, slots=pool)
    ends = core.run(requests)
    for end in ends:
        if isinstance(end, ErrorEvent):
            raise end.error
    return [end.result for end in ends]


def _check_counts(n: int, seeds, caches, settings) -> list | None:
    """One seed, cache, settings per request where lists are given -> the caches as a list (or None)."""
    if seeds is not None and len(seeds) != n:
        raise InputError(f"generate_batch: got {len(seeds)} seeds for {n} requests; expected one per request")
    if isinstance(settings, (list, tuple)) and len(settings) != n:
        raise InputError(f"generate_batch: got {len(settings)} settings for {n} requests; expected one per request")
    if caches is None:
        return None
    caches = list(caches)
    if len(caches) != n:
        raise InputError(f"generate_batch: got {len(caches)} caches for {n} requests; expected one per request")
    if len({id(c) for c in caches}) != n:
        raise InputError("generate_batch: a cache appears twice; each request needs its own cache")
    return caches
