"""The OpenAI wire format (chat completions and completions): a request body -> what the engine needs, a reply ->
response JSON.

Pure functions over dicts (no HTTP, no model), so every refusal is testable on its own. A request field we
cannot honour is refused with its name (HTTP 400), never silently dropped, except the sampling knobs of
autoregressive models (temperature, top_p, penalties), which have no meaning for the diffusion sampler: it
runs its own temperature schedule, set through the `diffgemma` field (any GenerationSettings name).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from ..errors import SettingsError
from ..reply import tool_result_value
from ..settings import GenerationSettings

# accepted and ignored: autoregressive sampling knobs (see the module docstring) and bookkeeping fields
IGNORED_FIELDS = {"temperature", "top_p", "frequency_penalty", "presence_penalty", "user", "parallel_tool_calls",
                  "metadata", "store", "service_tier"}
KNOWN_FIELDS = IGNORED_FIELDS | {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens",
                                 "max_completion_tokens", "seed", "n", "stop", "logprobs", "top_logprobs",
                                 "response_format", "chat_template_kwargs", "diffgemma"}
COMPLETION_FIELDS = IGNORED_FIELDS | {"model", "prompt", "stream", "stream_options", "max_tokens", "seed", "n", "stop",
                                      "logprobs", "echo", "suffix", "best_of", "diffgemma"}


class RequestError(Exception):
    """A request the server refuses: the HTTP status and a message naming the field and what was expected."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


@dataclass
class ChatRequest:
    messages: list[dict]  # in the chat template's form
    tools: list[dict] | None
    think: bool
    stream: bool
    include_usage: bool
    settings: GenerationSettings
    tool_choice: str = "auto"  # "auto" or "none" (calls in the reply are then returned as text)


@dataclass
class CompletionRequest:
    prompt: str | list[int]  # text (BOS is put before it), or token ids as they are
    stream: bool
    include_usage: bool
    settings: GenerationSettings


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param)


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined). Other part types are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}.content[{i}]: only text parts are supported, got {kind!r}", where)
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"{where}.content: expected a string or a list of text parts", where)


def _arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError as e:
        raise _bad(f"{where}.function.arguments: not valid JSON ({e.msg})", where) from None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments: expected a JSON object", where)
    return args


def _tool_content(content, where: str):
    return tool_result_value(_text(content, where))


