"""diffgemma.generate_batch: several requests generated together, their denoise steps stacked into one forward.

Each request is generation.generate_steps: its own settings, RNG stream, stop rules, SC state, re-rolls, block count
and KV cache, as a coroutine that yields a `Forward` whenever a step needs the model and a `Status` where the step
reads its status on the host. The scheduler here only decides which requests step together:

    active = the first max_batch requests (each prefills its prompt as it joins)
    each round:
        one forward over the canvases every active request asked for (model.denoiser([cache, ...]))
        each request takes its logits and queues its step's device work (sampler, accept, renoise, stop rules, SC)
        up to its Status
        one host wait for every request's status (read_asks)
        each request takes its status and runs on up to its next Forward, or, when its block converges, to its
        BlockRead: the round's block reads share one more wait, then each commits its kept tokens and opens the
        next block's canvas
        a request whose turn is over leaves; the next queued request joins

A request whose block converges does not wait for the others: its next block's canvas is in the next round. The
forward is batch invariant (docs/ARCHITECTURE.md, 'Batching'), so every request gets exactly the tokens, steps and
stop reasons `generate` gives it alone. A model that denoises one canvas per forward (max_batch 1) runs the requests one
after another through the same scheduler. On the CUDA engine invariance is measured, not guaranteed (its kernels'
reductions may follow the batch's row count: docs/ARCHITECTURE.md, 'Batching').
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

from .errors import DiffgemmaError, InputError
from .events import DoneEvent, GenerationResult
from .generation import BlockRead, Forward, Status, _as_ids, cache_need, generate_steps, resolve_settings
from .model.denoiser import queue_copy, read_statuses, wait_statuses
from .model.protocol import DenoiseModel
from .settings import GenerationSettings


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
    many requests step together (default: all, or what the model's forward takes; see the module docstring).
    on_event(i, event): request i's StepEvent, BlockEvent and final DoneEvent as they happen. caches: one KV cache per
    request (model.new_cache), each holding what request i's input follows, as generate's `cache`: on return it holds
    that plus the request's tokens (a cache's graphs are kept with it, so a reused cache is not captured again).
    Returns one GenerationResult per request, in order; each equals `generate(model, inputs[i], cache=caches[i], ...)`
    with the same settings."""
    n = len(inputs)
    if n == 0:
        return []
    if seeds is not None and len(seeds) != n:
        raise InputError(f"generate_batch: got {len(seeds)} seeds for {n} requests; expected one per request")
    if caches is not None:
        caches = list(caches)
        if len(caches) != n:
            raise InputError(f"generate_batch: got {len(caches)} caches for {n} requests; expected one per request")
        if len({id(c) for c in caches}) != n:
            raise InputError("generate_batch: a cache appears twice; each request needs its own cache")
    if isinstance(settings, (list, tuple)):
        if len(settings) != n:
            raise InputError(f"generate_batch: got {len(settings)} settings for {n} requests; expected one per request")
        per_request = list(settings)
    else:
        per_request = [settings] * n
    resolved, needs = [], []  # needs: the tokens each request's own cache holds (cache_need), without caches=
    for i in range(n):  # every request checked before any runs
        extra = dict(overrides) if seeds is None else dict(overrides, seed=seeds[i])
        try:
            resolved.append(resolve_settings(model, per_request[i], extra))
            if caches is None:
                tokens = _as_ids(inputs[i], model.config.vocab_size, "cpu").numel()
                if tokens == 0:
                    raise InputError("input_ids: empty prompt; expected at least one token")
                needs.append(cache_need(model, tokens, resolved[i]))
        except DiffgemmaError as e:
            raise type(e)(f"request {i}: {e}") from None
    limit = _batch_limit(model, max_batch, n)
    pool = CachePool(model, limit) if caches is None else None  # the requests' own caches, lent
    lent: dict[int, Any] = {}  # request -> the pooled cache it holds

    results: list[GenerationResult | None] = [None] * n
    queue = deque(range(n))
    running: dict[int, Any] = {}  # request -> its generate_steps coroutine
    asks: dict[int, Forward] = {}  # request -> the forward it waits for
    reads: dict[int, Status] = {}  # request -> the status read it waits for

    def advance(i: int, answer) -> None:
        """Run request i until it asks for a forward (kept in `asks`) or a status read (in `reads`), or its turn is
        over (it leaves)."""
        steps = running[i]
        while True:
            item = steps.send(answer)
            answer = None
            if isinstance(item, Forward):
                asks[i] = item
                return
            if isinstance(item, (Status, BlockRead)):
                reads[i] = item
                return
            if on_event is not None:
                on_event(i, item)
            if isinstance(item, DoneEvent):
                results[i] = item.result
                steps.close()
                del running[i]
                if i in lent:
                    pool.give(lent.pop(i))
                return

    try:
        while queue or running:
            while queue and len(running) < limit:  # joins: prefill, first canvas, up to its first forward
                i = queue.popleft()
                if pool is not None:
                    lent[i] = pool.take(needs[i])
                running[i] = generate_steps(model, inputs[i], settings=resolved[i], batched=limit > 1,
                                            cache=lent[i] if pool is not None else caches[i],
                                            scratch_cache=pool is not None)
                advance(i, None)
            order = sorted(asks)
            forwards = [asks.pop(i) for i in order]
            for i, logits in zip(order, _forward(model, forwards)):
                advance(i, logits)
            forwards = logits = None  # the round's inputs and outputs are the requests' own now
            _answer_statuses(reads, advance)
    finally:
        for steps in running.values():
            steps.close()
    return results  # type: ignore[return-value]


