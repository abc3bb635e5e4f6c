"""A reply's token ids -> the assistant message, whole (`final_message`) or as streaming deltas (`ReplyDeltas`).

Both go through reply.reply_parts, so a streamed reply concatenates to exactly the message a non-streamed
request gets: the thought channel as `reasoning_content`, the answer as `content`, and well-formed tool calls
as `tool_calls` (their text is held back while streaming and sent whole at the end, since a call is only
known to be well-formed once it is closed). Deltas come a committed block at a time: a diffusion model
writes a block of tokens at once, not one token after another. With stop strings the text ends where the first
begins, and a stream holds back a tail that the next block could complete into one.
"""

from __future__ import annotations

from ..reply import (CHANNEL_OPEN, THOUGHT_LABEL, answer_prose, closes_early, reply_parts, split_thought,
                     strip_padding, unopened_thought)
from ..stop_strings import held_back, settled, text_end
from ..tool_calls import CALL_CLOSE, CALL_OPEN
from .protocol import tool_calls_json
from .structured import tool_call_problem


def without_calls(answer: str) -> str:
    """The answer with every tool call's markup taken out (a call not answered as a call is not content either)."""
    out, pos = [], 0
    while (start := answer.find(CALL_OPEN, pos)) >= 0:
        out.append(answer[pos:start])
        end = answer.find(CALL_CLOSE, start)
        pos = len(answer) if end < 0 else end + len(CALL_CLOSE)
    out.append(answer[pos:])
    return "".join(out).strip()


def final_message(tokenizer, tokens: list[int], tools_on: bool, stops=(), tools=None,
                  parallel: bool = True, first_block: int | None = None) -> tuple[dict, list]:
    """-> (assistant message, well-formed tool calls answered as such, [] when none). `tools`: the offered tools;
    a call to a function not offered, or with arguments against its parameter schema, is malformed. Calls are
    answered only when every one is well-formed; otherwise their markup is left out of the content.
    parallel=False answers only the first call. first_block: how many of the tokens the first block wrote (the
    canvas length), where a close of a thought channel never opened makes a thought of what precedes it."""
    _, thought, answer, calls = reply_parts(tokenizer, tokens, stops, first_block=first_block)
    message = {"role": "assistant", "content": answer}
    if thought is not None:
        message["reasoning_content"] = thought
    if tools_on and calls and all(c.ok and tool_call_problem(c.name, c.arguments, tools) is None for c in calls):
        calls = calls if parallel else calls[:1]
        message["content"] = answer_prose(answer) or None
        message["tool_calls"] = tool_calls_json(calls)
        return message, calls
    message["content"] = without_calls(answer)
    return message, []


