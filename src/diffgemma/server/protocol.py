"""The OpenAI wire format (chat completions and completions): a request body -> what the engine needs, a reply ->
response JSON.

Pure functions over dicts (no HTTP, no model), so every refusal is testable on its own. Every field OpenAI's
API takes is accepted (openai_fields.py): honoured where it maps onto the model, ignored (logged once) where it
has no meaning for the diffusion sampler (temperature, top_p, penalties, logit_bias: the sampler runs its own
temperature schedule, set through the `diffgemma` field, any GenerationSettings name), refused by name (HTTP
400) where ignoring it would silently change an answer the client relies on. A field OpenAI does not take is
refused as unknown.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from ..errors import SettingsError
from ..reply import tool_result_value
from ..settings import GenerationSettings
from . import openai_fields
from .errors import RequestError, error_body  # noqa: F401 (re-exported: callers import them from here)
from .images import ImageLimits, user_content
from .openai_fields import Limits
from .structured import check_tools_schemas, parse_response_format

IGNORED_FIELDS = openai_fields.IGNORED
KNOWN_FIELDS = openai_fields.CHAT
COMPLETION_FIELDS = openai_fields.COMPLETION

@dataclass(frozen=True)
class Policy:
    """What the server allows a request: limits on its `diffgemma` settings (None: none), and whether a request
    that names no seed gets a fresh random one (else the server's own seed)."""

    limits: Limits | None = None
    model_canvas: int | None = None  # the model's canvas_length: canvas_length's limit unless limits give one
    fresh_seed: bool = False
    images: ImageLimits | None = None  # what a request's image_url parts may be (images.py; None: the defaults)
    context_tokens: int | None = None  # the server's context: a prompt holds fewer tokens
    max_text_chars: int | None = None  # the most characters of text that context can hold (text_limit.py)


@dataclass
class ChatRequest:
    messages: list[dict]  # in the chat template's form
    tools: list[dict] | None
    think: bool
    stream: bool
    include_usage: bool
    settings: GenerationSettings
    tool_choice: str = "auto"  # "auto", "none" (calls in the reply are not returned as calls), "required", "function"
    forced_name: str | None = None  # tool_choice "function": the function the reply must call
    parallel_tool_calls: bool = True  # False: only the reply's first call is returned
    response_format: object = None  # structured.ResponseFormat, or None for text


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
                raise _bad(f"{where}.content[{i}]: only text parts are supported here (images: image_url parts of "
                           f"user messages), got {kind!r}", where)
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"{where}.content: expected a string or a list of text parts", where)


def _text_chars(content) -> int:
    """The characters of text in a message's content (a string, or the text parts of a list); 0 for anything else
    (convert_messages refuses what is malformed)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def check_text_fits(messages, policy: Policy | None) -> None:
    """Refuse (400) text no prompt of the server's context can hold, before anything renders or tokenizes it: a
    message's text, or all of them together, longer than the policy's max_text_chars, or more messages than the
    context has tokens."""
    if policy is None or not isinstance(messages, list):
        return
    ctx, limit = policy.context_tokens, policy.max_text_chars
    if ctx is not None and len(messages) > ctx:
        raise _bad(f"messages: {len(messages)} messages, more than this server's context of {ctx} tokens can hold",
                   "messages")
    if limit is None:
        return
    total = 0
    for i, m in enumerate(messages):
        n = _text_chars(m.get("content")) if isinstance(m, dict) else 0
        if n > limit:
            raise too_long(f"messages[{i}].content", n, policy)
        total += n
    if total > limit:
        raise too_long("messages", total, policy)


def too_long(where: str, chars: int, policy: Policy) -> RequestError:
    return _bad(f"{where}: {chars} characters of text, more than this server's context of {policy.context_tokens} "
                f"tokens can hold (at most {policy.max_text_chars} characters)", where.split(".")[0].split("[")[0])


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


def convert_messages(messages, images: ImageLimits | None = None) -> list[dict]:
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
            out.append({"role": "user", "content": user_content(m.get("content"), where, images, _text)})
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
                call_id = m.get("tool_call_id")
                name = call_names.get(call_id) if isinstance(call_id, str) else None
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


def _common(body, model_id: str, base: GenerationSettings, known, policy: Policy | None = None
            ) -> tuple[bool, bool, GenerationSettings]:
    """The fields both endpoints share -> (stream, include_usage, settings): unknown fields, model, n, stop, logprobs,
    stream and stream_options, and the generation settings (max_tokens, seed, stop, diffgemma), bounded by the
    server's policy."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - known, key=str)
    if unknown:
        raise _bad(f"unknown field(s) {unknown}; this server takes {sorted(known)}", str(unknown[0]))
    why = openai_fields.refused(body)
    if why is not None:
        raise _bad(why[1], why[0])
    openai_fields.note_ignored(body)
    policy = policy or Policy()
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(404, f"model {model!r} is not served here; this server serves {model_id!r}", "model",
                           "model_not_found")
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
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"} \
            or not isinstance(opts.get("include_usage", False), bool):
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
    if policy.fresh_seed and not any(str(k).strip().replace("-", "_").lower() == "seed" for k in overrides):
        overrides["seed"] = secrets.randbits(63)  # an agent's retry gets another answer; the response says which
    try:
        settings = base.replace(**overrides) if overrides else base
    except SettingsError as e:
        raise _bad(f"settings: {e}", "diffgemma") from None
    if policy.limits is not None:
        over = openai_fields.over_limit(settings, base, policy.limits, policy.model_canvas)
        if over is not None:
            raise _bad(over[1], "stop" if over[0] == "stop" else "diffgemma")
    return stream, bool(opts.get("include_usage", False)), settings


