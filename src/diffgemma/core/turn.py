"""A request's generations, as the engine core runs them (core/engine.py): open one (its op-log record, its images'
prefill, its prompt's chunks), prefill its chunks, start its steps (core/steps.generate_steps), and close it when its
DoneEvent comes: the slot's ids, the op-log, and for a chat turn the tool-call rule.

A turn (Request.turn) whose reply holds a tool call that does not parse (Request.call_cut) is regenerated from that
call's opener (the text before it stays, so a stream never takes back what it sent), with the seed bumped by one
each time, up to Request.tool_retries times (the last attempt stands, parsed or not). Each regeneration is a
generation of its own (its own op in the log, so `diffgemma replay` needs no notion of retries); between them a
RetryEvent tells a consumer to drop what came after the tokens it keeps. The turn ends with one DoneEvent carrying
the whole reply as one GenerationResult (tool_retries says how many regenerations it took). A turn that runs the tool
repair (the setting `tool_repair`, core/repair.py) takes that rule's place: one retry loop a turn, the repair
covering malformed calls too.

Prefilling in chunks is exact but not bitwise the same as in one call (other GEMM shapes), so the op-log records the
chunk size and replay uses it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import oplog
from ..events import DoneEvent, RetryEvent
from ..ops.attention_topk import TopKRule
from ..slots import rewind
from ..stop_strings import text_end
from ..vision.prompt import prefill_images
from .repair import repair_on, repair_step
from .request import DENOISE, PREFILL, Request, as_ids
from .scheduler import prompt_chunks
from .steps import generate_steps


@dataclass
class Live:
    """The engine core's working state of a running request."""

    settings: Any  # the current generation's settings (a regeneration bumps the seed)
    budget: int  # the turn's token budget
    gen: int = 0  # the current generation's number in the op-log
    keep: int = 0  # the tokens the cache held when the generation opened
    prompt_len: int = 0  # the generation's prompt length (a prompt key's)
    full: list[int] | None = None  # the ids the cache holds once the prompt is in (None: untracked)
    tail: torch.Tensor | None = None  # the prompt's ids left after its images, prefilled in chunks
    offset: int = 0  # of tail, prefilled so far
    chunks_done: int = 0
    prefill_s: float = 0.0
    steps: Any = None  # the generation's steps (generate_steps)
    ask: Any = None  # what the steps wait for: a ForwardAsk, StatusAsk or BlockRead
    tokens: list[int] = field(default_factory=list)  # the current generation's kept tokens
    kept_reply: list[int] = field(default_factory=list)  # a turn's reply kept from earlier generations
    reply_start: int | None = None  # where a turn's reply starts in the cache
    results: list = field(default_factory=list)  # a turn's generations' results
    repairs: int = 0  # tool repair rounds run (core/repair.py)
    turn_ids: list[int] | None = None  # a repaired turn's prompt ids, up to its mark (None: cannot be repaired)

    def rewind_to_prompt(self, r: Request) -> int:
        """A cancelled generation: its cache back to the prompt (or what of it is in) -> the tokens kept."""
        kept = rewind(r.slot.cache, self.keep + self.prompt_len)
        if self.full is not None:
            r.slot.ids = self.full[:kept]
        return kept

    def empty(self, r: Request) -> None:
        """A failed or interrupted generation: a tracked slot's cache may hold part of a write; it starts afresh."""
        if self.full is not None or r.slot.ids is not None:
            rewind(r.slot.cache, 0)
            r.slot.ids = []


def open_generation(model, r: Request, emit) -> None:
    """Open r's next generation on its slot: set its cache's top-k attention rule (the settings'), journal it,
    prefill its images, and leave its prompt's text chunks for the scheduler (phase PREFILL), or with none, phase
    DENOISE."""
    live, cache = r.run, r.slot.cache
    # the full layers' attention from here on, the prompt's prefill included (None: dense; docs/ARCHITECTURE.md)
    cache.attention_topk = TopKRule.from_settings(live.settings)
    live.gen, live.keep = r.next_gen(), cache.length
    prompt = r.prompt if isinstance(r.prompt, torch.Tensor) else list(r.prompt)
    live.prompt_len = len(prompt)
    if live.reply_start is None:
        live.reply_start = live.keep + live.prompt_len
    with_images = not isinstance(prompt, torch.Tensor) and any(t < 0 for t in prompt)
    if r.log is not None:
        record = oplog.generate_record(live.gen, r.slot_index, live.keep, prompt, live.settings,
                                       prefill_chunk=r.prefill_chunk)
        if live.repairs:
            record["tool_repair"] = live.repairs  # this generation rewrites a reply after its calls' errors
        if with_images:
            from ..vision.journal import save_images

            record["images"] = save_images(r.log.path, prompt, r.images or {})
        r.log.write(record)
    tracked = r.slot.ids is not None
    live.full = r.slot.ids[:live.keep] + list(prompt) if tracked else None
    if tracked:
        r.slot.ids = []  # unknown until the generation ends
    r.block = r.step = 0
    live.tokens, live.offset, live.chunks_done = [], 0, 0
    r.tokens = list(live.kept_reply)
    r.phase = PREFILL
    tail = prompt
    if with_images:
        t = time.perf_counter()
        tail = prefill_images(model, cache, prompt, r.images or {})
        live.prefill_s += time.perf_counter() - t
    live.tail = as_ids(tail, model.config.vocab_size, model.embedding.device)
    r.chunks = prompt_chunks(live.tail, r.prefill_chunk)
    if not r.chunks:
        r.phase = DENOISE


