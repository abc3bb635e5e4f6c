"""A reply's token ids -> its parts: the raw text, the thought channel, the answer the user sees, and tool calls.

The one place a reply's text is taken apart, for every consumer (Session, the server's messages and streams,
the CLI): `reply_parts` decodes with special tokens, ends the text at the first stop string (stop_strings.py),
splits off the thought channel (`<|channel>thought\\n…<channel|>`, or a close of a channel never opened:
`unopened_thought`), drops padding and parses `<|tool_call>` blocks (tool_calls.py). The helpers around it
build the chat-template messages a tool-calling turn needs.
"""

from __future__ import annotations

import json

from .stop_strings import text_end
from .tool_calls import CALL_OPEN, parse_tool_calls

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
THOUGHT_LABEL = "thought"


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


def unopened_thought(thought: str | None, answer: str, early: bool) -> tuple[str | None, str]:
    """A reply that closes a thought channel it never opened (thinking off, the model thinks anyway): when the
    close is `early` (nothing of the reply has been shown yet), what comes before it is the thought; a close
    later on is dropped from the answer (a stream has shown what came before it)."""
    cut = answer.find(CHANNEL_CLOSE) if thought is None else -1
    if cut < 0:
        return thought, answer
    if not early:
        return thought, answer.replace(CHANNEL_CLOSE, "")
    return answer[:cut].strip("\n").strip(), answer[cut + len(CHANNEL_CLOSE):].strip()


def closes_early(tokenizer, tokens: list[int], first_block: int | None) -> bool:
    """Whether a channel close falls in the first `first_block` tokens (None: anywhere, the reply shown whole)."""
    head = tokens if first_block is None else tokens[:first_block]
    return CHANNEL_CLOSE in tokenizer.decode(head, skip_special_tokens=False)


def strip_padding(text: str, tokenizer) -> str:
    """`text` without the tokenizer's pad and filler tokens (a block may commit them after the reply ends)."""
    for tid in (getattr(tokenizer, "pad_id", None), getattr(tokenizer, "filler_id", None)):
        if tid is not None:
            text = text.replace(tokenizer.id_to_token(tid) or "\0", "")
    return text


def reply_parts(tokenizer, tokens: list[int], stops=(), first_block: int | None = None
                ) -> tuple[str, str | None, str, list]:
    """A reply's token ids -> (raw text with special tokens, thought or None, answer, tool calls). `stops`: the
    reply's stop strings; its text ends where the first begins (stop_strings.py). `first_block`: how many tokens
    were shown before the rest (a stream's first block; None: the reply is shown whole), for a close of a
    channel never opened (`unopened_thought`)."""
    raw = tokenizer.decode(tokens, skip_special_tokens=False)
    raw = raw[:text_end(raw, stops)]
    thought, answer = split_thought(raw)
    thought, answer = unopened_thought(thought, answer, closes_early(tokenizer, tokens, first_block))
    answer = strip_padding(answer, tokenizer).strip()
    return raw, thought, answer, parse_tool_calls(answer)


def answer_prose(answer: str) -> str:
    """The part of an answer before its first tool call."""
    return answer[:answer.find(CALL_OPEN)].strip()


def tool_call_message(prose: str, calls: list) -> dict:
    """The assistant message of a turn that called tools, as the chat template renders it."""
    return {"role": "assistant", "content": prose, "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}


def tool_result_value(text: str):
    """A tool's result as the chat template takes it: a JSON object becomes a mapping (rendered field by field),
    anything else stays text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def malformed_call_cut(tokenizer, tokens: list[int]) -> int | None:
    """Where to regenerate a reply whose tool call does not parse: the index just past the opener token of its
    first malformed call (the text before the call and the opener itself are kept), or None when every call
    parses, or when that opener is not a `<|tool_call>` token of its own (the text spelled it out)."""
    calls = reply_parts(tokenizer, tokens)[3]
    bad = next((k for k, c in enumerate(calls) if not c.ok), None)
    opener = tokenizer.token_to_id(CALL_OPEN)
    if bad is None or opener is None:
        return None
    thought, answer = split_thought(tokenizer.decode(tokens, skip_special_tokens=False))
    unopened = thought is None and CHANNEL_CLOSE in answer  # what precedes that close is a thought (reply_parts)
    for p, t in enumerate(tokens):
        if t == opener:  # is it the answer's (bad+1)-th opener? (a thought may spell calls out too)
            head = tokenizer.decode(tokens[:p + 1], skip_special_tokens=False)
            if unopened:
                seen = head.split(CHANNEL_CLOSE, 1)[1].count(CALL_OPEN) if CHANNEL_CLOSE in head else 0
            else:
                seen = split_thought(head)[1].count(CALL_OPEN)
            if seen == bad + 1:
                return p + 1
            if seen > bad + 1:
                return None
    return None
