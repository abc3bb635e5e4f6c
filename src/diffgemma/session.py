"""One conversation (`Session`), and the one way any conversation's reply is generated (`run_turn`).

A Session renders the chat with the template, keeps its KV cache across turns (slots.py: only what the cache does
not hold yet is prefilled) and splits each reply into thought, answer and tool calls (reply.py).
`generation_steps` / `run_turn_steps` are shared by the Session, the server's scheduler and `diffgemma replay`: each
is one request as a coroutine of model asks (a denoise `Forward`, a step's `Status` read, a prompt `Prefill` chunk)
that passes on the events of generation.generate_steps (events.py), adds its own, and journals each generation in the
op-log. `drive` runs one alone (run_generation, run_turn); the server's scheduler steps several together
(docs/ARCHITECTURE.md, 'Continuous batching').
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from . import oplog
from .config import cache_tokens
from .errors import InputError
from .events import BlockEvent, CancelledEvent, DoneEvent, ErrorEvent, RetryEvent, StartEvent, StepEvent
from .generation import BlockRead, Forward, Status, _as_ids, generate_steps
from .reply import answer_prose, malformed_call_cut, reply_parts, tool_call_message
from .settings import settings_for_call
from .slots import Slot, reuse_prefix, rewind
from .stop_strings import text_end
from .vision.prompt import has_images, prefill_images, prepare_parts, render_prompt, vision_for


@dataclass
class Reply:
    answer: str  # what the user sees
    thought: str | None  # the thought channel, when the model wrote one
    raw_text: str  # the decoded reply with its special tokens
    result: object  # the GenerationResult
    reused_tokens: int  # prompt tokens served from the cache
    prefilled_tokens: int  # prompt tokens prefilled this turn
    tool_calls: list = field(default_factory=list)  # parsed <|tool_call> blocks (diffgemma.tool_calls.ToolCall)


@dataclass
class Prefill:
    """A generation's ask to prefill its next chunk of `tokens` prompt tokens, yielded by generation_steps when the
    prompt is prefilled in chunks; the driver resumes it (send(None)) when its prefill budget allows, and the chunk
    is prefilled then (the server's scheduler interleaves chunks with the running batch's denoise steps)."""

    tokens: int


def drive(steps):
    """Run a step coroutine (generation_steps, run_turn_steps) alone: each Forward, Status and BlockRead on the
    request's own denoiser, each Prefill at once -> the coroutine's return value. An exception in a forward or a read
    (Ctrl-C included) is thrown into the coroutine, which journals it as it would one of its own."""
    answer, thrown = None, None
    try:
        while True:
            try:
                ask = steps.send(answer) if thrown is None else steps.throw(thrown)
            except StopIteration as stop:
                return stop.value
            answer, thrown = None, None
            if isinstance(ask, (Forward, Status, BlockRead)):
                try:
                    answer = ask.run()
                except BaseException as e:  # noqa: B036 - handed to the coroutine, which passes it on
                    thrown = e
    finally:
        steps.close()


def run_generation(model, slot: Slot, keep: int, prompt: list[int], settings, **kw):
    """The one way a conversation's reply is generated, run alone: generation_steps driven on the request's own
    denoiser (drive). Same arguments and result as generation_steps."""
    return drive(generation_steps(model, slot, keep, prompt, settings, **kw))


def _chunks(ids, size: int | None):
    if size is None or len(ids) <= size:
        return [ids]
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def generation_steps(model, slot: Slot, keep: int, prompt: list[int], settings, *, log=None, gen: int = 0,
                     slot_index: int = 0, should_stop=lambda blocks: False, on_event=lambda event: None,
                     images: dict | None = None, prefill_chunk: int | None = None, stop_prefill=lambda: False,
                     batched: bool = False):
    """The one way a conversation's reply is generated (Session, the server's scheduler, replay), as a coroutine:
    `slot` already rewound to its first `keep` tokens; prefill `prompt` and generate with `settings`. It yields
    `Forward` asks (generation.Forward: answered with send(logits), or with send(None) to withdraw the request: it
    is cancelled there, as by should_stop), after each answered Forward a `Status` ask (generation.Status: answered
    with send(StepStatus), never withdrawn) and, with `prefill_chunk`, a `Prefill` ask before
    each chunk of that many prompt tokens (answered with send(None)); it returns its last event. batched: a
    scheduler may answer its forwards together with other requests' (generation.generate_steps(batched=)).
    Every event (events.py) goes to `on_event`: StepEvent and BlockEvent as they come, then one of DoneEvent,
    CancelledEvent or ErrorEvent (the cache is then emptied). `should_stop(blocks)` is asked after every step and
    block; True cancels, rewinding the cache to the prompt. `stop_prefill()` is asked before each prompt chunk after
    the first; True cancels there, the cache keeping the chunks prefilled so far. A KeyboardInterrupt (Ctrl-C) ends
    it with CancelledEvent(interrupted=True), the cache emptied, and is raised again. With `log` (an oplog.OpLog) the
    op and its events are journaled for `diffgemma replay`. A prompt with images is a prompt key (vision/prompt.py)
    and `images` maps its keys to the images: the part up to the last image is prefilled in one call, the text after
    it as above. Prefilling in chunks is exact but not bitwise the same as in one call (other GEMM shapes), so the
    op-log records the chunk size and replay uses it."""

    def emit(event):
        if log is not None and (record := oplog.event_record(gen, event)) is not None:
            log.write(record)
        on_event(event)
        return event

    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise InputError(f"prefill_chunk: expected a positive number of tokens, got {prefill_chunk!r}")
    with_images = any(t < 0 for t in prompt)
    if log is not None:
        record = oplog.generate_record(gen, slot_index, keep, prompt, settings, prefill_chunk=prefill_chunk)
        if with_images:
            from .vision.journal import save_images

            record["images"] = save_images(log.path, prompt, images or {})
        log.write(record)
    full = slot.ids[:keep] + list(prompt)
    slot.ids = []  # unknown until the generation ends
    blocks = 0
    steps = None
    try:
        tail, prefill_s = prompt, 0.0
        if with_images:
            t = time.perf_counter()
            tail = prefill_images(model, slot.cache, prompt, images or {})
            prefill_s += time.perf_counter() - t
        ids = _as_ids(tail, model.config.vocab_size, model.embedding.device)
        for n, chunk in enumerate(_chunks(ids, prefill_chunk) if len(ids) else []):
            if prefill_chunk is not None:
                yield Prefill(len(chunk))
                if n and stop_prefill():  # the client left while its prompt was prefilling
                    kept = slot.cache.length
                    slot.ids = full[:kept]
                    return emit(CancelledEvent(blocks=0, kept=kept))
            t = time.perf_counter()
            model.prefill(slot.cache, chunk)
            prefill_s += time.perf_counter() - t
        steps = generate_steps(model, [], settings=settings, cache=slot.cache, batched=batched)
        answer = None
        while True:
            event = steps.send(answer)
            answer = None
            if isinstance(event, Forward):
                answer = yield event
                if answer is None:  # withdrawn by its driver (its client left): it stops before this step
                    steps.close()
                    kept = rewind(slot.cache, len(full))
                    slot.ids = full[:kept]
                    return emit(CancelledEvent(blocks=blocks, kept=kept))
                continue
            if isinstance(event, (Status, BlockRead)):  # host reads, by its driver (with other requests' in a batch)
                answer = yield event
                continue
            if isinstance(event, DoneEvent):
                slot.ids = full + list(event.result.tokens)
                if prefill_s:  # the prompt's prefill (images' tower included) ran here, not in generate_steps
                    for k in ("prefill_s", "total_s"):
                        event.result.timings[k] = event.result.timings.get(k, 0.0) + prefill_s
                return emit(event)
            blocks += isinstance(event, BlockEvent)
            emit(event)
            if should_stop(blocks):
                steps.close()
                kept = rewind(slot.cache, len(full))
                slot.ids = full[:kept]
                return emit(CancelledEvent(blocks=blocks, kept=kept))
    except Exception as e:  # the cache may hold part of a prefill or a block: start it afresh
        if steps is not None:
            steps.close()
        rewind(slot.cache, 0)
        slot.ids = []
        return emit(ErrorEvent(e))
    except KeyboardInterrupt:  # Ctrl-C, anywhere in the loop: journaled as such (replay stops there too), passed on
        if steps is not None:
            steps.close()
        rewind(slot.cache, 0)  # it may have struck mid-write: start the cache afresh
        slot.ids = []
        emit(CancelledEvent(blocks=blocks, kept=0, interrupted=True))
        raise
    except GeneratorExit:  # closed by its driver (a server shutting down): the cache state is unknown
        if steps is not None:
            steps.close()
        rewind(slot.cache, 0)
        slot.ids = []
        raise


def _combined(results: list, tokens: list[int], tokenizer) -> object:
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


def run_turn(model, slot: Slot, keep: int, prompt: list[int], settings, **kw):
    """A turn run alone: run_turn_steps driven on the request's own denoiser (drive). Same arguments and result."""
    return drive(run_turn_steps(model, slot, keep, prompt, settings, **kw))


