"""The reference model's KV cache: every position of every layer, in the compute dtype.

Deliberately the simplest layout (no ring buffers): the reference keeps all positions and applies
the sliding window when it reads. The fast engine keeps its own f16 ring-buffer cache; both expose
`length`, `truncate` and `fingerprint`, and fingerprint only the positions a forward can still read.
"""

from __future__ import annotations

import hashlib

import torch

from ..config import ModelConfig
from ..errors import InputError


class ReferenceKVCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, device):
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InputError(f"new_cache: max_tokens must be a positive integer, got {max_tokens!r}")
        self.cfg = cfg
        self.max_tokens = max_tokens
        # Per layer: [kv_heads, T, head_dim], grown by concatenation.
        self.keys = [torch.zeros(l.num_kv_heads, 0, l.head_dim, dtype=dtype, device=device) for l in cfg.layers]
        self.values = [torch.zeros(l.num_kv_heads, 0, l.head_dim, dtype=dtype, device=device) for l in cfg.layers]
        # The full layers' top-k sparse attention for this cache's forwards (ops/attention_topk.TopKRule; the
        # generation setting topk_attention), or None: dense. The engine's cache takes the same attribute.
        self.attention_topk = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]

    def check_room(self, extra: int) -> None:
        if self.length + extra > self.max_tokens:
            raise InputError(
                f"KV cache overflow: {self.length} tokens cached + {extra} new > max_tokens={self.max_tokens}; "
                f"create the cache with a larger max_tokens (ask / chat: --context)"
            )

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[layer] = torch.cat([self.keys[layer], k], dim=1)
        self.values[layer] = torch.cat([self.values[layer], v], dim=1)

    def can_truncate(self, length: int) -> bool:
        """Whether truncate(length) can rewind here: always, within what the cache holds (it keeps every position)."""
        return 0 <= length <= self.length

    def truncate(self, length: int) -> None:
        """Forget every position >= length (rewind to a shorter prefix)."""
        if not 0 <= length <= self.length:
            raise InputError(f"truncate({length}): cache holds {self.length} tokens")
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]

    def visible(self, layer: int, for_denoise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What a denoise canvas may read: sliding layers see only the last window-1 positions."""
        k, v = self.keys[layer], self.values[layer]
        if for_denoise and self.cfg.layers[layer].is_sliding:
            keep = self.cfg.sliding_window - 1
            k, v = k[:, max(0, k.shape[1] - keep):], v[:, max(0, v.shape[1] - keep):]
        return k, v

    def live_kv(self) -> list[torch.Tensor]:
        """The live K and V of every layer (what later forwards can read), position-ordered: K0, V0, K1, ..."""
        return [t for layer in range(len(self.keys)) for t in self.visible(layer, for_denoise=True)]

    def fingerprint(self) -> str:
        return kv_fingerprint(self)


def kv_fingerprint(cache) -> str:
    """sha256 over a cache's length and its live KV (cache.live_kv()), as f32 bytes: the golden fixture's KV pin, the
    same for the reference cache and the engine's."""
    h = hashlib.sha256()
    h.update(str(cache.length).encode())
    for t in cache.live_kv():
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