def _tool_choice(choice, tools) -> tuple[str, str | None]:
    """tool_choice -> ("auto" | "none" | "required" | "function", the named function or None)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
        name = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise _bad("tool_choice: expected {'type': 'function', 'function': {'name': NAME}}", "tool_choice")
        offered = [t["function"]["name"] for t in tools or []]
        if not offered:
            raise _bad("tool_choice: a tool call is required but the request offers no tools", "tool_choice")
        if name is not None and name not in offered:
            raise _bad(f"tool_choice: function {name!r} is not among the offered tools {offered}", "tool_choice")
        return ("function", name) if name is not None else ("required", None)
    raise _bad("tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': "
               "NAME}}", "tool_choice")


def parse_chat_request(body, model_id: str, base: GenerationSettings, policy: Policy | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body against what this server does -> ChatRequest, or RequestError."""
    stream, include_usage, settings = _common(body, model_id, base, KNOWN_FIELDS, policy)
    fmt = parse_response_format(body.get("response_format"))
    tools = _tools(body.get("tools"))
    check_tools_schemas(tools)
    tool_choice, forced = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls: expected true or false", "parallel_tool_calls")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"} \
            or not isinstance(kwargs.get("enable_thinking", False), bool):
        raise _bad("chat_template_kwargs: only {'enable_thinking': true|false} is supported", "chat_template_kwargs")
    think = kwargs.get("enable_thinking")
    effort = body.get("reasoning_effort")
    if effort is not None:
        by_effort = openai_fields.REASONING_EFFORT[effort]
        if think is not None and think != by_effort:
            raise _bad(f"reasoning_effort {effort!r} asks for thinking {'on' if by_effort else 'off'} but "
                       f"chat_template_kwargs.enable_thinking is {think}", "reasoning_effort")
        think = by_effort
    check_text_fits(body.get("messages"), policy)
    messages = convert_messages(body.get("messages"), policy.images if policy else None)
    return ChatRequest(messages=messages, tools=tools, think=bool(think), stream=stream, include_usage=include_usage,
                       settings=settings, tool_choice=tool_choice, forced_name=forced,
                       parallel_tool_calls=parallel, response_format=fmt)


def parse_completion_request(body, model_id: str, base: GenerationSettings,
                             policy: Policy | None = None) -> CompletionRequest:
    """Validate a /v1/completions body -> CompletionRequest, or RequestError. One prompt: a string, or token ids."""
    stream, include_usage, settings = _common(body, model_id, base, COMPLETION_FIELDS, policy)
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
    limit = policy.max_text_chars if policy is not None else None
    if isinstance(prompt, str) and limit is not None and len(prompt) > limit:
        raise too_long("prompt", len(prompt), policy)
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
