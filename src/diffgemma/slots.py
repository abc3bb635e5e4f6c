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
    ids: list[int] = field(default_factory=list)  # the token ids the cache holds, in order
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
