"""One conversation: renders the chat, reuses the KV cache across turns, and splits replies.

KV reuse: the session remembers exactly which token ids its cache holds. Each turn renders the whole
conversation with the chat template, keeps the longest common token prefix of that rendering and
the cache (truncating the cache where they diverge, e.g. when the template drops a thought channel
from history), and prefills only the rest. A long conversation therefore costs one prefill of each
new turn, not of the whole history.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field

from .errors import InputError
from .generation import BlockEvent, DoneEvent, StepEvent, generate_stream, resolve_settings
from .stop_strings import text_end
from .tool_calls import CALL_OPEN, parse_tool_calls

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
THOUGHT_LABEL = "thought"


@dataclass
class Reply:
    answer: str  # what the user sees
    thought: str | None  # the thought channel, when the model wrote one
    raw_text: str  # the decoded reply with its special tokens
    result: object  # the GenerationResult
    reused_tokens: int  # prompt tokens served from the cache
    prefilled_tokens: int  # prompt tokens prefilled this turn
    tool_calls: list = field(default_factory=list)  # parsed <|tool_call> blocks (diffgemma.tool_calls.ToolCall)


def split_thought(raw: str) -> tuple[str | None, str]:
    """'<|channel>thought\\n…<channel|>answer' → ('…', 'answer'). Unclosed channel: all thought, no answer."""
    start = raw.find(CHANNEL_OPEN)
    if start < 0:
        return None, raw
    body_start = start + len(CHANNEL_OPEN)
    end = raw.find(CHANNEL_CLOSE, body_start)
    body = raw[body_start:] if end < 0 else raw[body_start:end]
    if body.startswith(THOUGHT_LABEL):
        body = body[len(THOUGHT_LABEL):]
    answer = raw[:start] + ("" if end < 0 else raw[end + len(CHANNEL_CLOSE):])
    return body.strip("\n"), answer


def _strip_padding(text: str, tokenizer) -> str:
    for tid in (getattr(tokenizer, "pad_id", None), getattr(tokenizer, "filler_id", None)):
        if tid is not None:
            text = text.replace(tokenizer.id_to_token(tid) or "\0", "")
    return text


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def rewind(cache, length: int) -> int:
    """Truncate `cache` to `length` tokens -> the length it now holds: `length`, or 0 where the rewind is deeper
    than the sliding-window ring can undo (the whole prompt is then prefilled again)."""
    if length >= cache.length:
        return cache.length
    try:
        cache.truncate(length)
    except InputError:
        cache.truncate(0)
        return 0
    return length


def reuse_prefix(cache, cached_ids: list[int], ids: list[int]) -> int:
    """Keep the longest common prefix of what `cache` holds (`cached_ids`) and the next prompt `ids` -> how many
    prompt tokens the cache now serves. At least one prompt token is left to prefill: the model needs one new
    token to condition the canvas on."""
    keep = _common_prefix(cached_ids, ids)
    if keep == len(ids):
        keep -= 1
    return rewind(cache, keep)


def tool_result_value(text: str):
    """A tool's result as the chat template takes it: a JSON object becomes a mapping (rendered field by field),
    anything else stays text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def answer_prose(answer: str) -> str:
    """The part of an answer before its first tool call."""
    return answer[:answer.find(CALL_OPEN)].strip()


def reply_parts(tokenizer, tokens: list[int], stops=()) -> tuple[str, str | None, str, list]:
    """A reply's token ids -> (raw text with special tokens, thought or None, answer, tool calls). `stops`: the
    reply's stop strings; its text ends where the first begins (stop_strings.py)."""
    raw = tokenizer.decode(tokens, skip_special_tokens=False)
    raw = raw[:text_end(raw, stops)]
    thought, answer = split_thought(raw)
    answer = _strip_padding(answer, tokenizer).strip()
    return raw, thought, answer, parse_tool_calls(answer)