def run_turn_steps(model, slot: Slot, keep: int, prompt: list[int], settings, *, tool_retries: int = 0, log=None,
                   next_gen=None, slot_index: int = 0, should_stop=lambda blocks: False,
                   on_event=lambda event: None, images: dict | None = None, prefill_chunk: int | None = None,
                   stop_prefill=lambda: False, batched: bool = False):
    """A turn, as a coroutine of Forward, Status and Prefill asks (generation_steps): StartEvent, then generation_steps.
    With tool_retries > 0 a reply whose tool call does not parse is regenerated from that call's opener (the text before it stays, so a stream never takes back what it sent), with
    the seed bumped by one each time, up to tool_retries times (the last attempt stands, parsed or not). Each
    regeneration is a generation of its own (its own op in the log, so `diffgemma replay` needs no notion of
    retries); between them a RetryEvent tells a consumer to drop what came after the tokens it keeps. The turn ends
    with one DoneEvent carrying the whole reply as one GenerationResult (tool_retries says how many regenerations it
    took), or the CancelledEvent / ErrorEvent that stopped it; that last event is also returned.
    `images`, `prefill_chunk`, `stop_prefill`, `batched`: as generation_steps'."""
    tokenizer = getattr(model, "tokenizer", None)
    next_gen = next_gen or (lambda: 0)
    reply_start = keep + len(prompt)
    budget = settings.max_new_tokens
    results, kept_reply = [], []
    on_event(StartEvent(cached_tokens=keep, prefill_tokens=len(prompt)))

    def relay(event):  # a generation's DoneEvent is not the turn's
        if not isinstance(event, DoneEvent):
            on_event(event)

    while True:
        end = yield from generation_steps(model, slot, keep, prompt, settings, log=log, gen=next_gen(),
                                          slot_index=slot_index, should_stop=should_stop, on_event=relay,
                                          images=images, prefill_chunk=prefill_chunk, stop_prefill=stop_prefill,
                                          batched=batched)
        if not isinstance(end, DoneEvent):  # cancelled or failed: already said
            return end
        results.append(end.result)
        reply = kept_reply + list(end.result.tokens)
        cut = None
        if tokenizer is not None and len(results) <= tool_retries:
            cut = malformed_call_cut(tokenizer, reply)
        if cut is None or cut >= budget or end.result.stop_string is not None:  # a stop string ends the reply
            done = end if len(results) == 1 else DoneEvent(_combined(results, reply, tokenizer))
            on_event(done)
            return done
        kept_reply = reply[:cut]
        keep = rewind(slot.cache, reply_start + cut)  # slot.ids holds the prompt and the whole reply
        prompt = slot.ids[keep:reply_start + cut]
        settings = settings.replace(seed=(settings.seed + 1) % 2**64, max_new_tokens=budget - cut)
        on_event(RetryEvent(attempt=len(results), kept=cut))


