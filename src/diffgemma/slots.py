"""KV reuse: a slot is a KV cache and the exact token ids it holds, so the next prompt of the same conversation
prefills only what the cache does not hold yet.

Each turn renders the whole conversation; `reuse_prefix` keeps the longest common token prefix of that rendering
and the cache (truncating the cache where they diverge, e.g. when the template drops a thought channel from
history) and the rest is prefilled. A long conversation therefore costs one prefill of each new turn, not of the
whole history. A Session holds one slot; the server's worker holds a few and picks one per request.

With images the ids are a prompt key (vision/prompt.py): each image's run of soft tokens is a negative sentinel
derived from the image's content, so a repeated image matches (and its KV is reused) and another picture does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InputError


@dataclass
class Slot:
    cache: object
    ids: list[int] | None = field(default_factory=list)  # the token ids the cache holds, in order (None: untracked)
    last_used: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists (or prompt keys, see below)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def run_start(ids: list[int], n: int) -> int:
    """`n`, moved back to the start of the image run it falls inside, if any: an image must be prefilled in one
    call (its tokens attend to each other both ways), so a prefix never ends inside one."""
    while 0 < n < len(ids) and ids[n - 1] < 0 and ids[n] == ids[n - 1]:
        n -= 1
    return n


def rewind(cache, length: int) -> int:
    """Truncate `cache` to `length` tokens -> the length it now holds: `length`, or 0 where the rewind is deeper
    than the sliding-window ring can undo (the whole prompt is then prefilled again)."""
    if length >= cache.length:
        return cache.length
    try:
        cache.truncate(length)
    except InputError:
        cache.truncate(0)
        return 0
    return length


def reuse_prefix(cache, cached_ids: list[int], ids: list[int]) -> int:
    """Keep the longest common prefix of what `cache` holds (`cached_ids`) and the next prompt `ids` -> how many
    prompt tokens the cache now serves. At least one prompt token is left to prefill: the model needs one new
    token to condition the canvas on."""
    keep = common_prefix(cached_ids, ids)
    if keep == len(ids):
        keep -= 1
    return rewind(cache, run_start(ids, keep))


def usable_prefix(slot: Slot, ids: list[int]) -> int:
    """How many leading tokens of `ids` the slot holds and could serve: the common prefix, or 0 where its cache
    cannot rewind to it (the fast engine's sliding-window ring goes back at most a canvas past the window; a slot
    taken over deeper than that would prefill everything again)."""
    n = run_start(ids, common_prefix(slot.ids, ids))
    rewind_to = min(n, len(ids) - 1)  # reuse_prefix leaves one prompt token to prefill
    if slot.cache is not None and rewind_to < slot.cache.length and not slot.cache.can_truncate(rewind_to):
        return 0
    return n


class SlotPool:
    """A few slots kept for reuse across requests (the server's), each serving one request at a time. A request
    that names the whole conversation (`ids`) takes the slot sharing the longest prefix (`pick`), rewound to it, and
    prefills only the rest; its cache is made on first use, `max_tokens` long."""

    def __init__(self, model, count: int, max_tokens: int):
        self.model, self.max_tokens = model, max_tokens
        self.slots: list[Slot | None] = [None] * count
        self.busy: set[int] = set()
        self._clock = 0

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def slot(self, i: int) -> Slot:
        """Slot i, its cache made on first use."""
        if self.slots[i] is None:
            self.slots[i] = Slot(self.model.new_cache(self.max_tokens))
        return self.slots[i]

    def pick(self, ids: list[int], busy=()) -> tuple[int, int] | None:
        """-> (slot index, common prefix length) among the slots not in `busy`, or None when every slot is busy. The
        slot sharing the longest prefix, if that is at least half of what it holds (the request continues its
        conversation, or rewinds a little of it); otherwise an unused slot, so a new conversation does not evict one
        that merely shares a system prompt; otherwise the least recently used slot. A prefix counts only where the
        slot's cache can rewind to it (usable_prefix)."""
        slots = self.slots
        free = [i for i in range(len(slots)) if i not in busy]
        shared = {i: usable_prefix(slots[i], ids) for i in free if slots[i] is not None and slots[i].ids}
        if shared:
            i = max(shared, key=lambda j: (shared[j], slots[j].last_used))
            if 2 * shared[i] >= len(slots[i].ids):
                return i, shared[i]
        unused = [i for i in free if slots[i] is None or not slots[i].ids]
        if unused:
            return unused[0], 0
        if not shared:
            return None
        i = min(shared, key=lambda j: slots[j].last_used)
        return i, shared[i]

    def take(self, request) -> bool:
        """Give `request` (with its conversation's `ids`) a slot, rewound to the prefix it shares, and set its prompt
        to the rest -> False when every slot serves a running request."""
        picked = self.pick(request.ids, busy=self.busy)
        if picked is None:
            return False
        i = picked[0]
        slot = self.slot(i)
        slot.last_used = self.tick()
        self.busy.add(i)
        keep = reuse_prefix(slot.cache, slot.ids, request.ids)
        request.slot, request.slot_index, request.prompt = slot, i, request.ids[keep:]
        return True

    def give(self, request) -> None:
        self.slots[request.slot_index].last_used = self.tick()
        self.busy.discard(request.slot_index)


class CachePool:
    """Caches lent to requests that bring none (generate_batch), emptied and lent again when each is done. A cache's
    size is its request's need rounded up to a size class (a power of two of at least FLOOR tokens, within the
    model's context), so requests of one class share caches of one geometry: the engine's batched graphs read their
    caches' buffers, so a joining request that takes over a cache of the graph's geometry replays the graph, where a
    new cache of its own size would make the membership change a capture (model/engine_batch.py). At most `limit`
    caches stay alive: a new one first drops a free one of another class. A lent cache does not get the last block's
    commit (no one reads it)."""

    FLOOR = 1024

    def __init__(self, model, limit: int, need=None):
        self.model, self.limit = model, limit
        self.need = need  # request -> the tokens its cache must hold
        self.free: dict[int, list] = {}  # size -> free caches of that size
        self.size: dict[int, int] = {}  # id(cache) -> its size, for every cache alive (lent or free)

    def size_for(self, need: int) -> int:
        size = self.FLOOR
        while size < need:
            size *= 2
        context = getattr(self.model.config, "max_positions", None)  # need (cache_need) never exceeds it
        return size if context is None else max(need, min(size, context))

    def take_cache(self, need: int):
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

    def give_cache(self, cache) -> None:
        cache.truncate(0)
        self.free.setdefault(self.size[id(cache)], []).append(cache)

    def take(self, request) -> bool:
        request.slot, request.keep_cache = Slot(self.take_cache(self.need(request)), ids=None), False
        return True

    def give(self, request) -> None:
        self.give_cache(request.slot.cache)
