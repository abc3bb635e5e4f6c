"""A request as data: what to generate, where, with which settings, and what it has done so far.

Every driver (generate, generate_batch, Session, replay, the server's worker) makes Requests and hands them to the
engine core (core/engine.py), which moves them along: queued -> prefill (its prompt, in chunks) -> denoise (the
generation's blocks) -> done. Any layer may read a request's visible state (phase, block, step, tokens) while it
runs; its events (events.py) go to its `sink` as they happen.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import InputError
from ..settings import GenerationSettings, settings_for_call
from ..slots import Slot

_ids = itertools.count(1)

QUEUED, PREFILL, DENOISE, DONE = "queued", "prefill", "denoise", "done"


def resolve(model, settings: GenerationSettings | None = None, overrides: dict | None = None) -> GenerationSettings:
    """The settings of one call: explicit `settings` with the call's `overrides` on top, or, with none given, the
    model's generation_config <- DIFFGEMMA_* env <- overrides (settings.settings_for_call). The engine core fills in
    canvas_length when a request joins (EngineCore.add_request)."""
    return settings_for_call(getattr(model, "generation_config", None), settings, overrides)


def as_ids(input_ids, vocab: int, device="cpu") -> torch.Tensor:
    """The one check of token ids: a LongTensor [T] (or [1, T]) or a list of ids, each in [0, vocab) -> LongTensor
    [T] on `device`; else an InputError naming what was expected."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise InputError(f"input_ids: expected shape [T] (or [1, T]), got {list(input_ids.shape)}")
        if ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
            raise InputError(f"input_ids: expected integer token ids, got dtype {ids.dtype}")
    else:
        try:
            ids = torch.tensor(list(input_ids), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise InputError("input_ids: expected a LongTensor [T] or a list of token ids") from None
        if ids.dim() != 1:
            raise InputError("input_ids: expected a flat list of token ids")
    ids = ids.to(device=device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError(f"input_ids: ids must be in [0, {vocab}), got range [{int(ids.min())}, {int(ids.max())}]")
    return ids


def canvas_length(model, s: GenerationSettings) -> int:
    """The one rule for a request's canvas: the settings' canvas_length, or where that is None the model's."""
    return s.canvas_length if s.canvas_length is not None else model.config.canvas_length


def cache_need(model, prompt_tokens: int, s: GenerationSettings) -> int:
    """The tokens a cache made for one generation holds: the prompt, the reply's budget and a canvas, never past the
    model's context (config.check_context; an overflow is an error)."""
    need = prompt_tokens + s.max_new_tokens + canvas_length(model, s)
    limit = getattr(model.config, "max_positions", None)
    return need if limit is None else min(need, limit)


@dataclass
class Request:
    """One request. `prompt`: the ids to prefill after what the slot's cache holds when the request starts (a prompt
    key with images: vision/prompt.py; `images` maps its keys to the images); `ids`: the whole conversation's ids,
    when the core's slots choose the slot (the prompt is then what the chosen slot does not hold). `slot`: the KV
    slot (slots.Slot; `slot.ids` None when the caller's cache is not tracked), or None for the core's slots to
    choose. keep_cache: the cache gets the last block's commit too. turn: a chat turn (a StartEvent first; a
    malformed tool call regenerated up to `tool_retries` times where `call_cut` finds one; with `repair` and the setting
    tool_repair, a reply with an invalid tool call repaired instead: core/repair.py). prefill_chunk: the
    prompt's prefill chunk (None: one call); `log`: an oplog.OpLog journaling each generation."""

    settings: GenerationSettings
    prompt: Any = None
    ids: list[int] | None = None
    slot: Slot | None = None
    slot_index: int = 0
    images: dict | None = None
    keep_cache: bool = True
    turn: bool = False
    tool_retries: int = 0
    call_cut: Callable[[list[int]], int | None] | None = None
    repair: Any = None  # a turn's tool repair view (tool_repair.ToolRepair), used where its settings ask
    prefill_chunk: int | None = None
    log: Any = None
    next_gen: Callable[[], int] = lambda: 0
    sink: Callable[[Any], None] = lambda event: None
    id: int = field(default_factory=lambda: next(_ids))
    # visible state: what the request is doing and has done
    phase: str = QUEUED
    block: int = 0  # blocks its current generation has ended
    step: int = 0  # denoise steps of its current generation
    tokens: list[int] = field(default_factory=list)  # reply tokens so far
    chunks: list[int] = field(default_factory=list)  # sizes of the prompt chunks left to prefill
    one_chunk: bool = True  # its whole prompt was one chunk when it joined (prefilled outside the budget)
    pooled: bool = False  # its slot came from the core's slots (given back when it is done)
    end: Any = None  # its last event (DoneEvent, CancelledEvent or ErrorEvent) once done
    t0: float = field(default_factory=time.perf_counter)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    interrupted: bool = False  # cancel as a Ctrl-C would (the cache emptied; replay of a logged interrupt)
    run: Any = field(default=None, repr=False)  # the engine core's working state while it runs (core/engine.py)

    def cancel(self, interrupted: bool = False) -> None:
        """Stop the request: before it starts, before its next prompt chunk (after the first) or denoise step, or
        after its next event. Safe from any thread."""
        self.interrupted = self.interrupted or interrupted
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.phase == DONE