class CachePool:
    """generate_batch's caches when the caller gives none, lent to its requests and emptied and lent again when each
    is done. A cache's size is its request's need rounded up to a size class (a power of two of at least FLOOR
    tokens, within the model's context), so requests of one class share caches of one geometry: the engine's batched
    graphs read their caches' buffers, so a joining request that takes over a cache of the graph's geometry replays
    the graph, where a new cache of its own size would make the membership change a capture
    (model/engine_batch.py). At most `limit` caches stay alive: a new one first drops a free one of another class."""

    FLOOR = 1024

    def __init__(self, model, limit: int):
        self.model, self.limit = model, limit
        self.free: dict[int, list] = {}  # size -> free caches of that size
        self.size: dict[int, int] = {}  # id(cache) -> its size, for every cache alive (lent or free)

    def size_for(self, need: int) -> int:
        size = self.FLOOR
        while size < need:
            size *= 2
        context = getattr(self.model.config, "max_positions", None)  # need (cache_need) never exceeds it
        return size if context is None else max(need, min(size, context))

    def take(self, need: int):
        size = self.size_for(need)
        if self.free.get(size):
            return self.free[size].pop()
        if len(self.size) >= self.limit:  # drop a free cache of another class (every cache lent: none to drop)
            other = next((s for s, caches in self.free.items() if caches), None)
            if other is not None:
                del self.size[id(self.free[other].pop())]
        cache = self.model.new_cache(size)
        self.size[id(cache)] = size
        return cache

    def give(self, cache) -> None:
        cache.truncate(0)
        self.free.setdefault(self.size[id(cache)], []).append(cache)


def _answer_statuses(reads: dict, advance) -> None:
    """Answer the requests parked at a Status or a BlockRead (`reads`: request -> its ask, emptied) with one host wait
    (read_asks), and run each on with advance(request, its answer), in request order; again for any that asks anew."""
    while reads:
        order = sorted(reads)
        answers = read_asks([reads.pop(i) for i in order])
        for i, answer in zip(order, answers):
            advance(i, answer)


def read_asks(asks: list) -> list:
    """Several requests' host reads in one wait: Status asks (read_statuses) and BlockRead asks (a block's values),
    each answered as its own run() would. The blocks' copies are queued first, so a request's block read never waits
    for what another request queues after its own read (its block's commit)."""
    blocks = [k for k, a in enumerate(asks) if isinstance(a, BlockRead)]
    pending = [queue_copy(asks[k].packed) for k in blocks]
    rest = [a for a in asks if not isinstance(a, BlockRead)]
    statuses = iter(read_statuses(rest) if rest else [])
    values = dict(zip(blocks, wait_statuses(pending)))
    return [values[k] if k in values else next(statuses) for k in range(len(asks))]


def _batch_limit(model, max_batch: int | None, n: int) -> int:
    """How many requests step together: max_batch, within what the model's forward takes (its `max_batch`: None for
    any number; a model without one takes a single canvas)."""
    cap = getattr(model, "max_batch", 1)
    if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
        raise InputError(f"generate_batch: max_batch must be a positive integer, got {max_batch!r}")
    limit = max_batch if max_batch is not None else n
    return limit if cap is None else min(limit, cap)


def _forward(model, forwards: list[Forward]) -> list:
    """The round's forward: one request on its own denoiser (exactly generate's step), several in one batched
    forward over their caches, one per canvas length (a re-rolled block's shorter canvas steps apart: a batch's
    kernels are chosen for one canvas length, the one every lane then has alone). Returns each request's logits,
    in order. A batched forward's logits may be views of a buffer the engine's next batched forward overwrites
    (Engine.denoise_batch_raw), so a group's are copied when another batched group follows in the round."""
    if len(forwards) == 1:
        return [forwards[0].run()]
    groups: dict[int, list[int]] = {}
    for k, f in enumerate(forwards):
        groups.setdefault(len(f.canvas), []).append(k)
    batched_left = sum(len(ks) > 1 for ks in groups.values())
    out: list = [None] * len(forwards)
    for ks in groups.values():
        group = [forwards[k] for k in ks]
        if len(group) == 1:
            logits = [group[0].run()]
        else:
            den = model.denoiser([f.cache for f in group])
            logits = den.forward([f.canvas for f in group], sc_logits=[f.sc_logits for f in group],
                                 sc_embeds=[f.sc_embeds for f in group])
            den.close()
            batched_left -= 1
            if batched_left:
                logits = [x.clone() for x in logits]
        for k, x in zip(ks, logits):
            out[k] = x
    return out