class Session:
    def __init__(self, model, *, system: str | None = None, think: bool = False, max_tokens: int | None = None, tools=None,
                 log=None, tool_validate: int = 0):
        """log: an oplog.OpLog (header: slots 1, this max_tokens) that journals every turn for `diffgemma replay`.
        tool_validate: with tools, regenerate a malformed tool call up to this many times (run_turn)."""
        if not isinstance(tool_validate, int) or isinstance(tool_validate, bool) or tool_validate < 0:
            raise InputError(f"tool_validate: expected a whole number of retries >= 0, got {tool_validate!r}")
        if getattr(model, "tokenizer", None) is None:
            raise InputError(f"{getattr(model, 'path', 'model')}: has no tokenizer.json; chat needs a tokenizer")
        self.model = model
        self.tokenizer = model.tokenizer
        self.think = think
        self.tools = tools
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.slot = Slot(model.new_cache(cache_tokens(model.config, max_tokens)))
        self.log = log
        self.tool_validate = tool_validate
        self._gens = itertools.count()  # generations journaled (a turn with a regenerated tool call takes several)

    @property
    def cache(self):
        return self.slot.cache

    @property
    def cached_ids(self) -> list[int]:
        """The token ids the KV cache holds (with images: a prompt key, each image's run a negative sentinel)."""
        return self.slot.ids

    def reset(self) -> None:
        """Start a new conversation: the system prompt stays; the turns after it and the cache go."""
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self.slot.ids = []
        self.cache.truncate(0)

    def render(self) -> list[int]:
        """The conversation's prompt: its token ids, or with images its prompt key (vision/prompt.py)."""
        return self._render()[0]

    def _render(self) -> tuple[list[int], dict]:
        vision = vision_for(self.model) if has_images(self.messages) else None
        return render_prompt(self.tokenizer, vision, self.messages, tools=self.tools, add_generation_prompt=True,
                             enable_thinking=self.think)

    def _with_images(self, message: dict) -> dict:
        """The message with its image parts decoded (each image once, errors before any model work)."""
        content = message.get("content")
        if isinstance(content, list) and has_images([message]):
            return {**message, "content": prepare_parts(content, vision_for(self.model))}
        return message

    def ask(self, content, images=None, **kw) -> Reply:
        """A user turn: render, reuse the cached prefix, generate the model's reply. A turn that fails (e.g. the
        conversation no longer fits the cache) leaves the conversation as it was before it. `content`: text, or a
        list of content parts ({"type": "text", "text": ...}, {"type": "image", "image": a path, bytes or a PIL
        image}); `images`: images to put before the text. Keywords: `settings` (a GenerationSettings; default the
        model's), any GenerationSettings field as an override on top of it, and callbacks `on_step(StepEvent)`,
        `on_block(BlockEvent)`, `on_event(event)` (every event of events.py)."""
        if images is not None:
            if not isinstance(images, (list, tuple)):
                images = [images]
            parts = content if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
            content = [{"type": "image", "image": x} for x in images] + parts
        return self._turn(self._with_images({"role": "user", "content": content}), kw)

    def _turn(self, message: dict, kw) -> Reply:
        self.messages.append(message)
        try:
            return self._generate_turn(**kw)
        except BaseException:
            self.messages.pop()
            raise

    def _generate_turn(self, *, on_step=None, on_block=None, on_event=None, settings=None, **overrides) -> Reply:
        ids, images = self._render()
        keep = reuse_prefix(self.cache, self.slot.ids, ids)
        new = ids[keep:]

        def relay(event):
            if on_step is not None and isinstance(event, StepEvent):
                on_step(event)
            elif on_block is not None and isinstance(event, BlockEvent):
                on_block(event)
            if on_event is not None:
                on_event(event)

        settings = settings_for_call(getattr(self.model, "generation_config", None), settings, overrides)
        end = run_turn(self.model, self.slot, keep, new, settings,
                       tool_retries=self.tool_validate if self.tools is not None else 0, log=self.log,
                       next_gen=lambda: next(self._gens), on_event=relay, images=images)
        if isinstance(end, ErrorEvent):
            raise end.error
        result = end.result
        raw, thought, answer, calls = reply_parts(self.tokenizer, result.tokens, result.settings.stop_strings)
        # History keeps the answer only: reasoning never crosses a turn boundary.
        if calls and all(c.ok for c in calls):
            self.messages.append(tool_call_message(answer_prose(answer), calls))
        else:
            self.messages.append({"role": "assistant", "content": answer})
        return Reply(answer=answer, thought=thought, raw_text=raw, result=result, reused_tokens=keep,
                     prefilled_tokens=len(new), tool_calls=calls)

    def tool_result(self, name: str, content, **kw) -> Reply:
        """Answer the model's tool call with its result (a dict or text) and let the model continue its turn."""
        if not self.messages or not self.messages[-1].get("tool_calls"):
            raise InputError("tool_result: the last assistant message made no tool call")
        return self._turn({"role": "tool", "name": name, "content": content}, kw)


def chat(model, messages: list[dict], *, think: bool = False, tools=None, **overrides) -> str:
    """Template + generate + decode for a whole message list; returns the answer text."""
    if not messages or messages[-1].get("role") != "user":
        raise InputError("chat: messages must end with a user message")
    session = Session(model, think=think, tools=tools)
    session.messages = [session._with_images(dict(m)) for m in messages[:-1]]
    return session.ask(messages[-1]["content"], **overrides).answer