def tool_call_message(prose: str, calls: list) -> dict:
    """The assistant message of a turn that called tools, as the chat template renders it."""
    return {"role": "assistant", "content": prose, "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}


@dataclass
class Slot:
    cache: object
    ids: list[int] = field(default_factory=list)  # the token ids the cache holds, in order
    last_used: int = 0


def run_generation(model, slot: Slot, keep: int, prompt: list[int], settings, *, log=None, gen: int = 0,
                   slot_index: int = 0, should_stop=lambda blocks: False, emit=lambda kind, payload: None) -> None:
    """The one way a conversation's reply is generated (Session, the server's worker, replay): `slot` already
    rewound to its first `keep` tokens; prefill `prompt` and generate with `settings`. Each event goes to
    `emit(kind, payload)`: "step" / "block" as they come, then one of "done" (the GenerationResult),
    "cancelled" or "error" (the exception; the cache is emptied). `should_stop(blocks)` is asked after every
    step and block; True cancels, rewinding the cache to the prompt. With `log` (an oplog.OpLog) the op and
    its events are journaled for `diffgemma replay`."""
    record = log.write if log is not None else (lambda r: None)
    record({"op": "generate", "gen": gen, "slot": slot_index, "keep": keep, "prompt": list(prompt),
            "settings": settings.as_dict()})
    full = slot.ids[:keep] + list(prompt)
    slot.ids = []  # unknown until the generation ends
    blocks = 0
    stream = generate_stream(model, prompt, settings=settings, cache=slot.cache)
    try:
        for event in stream:
            if isinstance(event, StepEvent):
                emit("step", event)
            elif isinstance(event, BlockEvent):
                blocks += 1
                record({"event": "block", "gen": gen, "block": event.block, "tokens": event.tokens,
                        "steps": event.steps, "stop_reason": event.stop_reason, "end": event.end})
                emit("block", event)
            elif isinstance(event, DoneEvent):
                result = event.result
                slot.ids = full + list(result.tokens)
                record({"event": "done", "gen": gen, "tokens": result.tokens, "stop_token": result.stop_token})
                emit("done", result)
                return
            if should_stop(blocks):
                stream.close()
                kept = rewind(slot.cache, len(full))
                slot.ids = full[:kept]
                record({"event": "cancelled", "gen": gen, "blocks": blocks, "kept": kept})
                emit("cancelled", None)
                return
    except Exception as e:  # the cache may hold part of a prefill or a block: start it afresh
        stream.close()
        rewind(slot.cache, 0)
        record({"event": "error", "gen": gen, "error": f"{type(e).__name__}: {e}"})
        emit("error", e)


def malformed_call_cut(tokenizer, tokens: list[int]) -> int | None:
    """Where to regenerate a reply whose tool call does not parse: the index just past the opener token of its
    first malformed call (the text before the call and the opener itself are kept), or None when every call
    parses, or when that opener is not a `<|tool_call>` token of its own (the text spelled it out)."""
    calls = reply_parts(tokenizer, tokens)[3]
    bad = next((k for k, c in enumerate(calls) if not c.ok), None)
    opener = tokenizer.token_to_id(CALL_OPEN)
    if bad is None or opener is None:
        return None
    for p, t in enumerate(tokens):
        if t == opener:  # is it the answer's (bad+1)-th opener? (a thought may spell calls out too)
            seen = split_thought(tokenizer.decode(tokens[:p + 1], skip_special_tokens=False))[1].count(CALL_OPEN)
            if seen == bad + 1:
                return p + 1
            if seen > bad + 1:
                return None
    return None


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


def run_turn(model, slot: Slot, keep: int, prompt: list[int], settings, *, tool_retries: int = 0, log=None,
             next_gen=None, slot_index: int = 0, should_stop=lambda blocks: False,
             emit=lambda kind, payload: None) -> None:
    """run_generation, and with tool_retries > 0 a reply whose tool call does not parse is regenerated from that
    call's opener (the text before it stays, so a stream never takes back what it sent), with the seed bumped by
    one each time, up to tool_retries times (the last attempt stands, parsed or not). Each regeneration is a
    generation of its own (its own op in the log, so `diffgemma replay` needs no notion of retries); between them
    `emit("retry", {"attempt": n, "kept": reply tokens kept})` tells a consumer to drop what came after. "done"
    carries the whole reply as one GenerationResult (tool_retries says how many regenerations it took)."""
    tokenizer = getattr(model, "tokenizer", None)
    next_gen = next_gen or (lambda: 0)
    reply_start = keep + len(prompt)
    budget = settings.max_new_tokens
    results, kept_reply = [], []
    while True:
        out = {}

        def relay(kind, payload):
            if kind == "done":
                out["done"] = payload
            else:
                emit(kind, payload)

        run_generation(model, slot, keep, prompt, settings, log=log, gen=next_gen(), slot_index=slot_index,
                       should_stop=should_stop, emit=relay)
        if "done" not in out:  # cancelled or failed: already said
            return
        results.append(out["done"])
        reply = kept_reply + list(out["done"].tokens)
        cut = None
        if tokenizer is not None and len(results) <= tool_retries:
            cut = malformed_call_cut(tokenizer, reply)
        if cut is None or cut >= budget or out["done"].stop_string is not None:  # a stop string ends the reply
            emit("done", results[0] if len(results) == 1 else _combined(results, reply, tokenizer))
            return
        kept_reply = reply[:cut]
        keep = rewind(slot.cache, reply_start + cut)  # slot.ids holds the prompt and the whole reply
        prompt = slot.ids[keep:reply_start + cut]
        settings = settings.replace(seed=(settings.seed + 1) % 2**64, max_new_tokens=budget - cut)
        emit("retry", {"attempt": len(results), "kept": cut})


class Session:
    def __init__(self, model, *, system: str | None = None, think: bool = False, max_tokens: int = 8192, tools=None,
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
        self.slot = Slot(model.new_cache(max_tokens))
        self.log = log
        self.tool_validate = tool_validate
        self._gens = itertools.count()  # generations journaled (a turn with a regenerated tool call takes several)

    @property
    def cache(self):
        return self.slot.cache

    @property
    def cached_ids(self) -> list[int]:
        """The token ids the KV cache holds."""
        return self.slot.ids

    def reset(self) -> None:
        """Start a new conversation: the system prompt stays; the turns after it and the cache go."""
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self.slot.ids = []
        self.cache.truncate(0)

    def render(self) -> list[int]:
        return self.tokenizer.apply_chat_template(self.messages, tools=self.tools, add_generation_prompt=True,
                                                  enable_thinking=self.think)

    def ask(self, content: str, **kw) -> Reply:
        """A user turn: render, reuse the cached prefix, generate the model's reply. A turn that fails (e.g. the
        conversation no longer fits the cache) leaves the conversation as it was before it."""
        return self._turn({"role": "user", "content": content}, kw)

    def _turn(self, message: dict, kw) -> Reply:
        self.messages.append(message)
        try:
            return self._generate_turn(**kw)
        except BaseException:
            self.messages.pop()
            raise

    def _generate_turn(self, *, on_step=None, on_block=None, settings=None, **overrides) -> Reply:
        ids = self.render()
        keep = reuse_prefix(self.cache, self.slot.ids, ids)
        new = ids[keep:]
        out = {}

        def emit(kind, payload):
            if kind == "step":
                if on_step is not None:
                    on_step(payload)
            elif kind == "block":
                if on_block is not None:
                    on_block(payload)
            else:
                out[kind] = payload

        run_turn(self.model, self.slot, keep, new, resolve_settings(self.model, settings, overrides),
                 tool_retries=self.tool_validate if self.tools is not None else 0, log=self.log,
                 next_gen=lambda: next(self._gens), emit=emit)
        if "error" in out:
            raise out["error"]
        result = out["done"]
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
    session.messages = [dict(m) for m in messages[:-1]]
    return session.ask(messages[-1]["content"], **overrides).answer