def convert_messages(messages) -> list[dict]:
    """OpenAI messages -> the chat template's: assistant tool calls with their arguments as objects, tool results
    named after the call they answer (the template writes `response:NAME{...}`)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: expected a non-empty list", "messages")
    out, call_names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where}: expected an object", where)
        role = m.get("role")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text(m.get("content"), where)})
        elif role == "user":
            out.append({"role": "user", "content": _text(m.get("content"), where)})
        elif role == "assistant":
            msg = {"role": "assistant", "content": _text(m.get("content"), where)}
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls: expected a list", where)
            if calls:
                msg["tool_calls"] = []
                for j, c in enumerate(calls):
                    cw = f"{where}.tool_calls[{j}]"
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise _bad(f"{cw}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}", cw)
                    msg["tool_calls"].append({"type": "function", "function": {
                        "name": fn["name"], "arguments": _arguments(fn.get("arguments", {}), cw)}})
                    if isinstance(c.get("id"), str):
                        call_names[c["id"]] = fn["name"]
            out.append(msg)
        elif role == "tool":
            name = m.get("name")
            if not isinstance(name, str):
                name = call_names.get(m.get("tool_call_id"))
            if name is None:
                raise _bad(f"{where}: tool_call_id {m.get('tool_call_id')!r} names no earlier assistant tool call", where)
            out.append({"role": "tool", "name": name, "content": _tool_content(m.get("content"), where)})
        else:
            raise _bad(f"{where}.role: {role!r}; expected system, developer, user, assistant or tool", where)
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools: expected a list of {'type': 'function', 'function': {...}}", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name', ...}}}}", "tools")
    return tools or None


def _common(body, model_id: str, base: GenerationSettings, known: set) -> tuple[bool, bool, GenerationSettings]:
    """The fields both endpoints share -> (stream, include_usage, settings): unknown fields, model, n, stop, logprobs,
    stream and stream_options, and the generation settings (max_tokens, seed, stop, diffgemma)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise _bad(f"unknown field(s) {unknown}; this server takes {sorted(known)}", unknown[0])
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(404, f"model {model!r} is not served here; this server serves {model_id!r}", "model")
    if body.get("n") not in (None, 1):
        raise _bad("n: only 1 completion per request is supported", "n")
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise _bad("stop: expected a non-empty string or an array of them", "stop")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs: not supported by the diffusion sampler (tokens are accepted by entropy, not drawn "
                   "one at a time)", "logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: expected true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise _bad("stream_options: only {'include_usage': true|false} is supported", "stream_options")

    overrides = body.get("diffgemma") or {}
    if not isinstance(overrides, dict):
        raise _bad("diffgemma: expected an object of generation settings, e.g. {'entropy_bound': 0.2}", "diffgemma")
    overrides = dict(overrides)
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            overrides["max_new_tokens"] = body[name]
    if body.get("seed") is not None:
        overrides["seed"] = body["seed"]
    if stop is not None:
        overrides["stop_strings"] = tuple(stop)
    try:
        settings = base.replace(**overrides) if overrides else base
    except SettingsError as e:
        raise _bad(f"settings: {e}", "diffgemma") from None
    return stream, bool(opts.get("include_usage", False)), settings


def parse_chat_request(body, model_id: str, base: GenerationSettings) -> ChatRequest:
    """Validate a /v1/chat/completions body against what this server does -> ChatRequest, or RequestError."""
    stream, include_usage, settings = _common(body, model_id, base, KNOWN_FIELDS)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("response_format: only {'type': 'text'} is supported", "response_format")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none"):
        raise _bad("tool_choice: 'auto' or 'none' (the model's tool-call grammar is not constrained, so a call "
                   "cannot be required)", "tool_choice")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"} \
            or not isinstance(kwargs.get("enable_thinking", False), bool):
        raise _bad("chat_template_kwargs: only {'enable_thinking': true|false} is supported", "chat_template_kwargs")
    return ChatRequest(messages=convert_messages(body.get("messages")), tools=_tools(body.get("tools")),
                       think=kwargs.get("enable_thinking", False), stream=stream, include_usage=include_usage,
                       settings=settings, tool_choice=tool_choice)


def parse_completion_request(body, model_id: str, base: GenerationSettings) -> CompletionRequest:
    """Validate a /v1/completions body -> CompletionRequest, or RequestError. One prompt: a string, or token ids."""
    stream, include_usage, settings = _common(body, model_id, base, COMPLETION_FIELDS)
    if body.get("echo"):
        raise _bad("echo: not supported (the response carries the completion only)", "echo")
    if body.get("suffix"):
        raise _bad("suffix: not supported (the model has no fill-in-the-middle format)", "suffix")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of: only 1 is supported", "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids_ok = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or ids_ok) or not prompt:
        raise _bad("prompt: expected one non-empty prompt: a string or a list of token ids", "prompt")
    return CompletionRequest(prompt=prompt, stream=stream, include_usage=include_usage, settings=settings)


# ----------------------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def tool_calls_json(calls) -> list[dict]:
    return [{"id": new_id("call_"), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _response(cid: str, kind: str, created: int, model_id: str, choice: dict | None, finish_reason,
              usage_: dict | None) -> dict:
    """A response or stream chunk of either endpoint: one choice (its body, and finish_reason), or none (a usage
    chunk)."""
    out = {"id": cid, "object": kind, "created": created, "model": model_id,
           "choices": [] if choice is None else [{"index": 0, **choice, "finish_reason": finish_reason}]}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def completion(model_id: str, message: dict, finish_reason: str, usage_: dict) -> dict:
    return _response(new_id("chatcmpl-"), "chat.completion", int(time.time()), model_id, {"message": message},
                     finish_reason, usage_)


def chunk(cid: str, model_id: str, created: int, delta: dict, finish_reason: str | None = None,
          usage_: dict | None = None, choices: bool = True) -> dict:
    return _response(cid, "chat.completion.chunk", created, model_id, {"delta": delta} if choices else None,
                     finish_reason, usage_)


def text_completion(model_id: str, text: str, finish_reason: str, usage_: dict) -> dict:
    return _response(new_id("cmpl-"), "text_completion", int(time.time()), model_id,
                     {"text": text, "logprobs": None}, finish_reason, usage_)


def text_chunk(cid: str, model_id: str, created: int, text: str, finish_reason: str | None = None,
               usage_: dict | None = None, choices: bool = True) -> dict:
    return _response(cid, "text_completion", created, model_id, {"text": text, "logprobs": None} if choices else None,
                     finish_reason, usage_)
