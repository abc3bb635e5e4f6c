"""The events of a generation, one vocabulary from the denoising loop to its consumers.

The generation algorithm (core/steps.py) yields StepEvent, BlockEvent and a final DoneEvent; the engine core
(core/engine.py) hands them to each request's sink and adds its own: a generation ends with DoneEvent,
CancelledEvent or ErrorEvent; a chat turn (core/turn.py) opens with StartEvent and announces a regenerated tool call
with RetryEvent. The CLI's canvas view, `Session`, the server's worker queue and HTTP handlers, and the op-log
(`oplog.record`) all read these classes; nothing downstream translates them into strings or tuples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:  # only for the annotations: events carry tensors but need not import torch
    import torch

    from .settings import GenerationSettings


@dataclass
class StepEvent:
    """One denoising step. Tensors live on the model's device; call .tolist() to look at them."""

    block: int
    attempt: int  # 0, or the re-roll number of a degenerate first block
    step: int  # 1-based
    temperature: float
    draft: torch.Tensor  # [C] argmax canvas of this step
    accepted: torch.Tensor  # [C] bool accept mask of this step
    mean_entropy: float
    stop_reason: str | None  # set on the block's last step
    entropy: torch.Tensor | None = None  # [C] f32 per-position entropy (nats) of this step's logits


@dataclass
class BlockEvent:
    """One committed block."""

    block: int
    tokens: list[int]  # what this block added to the answer (and to the cache)
    steps: int  # denoising steps of the committed attempt
    stop_reason: str  # confident / plateau / entropy / max_steps
    end: str  # generation.STOP_TOKEN / STOP_STRING / BUDGET / TRIMMED / CONTINUE
    attempts: int  # 1 + re-rolls
    stop_token: int | None = None
    trimmed_at: int | None = None


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str | None
    steps_per_block: list[int]
    tokens_per_forward: float
    stop_reasons: list[str]  # per committed block
    timings: dict[str, float]
    retries: int
    stop_token: int | None = None  # the stop id that ended the turn (not part of tokens)
    forwards: int = 0  # denoise forwards, re-rolled attempts included
    block_ends: list[str] = field(default_factory=list)
    settings: GenerationSettings | None = None
    tool_retries: int = 0  # regenerations of a malformed tool call (core/turn.py, opt-in)
    tool_repairs: int = 0  # tool repair rounds the reply took (core/repair.py, opt-in); 0: none ran
    tool_repair_failed: bool = False  # the repair's attempts ran out with a call still invalid (the last reply stands)
    stop_string: str | None = None  # the stop text that ended the turn (its tokens are in tokens, not in text)


@dataclass
class DoneEvent:
    """Last event of a generation that ran to its end: the whole result."""

    result: GenerationResult


@dataclass
class StartEvent:
    """First event of a turn (core/turn.py): how much of the prompt the KV cache already held."""

    cached_tokens: int  # prompt tokens served from the cache
    prefill_tokens: int  # prompt tokens prefilled for this turn


@dataclass
class RetryEvent:
    """A malformed tool call is regenerated from its opener (core/turn.py), or a reply with an invalid call is
    written again by the tool repair (core/repair.py, kept 0): the reply keeps its first `kept` tokens and the blocks
    that follow replace the rest."""

    attempt: int  # 1 for the first regeneration
    kept: int  # reply tokens kept


@dataclass
class CancelledEvent:
    """Last event of a generation stopped on request, between denoise steps, or interrupted (Ctrl-C: a
    KeyboardInterrupt, which the engine core journals and then passes on)."""

    blocks: int = 0  # blocks committed before it stopped (0: it never started)
    kept: int | None = None  # tokens the slot's cache was rewound to (None: it never started)
    interrupted: bool = False  # a KeyboardInterrupt, at any point: the cache was emptied (kept 0)


@dataclass
class ErrorEvent:
    """Last event of a generation that failed; the slot's cache was emptied."""

    error: BaseException

    @property
    def message(self) -> str:
        """'Type: message', as the op-log records it."""
        return f"{type(self.error).__name__}: {self.error}"


Event = Union[StartEvent, StepEvent, BlockEvent, RetryEvent, DoneEvent, CancelledEvent, ErrorEvent]

__all__ = ["StepEvent", "BlockEvent", "GenerationResult", "DoneEvent", "StartEvent", "RetryEvent", "CancelledEvent",
           "ErrorEvent", "Event"]
