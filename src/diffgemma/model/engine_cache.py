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
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import InputError
from .kv_cache import kv_fingerprint


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
        self.keys, self.values = [], []
        for layer in cfg.layers:
            rows = (self.ring if layer.is_sliding else max_tokens) + self.canvas
            shape = (layer.num_kv_heads, rows, layer.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=self.device))
            # full layers: V is a separate buffer too (V = no-scale-norm(raw k), not the roped K)
            self.values.append(torch.zeros(shape, dtype=dtype, device=self.device))
        self.slot_pos = torch.full((self.ring,), -1, dtype=torch.int64, device=self.device)
        self.length = 0
        self.length_t = torch.zeros((), dtype=torch.int64, device=self.device)

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
