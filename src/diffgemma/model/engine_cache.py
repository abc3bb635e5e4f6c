"""The fast engine's KV cache: f16, ring buffers for sliding layers, position-indexed full layers.

Per layer, K and V are [kv_heads, rows, head_dim] (head-major, so an attention read is a plain view):

  full layer     rows = max_tokens + canvas. Row p holds position p. The denoise canvas writes its
                 own K/V into rows [length, length + canvas): scratch past the live prefix, which
                 the next prefill simply overwrites. Attention reads rows [0, length + canvas).
  sliding layer  rows = ring + canvas. Slot p % ring holds position p; rows [ring, ring + canvas)
                 are the canvas scratch. ring = (window - 1) + rewind_slack: a read needs the last
                 window-1 positions, and the slack is how far `truncate` may rewind before the
                 positions it would need have been overwritten (an error says so, never garbage).

`slot_pos[s]` (device, shared by all sliding layers) is the position held by ring slot s, or -1;
attention masks are built from it on the device, so the denoise step needs no host sync and can be
replayed as a CUDA graph. `length_t` mirrors `length` on the device for the same reason.

The buffers and the length live in the cache's `store` (KVStore): what a captured graph reads, by address. Two caches
of one geometry may exchange stores (swap_stores, which moves the live rows along): each keeps its contents, now at
the other's addresses. A batched denoise graph is captured over a set of stores, and the engine hands a new batch's
caches those stores to replay it (model/engine_batch.py).
"""

from __future__ import annotations

import weakref

import torch

from ..config import ModelConfig
from ..errors import InputError
from .kv_cache import kv_fingerprint


class KVStore:
    """One cache's buffers (K and V per layer, the ring's slot positions, the device length) and its host length;
    `owner` is a weak reference to the cache holding it."""

    __slots__ = ("keys", "values", "slot_pos", "length", "length_t", "owner", "__weakref__")

    def __init__(self, keys, values, slot_pos, length_t, owner):
        self.keys, self.values, self.slot_pos, self.length_t = keys, values, slot_pos, length_t
        self.length = 0
        self.owner = weakref.ref(owner)


def swap_stores(a: "EngineKVCache", b: "EngineKVCache") -> None:
    """Exchange the stores of two caches of one geometry, their contents moved with them: each cache keeps its
    contents and length, now at the other's former addresses. The live rows are copied, queued on the current
    stream after any work already queued on either cache (full layers: the longer length's rows; sliding layers:
    the ring; the canvas scratch rows are not live)."""
    if a is b:
        return
    if a.geometry != b.geometry:
        raise ValueError(f"swap_stores: caches of another geometry ({a.geometry} vs {b.geometry})")
    live = max(a.length, b.length)
    pairs = [(a.slot_pos, b.slot_pos), (a.length_t, b.length_t)]
    for li, layer in enumerate(a.cfg.layers):
        rows = a.ring if layer.is_sliding else live
        pairs += [(a.keys[li][:, :rows], b.keys[li][:, :rows]), (a.values[li][:, :rows], b.values[li][:, :rows])]
    for x, y in pairs:
        tmp = x.clone()
        x.copy_(y)
        y.copy_(tmp)
    a._store, b._store = b._store, a._store
    a._store.owner, b._store.owner = weakref.ref(a), weakref.ref(b)
    a._store.length, b._store.length = b._store.length, a._store.length


class EngineKVCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, device, dtype=torch.float16,
                 canvas: int | None = None, rewind_slack: int | None = None):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise InputError(f"new_cache: max_tokens must be a positive integer, got {max_tokens!r}")
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.canvas = canvas or cfg.canvas_length
        self.window = cfg.sliding_window
        self.slack = self.canvas if rewind_slack is None else rewind_slack
        self.ring = self.window - 1 + self.slack
        self.device = torch.device(device)
        self.dtype = dtype
        keys, values = [], []
        for layer in cfg.layers:
            rows = (self.ring if layer.is_sliding else max_tokens) + self.canvas
            shape = (layer.num_kv_heads, rows, layer.head_dim)
            keys.append(torch.zeros(shape, dtype=dtype, device=self.device))
            # full layers: V is a separate buffer too (V = no-scale-norm(raw k), not the roped K)
            values.append(torch.zeros(shape, dtype=dtype, device=self.device))
        self._store = KVStore(keys, values, torch.full((self.ring,), -1, dtype=torch.int64, device=self.device),
                              torch.zeros((), dtype=torch.int64, device=self.device), self)

    # ------------------------------------------------------------------ the store

    @property
    def store(self) -> KVStore:
        return self._store

    keys = property(lambda self: self._store.keys)
    values = property(lambda self: self._store.values)
    slot_pos = property(lambda self: self._store.slot_pos)
    length_t = property(lambda self: self._store.length_t)

    @property
    def length(self) -> int:
        return self._store.length

    @length.setter
    def length(self, value: int) -> None:
        self._store.length = value

    @property
    def geometry(self) -> tuple:
        """What two caches must share to exchange stores: the model's layers, the sizes, the device and dtype."""
        return (id(self.cfg), self.max_tokens, self.canvas, self.window, self.ring, self.device, self.dtype)

    # ------------------------------------------------------------------ bookkeeping

    def check_room(self, extra: int) -> None:
        if self.length + extra > self.max_tokens:
            raise InputError(
                f"KV cache overflow: {self.length} tokens cached + {extra} new > max_tokens={self.max_tokens}; "
                f"create the cache with a larger max_tokens (ask / chat: --context)"
            )

    def ring_slots(self, positions: torch.Tensor, end: int) -> torch.Tensor:
        """Ring slot for each position, or -1 where a later position in the same write takes that slot."""
        return torch.where(positions >= end - self.ring, positions % self.ring, torch.full_like(positions, -1))

    def advance(self, positions: torch.Tensor, end: int) -> None:
        """Record that `positions` (ending at `end`) were written to every layer."""
        slots = self.ring_slots(positions, end)
        keep = slots >= 0
        self.slot_pos[slots[keep]] = positions[keep]
        self.length = end
        self.length_t.fill_(end)

    def can_truncate(self, length: int) -> bool:
        """Whether truncate(length) can rewind here: the positions a read after the rewind needs are intact iff no
        later write reused their ring slots (a rewind deeper than the slack past the window is not)."""
        return 0 <= length <= self.length and (length == 0 or max(0, length - (self.window - 1))
                                                  >= self.length - self.ring)

    def truncate(self, length: int) -> None:
        """Forget every position >= length (rewind to a shorter prefix)."""
        if not isinstance(length, int) or not 0 <= length <= self.length:
            raise InputError(f"truncate({length!r}): cache holds {self.length} tokens")
        if length == self.length:
            return
        if not self.can_truncate(length):
            raise InputError(
                f"truncate({length}): rewinding {self.length - length} tokens is deeper than the sliding-window "
                f"ring allows ({self.slack}; the older window positions were overwritten). Re-prefill instead, "
                f"or create the cache with a larger rewind_slack"
            )
        self.slot_pos.masked_fill_(self.slot_pos >= length, -1)
        self.length = length
        self.length_t.fill_(length)

    # ------------------------------------------------------------------ reads

    def live_ring_slots(self) -> torch.Tensor:
        """Slots holding the last window-1 positions, in position order (what a denoise may read)."""
        start = max(0, self.length - (self.window - 1))
        pos = torch.arange(start, self.length, device=self.device)
        return pos % self.ring

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Position-ordered [kv_heads, T, hd] K and V a canvas would read (for tests and fingerprints)."""
        if self.cfg.layers[layer].is_sliding:
            s = self.live_ring_slots()
            return self.keys[layer][:, s], self.values[layer][:, s]
        return self.keys[layer][:, : self.length], self.values[layer][:, : self.length]

    def live_kv(self) -> list[torch.Tensor]:
        """The live K and V of every layer (what later forwards can read), position-ordered: K0, V0, K1, ..."""
        return [t for layer in range(len(self.keys)) for t in self.visible(layer)]

    def fingerprint(self) -> str:
        return kv_fingerprint(self)