def prefill_chunks(model, rs: list[Request]) -> None:
    """Prefill each request's next prompt chunk: several in one call of the model's prefill_batch (one forward over
    their caches, each written with the bits its own prefill writes), one alone through its prefill. Each request's
    prefill time is the call's."""
    chunks = [r.run.tail[r.run.offset: r.run.offset + r.chunks[0]] for r in rs]
    t = time.perf_counter()
    if len(rs) > 1:
        model.prefill_batch([r.slot.cache for r in rs], chunks)
    else:
        model.prefill(rs[0].slot.cache, chunks[0])
    took = time.perf_counter() - t
    for r in rs:
        live = r.run
        live.prefill_s += took
        live.offset += r.chunks.pop(0)
        live.chunks_done += 1


def start_steps(model, r: Request, batched: bool) -> None:
    """r's prompt is in its cache: its generation's steps start (phase DENOISE)."""
    r.run.steps = generate_steps(model, r.slot.cache, r.run.settings, keep_cache=r.keep_cache, batched=batched)
    r.phase = DENOISE


def finish_generation(model, r: Request, event: DoneEvent, emit) -> DoneEvent | None:
    """r's generation ended with `event`: the slot's ids, its timings (the prompt's prefill ran here), its op-log
    record -> the request's last event, or None where a turn regenerates a malformed tool call (its next generation
    opened, with a RetryEvent to the sink)."""
    live, result = r.run, event.result
    if live.full is not None:
        r.slot.ids = live.full + list(result.tokens)
    if live.prefill_s:
        for k in ("prefill_s", "total_s"):
            result.timings[k] = result.timings.get(k, 0.0) + live.prefill_s
        live.prefill_s = 0.0
    if r.log is not None:
        r.log.write(oplog.event_record(live.gen, event))
    if not r.turn:
        return event
    if repair_on(r):  # the tool repair takes over the malformed-call rule below (docs/ARCHITECTURE.md, 'Tool repair')
        return repair_step(model, r, event, emit, open_generation, combined)
    retry = _may_retry(r)
    live.results.append(result)
    reply = live.kept_reply + list(result.tokens)
    cut = r.call_cut(reply) if retry else None
    if cut is None or cut >= live.budget or result.stop_string is not None:  # a stop string ends the reply
        if len(live.results) == 1:
            return event
        return DoneEvent(combined(live.results, reply, getattr(model, "tokenizer", None)))
    live.kept_reply = reply[:cut]
    keep = rewind(r.slot.cache, live.reply_start + cut)  # slot.ids holds the prompt and the whole reply
    r.prompt = r.slot.ids[keep:live.reply_start + cut]
    live.settings = live.settings.replace(seed=(live.settings.seed + 1) % 2**64, max_new_tokens=live.budget - cut)
    emit(r, RetryEvent(attempt=len(live.results), kept=cut), log=False)
    open_generation(model, r, emit)
    return None


def _may_retry(r: Request) -> bool:
    """Whether a turn's generation, ending now, may be regenerated from a malformed tool call (r.call_cut)."""
    return r.call_cut is not None and len(r.run.results) < r.tool_retries


def may_regenerate(r: Request) -> bool:
    """Whether r's generation, once over, may be written again (a malformed tool call regenerated, or the tool
    repair): its cache is then rewound, so its last block must be in the cache before finish_generation runs."""
    return r.turn and (repair_on(r) or _may_retry(r))


def combined(results: list, tokens: list[int], tokenizer) -> object:
    """One GenerationResult for a reply made in several generations (a tool call regenerated): the reply's tokens,
    every generation's work (blocks, forwards, timings), the last one's stop."""
    first, last = results[0], results[-1]
    forwards = sum(r.forwards for r in results)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    if text is not None and last.stop_string is not None:
        text = text[:text_end(text, last.settings.stop_strings)]
    timings: dict = {}
    for r in results:
        for k, v in r.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    return dataclasses.replace(
        last, tokens=tokens, text=text,
        steps_per_block=[n for r in results for n in r.steps_per_block],
        tokens_per_forward=len(tokens) / forwards if forwards else 0.0,
        stop_reasons=[x for r in results for x in r.stop_reasons], timings=timings,
        retries=sum(r.retries for r in results), forwards=forwards,
        block_ends=[x for r in results for x in r.block_ends], settings=first.settings,
        tool_retries=len(results) - 1)
