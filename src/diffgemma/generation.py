"""diffgemma.generate: one request through the engine core (docs/ARCHITECTURE.md, 'Generation contract').

One call = prefill the prompt, then propose / commit blocks until a stop token, the token budget, or the block
budget ends the turn. The algorithm is core/steps.generate_steps; the loop that runs it, alone or with other
requests, is core/engine.EngineCore: generate and generate_stream make one core.request.Request and step a core
of their own until it is done.

Cache contract (multi-turn reuse): on return a caller's cache holds the prompt plus exactly the returned `tokens`
(without a caller's cache the last block is not committed: no one reads it). The stop token that ended the turn is
NOT in `tokens` and NOT in the cache (it is reported as `stop_token`); the chat layer appends the template's own
end-of-turn text as part of the next turn's new tokens. When a cache is passed in, `input_ids` are only the tokens
it does not hold yet.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator

from .core import EngineCore, Request, as_ids, cache_need, resolve
from .core.steps import BUDGET, CONTINUE, GRAMMAR_CUT, STOP_STRING, STOP_TOKEN, TRIMMED
from .errors import InputError
from .events import BlockEvent, CancelledEvent, DoneEvent, ErrorEvent, GenerationResult, StepEvent
from .model.protocol import DenoiseModel
from .settings import GenerationSettings
from .slots import Slot

__all__ = ["generate", "generate_stream", "one_request", "GenerationResult", "StepEvent", "BlockEvent", "DoneEvent",
           "BUDGET", "CONTINUE", "GRAMMAR_CUT", "STOP_STRING", "STOP_TOKEN", "TRIMMED"]


def generate(
    model: DenoiseModel,
    input_ids,
    *,
    settings: GenerationSettings | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
    on_block: Callable[[BlockEvent], None] | None = None,
    cache=None,
    **overrides: Any,
) -> GenerationResult:
    """Generate an answer for `input_ids` (LongTensor [T] or list of ids); see the module docstring."""
    for event in generate_stream(model, input_ids, settings=settings, cache=cache, **overrides):
        if isinstance(event, StepEvent):
            if on_step is not None:
                on_step(event)
        elif isinstance(event, BlockEvent):
            if on_block is not None:
                on_block(event)
        else:
            return event.result
    raise AssertionError("generate_stream ended without a DoneEvent")  # pragma: no cover


def one_request(model: DenoiseModel, input_ids, settings: GenerationSettings | None = None, cache=None,
                overrides: dict | None = None) -> Request:
    """The Request of generate(model, input_ids, settings=..., cache=..., **overrides): its settings resolved, its
    ids checked, its cache the caller's (which gets every kept token) or one made for it."""
    s = resolve(model, settings, overrides)
    ids = as_ids(input_ids, model.config.vocab_size, model.embedding.device)
    keep_cache = cache is not None
    if cache is None:
        if ids.numel() == 0:
            raise InputError("input_ids: empty prompt without a cache; expected at least one token")
        cache = model.new_cache(cache_need(model, ids.numel(), s))
    return Request(s, prompt=ids, slot=Slot(cache, ids=None), keep_cache=keep_cache)


def generate_stream(
    model: DenoiseModel,
    input_ids,
    *,
    settings: GenerationSettings | None = None,
    cache=None,
    **overrides: Any,
) -> Iterator[StepEvent | BlockEvent | DoneEvent]:
    """The same loop as generate(), as an iterator of StepEvent, BlockEvent and a final DoneEvent: one request
    stepped through an engine core of its own."""
    request = one_request(model, input_ids, settings, cache, overrides)
    events: deque = deque()
    request.sink = events.append
    core = EngineCore(model)
    core.add_request(request)
    try:
        while events or not request.done:
            if not events:
                core.step()
                continue
            event = events.popleft()
            if isinstance(event, ErrorEvent):
                raise event.error
            if isinstance(event, CancelledEvent):  # pragma: no cover - nobody cancels it
                return
            yield event
    finally:
        core.drop(request)