class ReplyDeltas:
    """Feed it the tokens so far after each block; it returns what the client has not seen yet."""

    def __init__(self, tokenizer, tools_on: bool, stops=(), tools=None, parallel: bool = True):
        self.tokenizer, self.tools_on, self.stops = tokenizer, tools_on, tuple(stops)
        self.tools, self.parallel = tools, parallel
        self.first_block: int | None = None  # the first block's length, once fed
        self.tokens: list[int] = []
        self.sent = {"reasoning_content": "", "content": ""}

    def _visible(self) -> dict:
        """The parts that are sure not to change as more tokens come: trailing whitespace (a final strip may drop
        it), anything from a tool call's opener on, and a tail that may still become a stop text are held back."""
        raw = settled(self.tokenizer.decode(self.tokens, skip_special_tokens=False), self.stops)
        thought, answer = split_thought(raw)
        thought, answer = unopened_thought(thought, answer, closes_early(self.tokenizer, self.tokens, self.first_block))
        opened = raw.find(CHANNEL_OPEN)
        if opened >= 0 and THOUGHT_LABEL.startswith(raw[opened + len(CHANNEL_OPEN):]):
            thought = ""  # the channel's label is still being written: it is not part of the thought
        answer = strip_padding(answer, self.tokenizer).lstrip()
        # markup never reaches the content: from a tool call's opener (answered as a call, or left out when it
        # is not) and from a thought channel's close on, the answer is held back until the reply is whole
        cut = answer.find(CALL_OPEN)
        answer = answer if cut < 0 else answer[:cut]
        answer = answer[:len(answer) - held_back(answer, (CALL_OPEN,))]
        return {"reasoning_content": (thought or "").lstrip("\n").rstrip("\n"), "content": answer.rstrip()}

    def _delta(self, now: dict) -> dict:
        out = {}
        for key, text in now.items():
            if text.startswith(self.sent[key]) and len(text) > len(self.sent[key]):
                out[key] = text[len(self.sent[key]):]
                self.sent[key] = text
        return out

    def feed(self, tokens: list[int]) -> dict:
        self.tokens.extend(tokens)
        if self.first_block is None:
            self.first_block = len(self.tokens)
        return self._delta(self._visible())

    def rewind(self, kept: int) -> None:
        """Forget the reply's tokens after the first `kept` (a malformed tool call regenerated from its opener). What
        was sent stays a prefix of the message: the call's text, from the opener on, was held back."""
        self.tokens = self.tokens[:kept]
        now = self._visible()
        for key, sent in self.sent.items():
            if not now[key].startswith(sent):  # the holds above make this impossible; never send a wrong prefix
                raise AssertionError(f"rewind to {kept} tokens: streamed {key} {sent!r} is not a prefix of {now[key]!r}")

    def finish(self) -> tuple[dict, dict, list]:
        """-> (the last delta, the whole message, its tool calls): the delta completes what was sent to the
        message's content and reasoning, and carries the tool calls."""
        message, calls = final_message(self.tokenizer, self.tokens, self.tools_on, self.stops, self.tools,
                                       self.parallel, self.first_block)
        final = {"reasoning_content": message.get("reasoning_content") or "", "content": message.get("content") or ""}
        delta = {}
        for key, text in final.items():
            sent = self.sent[key]
            if not text.startswith(sent):  # cannot happen with the holds above; never send a wrong prefix silently
                raise AssertionError(f"streamed {key} {sent!r} is not a prefix of the reply's {text!r}")
            if len(text) > len(sent):
                delta[key] = text[len(sent):]
        if "tool_calls" in message:
            delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]
        return delta, message, calls


def reply_token_count(tokenizer, tokens) -> int:
    """The reply's tokens as usage counts them: the canvas's padding is not part of the reply."""
    pads = {t for t in (getattr(tokenizer, "pad_id", None), getattr(tokenizer, "filler_id", None)) if t is not None}
    return sum(1 for t in tokens if t not in pads)


def completion_text(tokenizer, tokens: list[int], stops=()) -> str:
    """A /v1/completions reply's text: the decoded tokens (special tokens as text, padding dropped) up to the first
    stop text. Nothing is stripped: in a raw completion whitespace is part of the text."""
    raw = tokenizer.decode(tokens, skip_special_tokens=False)
    return strip_padding(raw[:text_end(raw, stops)], tokenizer)


class CompletionDeltas:
    """ReplyDeltas for /v1/completions: feed it each block's tokens; it returns the text the client has not seen,
    holding back a tail that may still become a stop text."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.tokens: list[int] = []
        self.sent = ""

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):  # the hold above makes this impossible; never send a wrong prefix
            raise AssertionError(f"streamed {self.sent!r} is not a prefix of the completion's {text!r}")
        out, self.sent = text[len(self.sent):], text
        return out

    def feed(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        raw = settled(self.tokenizer.decode(self.tokens, skip_special_tokens=False), self.stops)
        return self._delta(strip_padding(raw, self.tokenizer))

    def finish(self) -> tuple[str, str, list]:
        """-> (the last delta, the whole text, no tool calls): ReplyDeltas.finish's shape."""
        text = completion_text(self.tokenizer, self.tokens, self.stops)
        return self._delta(text), text, []
