"""The tool repair stage of a chat turn (the setting `tool_repair`; docs/ARCHITECTURE.md, 'Tool repair').

The turn's prompt end is its mark (Live.reply_start). A generation ends; where its reply holds an invalid tool call
(Request.repair.problems: it does not parse, names a function not offered, or breaks that function's parameter
schema), one error tool-response per invalid call (Request.repair.feedback) is prefilled after the reply, and the
reply is written again from there as a generation of its own, to the turn's natural end: the tool-response opener is
taken out of its stop ids, and what it writes from its first response opener on (a response the model imagined) is
trimmed off. That repeats, each round on top of the last, while a call is invalid, up to `tool_repair_attempts`
rounds or while the cache has room. Then the cache is rewound to the mark and the last reply (the clean one, or the
last one with the result's `tool_repair_failed` set) is prefilled there in one call: the cache holds the prompt and
that reply only, exactly as a cache that never saw the bad exchange and was given the same reply, and the turn's
result carries that reply alone. Where the rewind cannot reach the mark (a sliding-window ring goes back only its
slack), the prompt's lost part is prefilled again in a call of its own, then the reply in one call: the calls a cache
given the prompt and then the reply makes. Each prefill is journaled as an 'extend' op (oplog.py), so `diffgemma
replay` rebuilds the same cache.
"""

from __future__ import annotations

import dataclasses

from .. import oplog
from ..events import DoneEvent, RetryEvent
from ..slots import rewind
from .request import as_ids, canvas_length
from .steps import control_ids


def repair_on(r) -> bool:
    """Whether r's turn runs the tool repair: asked for in its settings, with a view of the chat's tools."""
    return r.turn and r.repair is not None and r.settings.tool_repair


def repair_step(model, r, event: DoneEvent, emit, reopen, combine) -> DoneEvent | None:
    """r's generation ended with `event`: the turn's last event, or None where the reply is written again (its next
    generation opened by `reopen(model, r, emit)`, with a RetryEvent to the sink). combine(results, tokens,
    tokenizer): one GenerationResult of a turn's generations (core/turn.combined)."""
    live, result = r.run, event.result
    live.results.append(result)
    tokens, stop = list(result.tokens), result.stop_token
    if live.repairs:  # a rewritten reply: what follows its first response opener is the model's own invention
        cut = r.repair.trim(tokens)
        if cut is not None:
            tokens, stop = tokens[:cut], r.repair.opener
    if not live.repairs:
        full = live.full
        live.turn_ids = None if full is None or any(int(t) < 0 for t in full) else [int(t) for t in full]
    problems = r.repair.problems(tokens)
    feedback = None
    if problems and live.repairs < live.settings.tool_repair_attempts and live.turn_ids is not None:
        feedback = r.repair.feedback(problems)
        need = len(feedback) + live.budget + canvas_length(model, live.settings)
        end = live.keep + live.prompt_len + len(tokens)
        if r.slot.cache.max_tokens - end < need:
            feedback = None  # no room for another round: the last reply stands
    if feedback is None:
        if not live.repairs:
            return event
        return DoneEvent(_commit(model, r, tokens, stop, bool(problems), combine))
    _set_cache(model, r, r.slot.ids[:live.keep + live.prompt_len + len(tokens)])
    live.repairs += 1
    stops = tuple(t for t in control_ids(model, live.settings)[0] if t != r.repair.opener)
    live.settings = live.settings.replace(stop_ids=stops, max_new_tokens=live.budget)
    r.prompt = feedback
    emit(r, RetryEvent(attempt=live.repairs, kept=0), log=False)
    reopen(model, r, emit)
    return None


def _set_cache(model, r, ids: list[int], mark: int | None = None) -> None:
    """r's cache made to hold `ids`, which extend a prefix of what it holds (slot.ids): rewound to their common part
    (to `mark` at most), the rest prefilled in one call, or where the rewind fell short of `mark`, in two: up to the
    mark, then from it. Each prefill is journaled as an 'extend' op, and so is the rewind to a mark with nothing
    after it."""
    cache, held = r.slot.cache, r.slot.ids
    same, most = 0, min(len(held), len(ids), len(ids) if mark is None else mark)
    while same < most and held[same] == ids[same]:
        same += 1
    kept = rewind(cache, same)
    cuts = [kept, mark, len(ids)] if mark is not None and kept < mark else [kept, len(ids)]
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            model.prefill(cache, as_ids(ids[a:b], model.config.vocab_size, model.embedding.device))
        if r.log is not None and (b > a or a == mark):
            r.log.write(oplog.extend_record(r.slot_index, a, ids[a:b]))
    r.slot.ids = list(ids)


def _commit(model, r, tokens: list[int], stop, failed: bool, combine):
    """The repaired turn's end: the cache back to the mark with `tokens` (the final reply) after it -> the turn's
    GenerationResult (that reply, every round's work)."""
    live = r.run
    _set_cache(model, r, live.turn_ids + tokens, mark=len(live.turn_ids))
    r.tokens = list(tokens)
    result = combine(live.results, list(tokens), getattr(model, "tokenizer", None))
    return dataclasses.replace(result, stop_token=stop, tool_retries=0, tool_repairs=live.repairs,
                               tool_repair_failed=failed)
