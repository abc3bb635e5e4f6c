"""Gemma-4 tool-call grammar: `<|tool_call>call:NAME{key:value,...}<tool_call|>` → {"name", "arguments"}.

Values: strings between `<|"|>` delimiters, numbers, true/false/null, lists `[..]` and objects `{..}` with
unquoted keys. A call that does not parse is reported as malformed (with the reason), never guessed at,
so a caller can retry or repair it. `call_problem` is the one check of a call against the offered tools (it parses,
names an offered function, and its arguments fit that function's parameter schema, by jsonschema).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE, STR = "<|tool_call>", "<tool_call|>", '<|"|>'
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    raw: str
    error: str | None = None  # None = well-formed

    @property
    def ok(self) -> bool:
        return self.error is None


def schema_validator(schema: dict):
    """A jsonschema validator for `schema`, of the draft it declares (2020-12 when it declares none)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def tool_call_problem(name: str | None, arguments, tools: list[dict] | None) -> str | None:
    """Why a parsed tool call does not fit the offered tools (an unknown function, arguments against its parameter
    schema), or None when it fits (or no tools are offered)."""
    if not tools:
        return None
    offered = {t["function"]["name"]: t["function"] for t in tools}
    if name not in offered:
        return f"calls {name!r}, which the request did not offer (offered: {sorted(offered)})"
    schema = offered[name].get("parameters")
    if not isinstance(schema, dict):
        return None
    import jsonschema

    try:
        error = jsonschema.exceptions.best_match(schema_validator(schema).iter_errors(arguments))
    except Exception as e:  # e.g. a $ref that does not resolve: the call cannot be shown to fit
        return f"{name}: its parameter schema cannot be checked ({type(e).__name__})"
    return None if error is None else f"{name}: arguments do not match its parameters: {error.message}"


def call_problem(call: ToolCall, tools: list[dict] | None) -> str | None:
    """Why a call is invalid: it does not parse, or it does not fit the offered tools (tool_call_problem); or None."""
    return call.error if not call.ok else tool_call_problem(call.name, call.arguments, tools)


class _Malformed(ValueError):
    pass


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<|tool_call>…` in text, in order; an unclosed one is malformed."""
    calls = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        raw = text[start:] if end < 0 else text[start:end + len(CALL_CLOSE)]
        if end < 0:
            calls.append(ToolCall(None, None, raw, "no closing <tool_call|>"))
            break
        calls.append(_parse_one(text[body_start:end], raw))
        pos = end + len(CALL_CLOSE)
    return calls


def _parse_one(body: str, raw: str) -> ToolCall:
    if not body.startswith("call:"):
        return ToolCall(None, None, raw, "expected 'call:NAME{...}'")
    m = _KEY.match(body, 5)
    if not m:
        return ToolCall(None, None, raw, "missing tool name")
    name = m.group(0)
    try:
        value, end = _value(body, m.end())
        if not isinstance(value, dict):
            raise _Malformed("arguments must be an object {...}")
        if end != len(body):
            raise _Malformed(f"unexpected text after the arguments: {body[end:end + 20]!r}")
    except _Malformed as e:
        return ToolCall(name, None, raw, str(e))
    return ToolCall(name, value, raw)


def _items(s: str, i: int, close: str, item, make):
    """Comma-separated `item`s from s[i] up to `close` -> (make(items), index after close)."""
    out = []
    if s.startswith(close, i):
        return make(out), i + 1
    while True:
        v, i = item(s, i)
        out.append(v)
        if s.startswith(",", i):
            i += 1
        elif s.startswith(close, i):
            return make(out), i + 1
        else:
            raise _Malformed(f"expected ',' or '{close}' at {s[i:i + 20]!r}")


def _member(s: str, i: int):
    """key:value of an object -> ((key, value), index after it)."""
    m = _KEY.match(s, i)
    if not m or not s.startswith(":", m.end()):
        raise _Malformed(f"expected 'key:' at {s[i:i + 20]!r}")
    v, i = _value(s, m.end() + 1)
    return (m.group(0), v), i


def _value(s: str, i: int):
    if s.startswith(STR, i):
        j = s.find(STR, i + len(STR))
        if j < 0:
            raise _Malformed("unterminated string")
        return s[i + len(STR):j], j + len(STR)
    if s.startswith("{", i):
        return _items(s, i + 1, "}", _member, dict)
    if s.startswith("[", i):
        return _items(s, i + 1, "]", _value, list)
    for word, v in (("true", True), ("false", False), ("null", None)):
        if s.startswith(word, i):
            return v, i + len(word)
    m = _NUMBER.match(s, i)
    if m:
        text = m.group(0)
        return (float(text) if any(c in text for c in ".eE") else int(text)), m.end()
    raise _Malformed(f"unexpected value at {s[i:i + 20]!r}")
