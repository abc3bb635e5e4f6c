"""What generation may call on a model: implemented by the reference model (model/reference.py) and the engine
(model/engine.py). The engine core (core/) uses nothing else.

A step reaches the device through a Denoiser (model/denoiser.py), which the model makes for the caches it denoises:
`model.denoiser([cache])`. A model that takes several canvases per forward (its `max_batch`: None for any number;
without the attribute, one) also makes one for several caches, whose forward takes B canvases and returns B logits;
each request's bookkeeping and status read stay on its own one-cache denoiser (core/lanes.py, core/steps.generate_steps).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from ..config import ModelConfig


@runtime_checkable
class KVCache(Protocol):
    """A model's KV cache: the positions it holds, rewindable to a prefix."""

    max_tokens: int

    @property
    def length(self) -> int: ...

    def can_truncate(self, length: int) -> bool: ...

    def truncate(self, length: int) -> None: ...

    def fingerprint(self) -> str: ...


@runtime_checkable
class Denoiser(Protocol):
    """One denoise step's device side (see model/denoiser.py for the two implementations)."""

    cap: float | None  # the softcap the sampler applies to forward()'s logits, or None when they are softcapped
    run_ahead: bool  # read_status may stage (and launch) the next forward: the sparse SC bets ahead for it

    def forward(self, canvas: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor: ...

    def bookkeeping(self, join: bool = False) -> AbstractContextManager: ...

    def scratch(self) -> torch.Tensor | None: ...

    def read_status(self, code: torch.Tensor, mean_h: torch.Tensor, plan, canvas: torch.Tensor): ...

    def close(self) -> None: ...


@runtime_checkable
class DenoiseModel(Protocol):
    """A DiffusionGemma model as generate sees it."""

    config: ModelConfig
    generation_config: dict
    tokenizer: Any  # decode(ids) -> str, or None

    @property
    def embedding(self) -> torch.Tensor: ...  # [V, H], the tied lm_head; its device is the model's

    def new_cache(self, max_tokens: int) -> KVCache: ...

    def prefill(self, cache: KVCache, ids: torch.Tensor) -> None: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def denoise(self, cache: KVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor: ...  # softcapped f32 logits [C, V]

    def context_buckets(self, cache: KVCache) -> list[int]: ...  # the context lengths that capture new graphs

    def denoiser(self, caches: Sequence[KVCache]) -> Denoiser: ...
