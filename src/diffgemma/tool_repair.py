"""What the tool repair stage (core/turn.py; docs/ARCHITECTURE.md, 'Tool repair') needs to know of a chat: which of
a reply's tool calls are invalid, the error tool-responses that tell the model so, and where a rewritten reply's
hallucinated tool-response tail begins.

A call is invalid when it does not parse, names a function not offered, or has arguments that fail that function's
parameter schema (tool_calls.call_problem: the one check). The feedback is what the chat template renders for one
tool message per invalid call, `{"error": why}`, after the reply: the tokens that follow the reply's calls when the
conversation goes on with those tool messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .reply import reply_parts
from .tool_calls import call_problem

RESPONSE_OPEN = "<|tool_response>"


@dataclass(frozen=True)
class Problem:
    name: str | None  # the function the call names (None: it names none that parses)
    error: str  # why the call is invalid


class ToolRepair:
    """The tool repair's view of one chat: its tokenizer and the tools it offers."""

    def __init__(self, tokenizer, tools):
        if tokenizer is None:
            raise InputError("tool_repair: the model has no tokenizer to read tool calls with")
        self.tokenizer = tokenizer
        self.tools = tools
        self.opener = tokenizer.token_to_id(RESPONSE_OPEN)
        if self.opener is None:
            raise InputError(f"tool_repair: the tokenizer has no {RESPONSE_OPEN!r} token")

    def problems(self, tokens: list[int]) -> list[Problem]:
        """The reply's invalid tool calls, in order ([] when every call is valid, or it makes none)."""
        calls = reply_parts(self.tokenizer, tokens)[3]
        out = []
        for call in calls:
            why = call_problem(call, self.tools)
            if why is not None:
                out.append(Problem(call.name, why))
        return out

    def feedback(self, problems: list[Problem]) -> list[int]:
        """The token ids of one error tool-response per invalid call, as the chat template renders them after a
        turn's calls."""
        names = [p.name or "tool" for p in problems]
        calls = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": {}}} for n in names]}
        responses = [{"role": "tool", "name": n, "content": {"error": _plain(f"invalid tool call: {p.error}")}}
                     for n, p in zip(names, problems)]
        render = self.tokenizer.apply_chat_template
        head = render([calls], add_generation_prompt=False, tokenize=False)
        text = render([calls] + responses, add_generation_prompt=False, tokenize=False)
        if not text.startswith(head):
            raise InputError("tool_repair: the chat template renders tool responses other than after the calls")
        return self.tokenizer.encode(text[len(head):])

    def trim(self, tokens: list[int]) -> int | None:
        """Where a rewritten reply's hallucinated tool-response tail begins (its first response opener), or None."""
        return next((i for i, t in enumerate(tokens) if t == self.opener), None)


def _plain(text: str) -> str:
    """`text` with no special-token lookalike (`<|`, `|>`), so the template's delimiters stay its own."""
    return text.replace("<|", "<").replace("|>", ">")
