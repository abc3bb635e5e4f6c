"""Which OpenAI request fields the server takes, and what it does with each: honour it, ignore it (one log line
per field name), or refuse it because ignoring it would silently change an answer the client relies on.

Also the server-side bounds on the per-request `diffgemma` settings: an override that could hold the only
worker for minutes or allocate a huge canvas is refused with 400 before any work starts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger("diffgemma.server")

# Sampling knobs of autoregressive decoders and bookkeeping fields: accepted, not applied. The diffusion sampler
# runs its own temperature schedule (settable through the `diffgemma` field); the bookkeeping fields describe the
# caller, not the answer. top_k, min_p, repetition_penalty are the common vendor extensions (vLLM, llama.cpp).
IGNORED = frozenset({
    "temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "verbosity", "prediction",
})

# Fields OpenAI's chat completions API takes, beyond IGNORED, each honoured or checked by protocol.py.
CHAT = IGNORED | {
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "seed", "n", "stop", "logprobs", "top_logprobs", "response_format", "reasoning_effort",
    "modalities", "audio", "functions", "function_call", "web_search_options", "chat_template_kwargs", "diffgemma",
}
COMPLETION = IGNORED | {"model", "prompt", "stream", "stream_options", "max_tokens", "seed", "n", "stop", "logprobs",
                        "echo", "suffix", "best_of", "diffgemma"}

# reasoning_effort -> the thought channel on or off (the model has no finer control)
REASONING_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}

_noted: set[str] = set()
_noted_lock = threading.Lock()


def note_ignored(body: dict) -> None:
    """Log, once per field name per process, the accepted fields that are not applied."""
    fresh = []
    with _noted_lock:
        for name in sorted(IGNORED & set(body)):
            if body[name] is not None and name not in _noted:
                _noted.add(name)
                fresh.append(name)
    for name in fresh:
        log.info("request field %r accepted and ignored (it has no meaning for this model's sampler)", name)


def refused(body: dict) -> tuple[str, str] | None:
    """-> (field, why) for an OpenAI field whose value this server cannot honour and the client relies on, or None."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        return "functions", "functions/function_call: the legacy function fields are not supported; send `tools`"
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
        return "modalities", "modalities: only ['text'] is supported (the model writes text only)"
    if body.get("audio") is not None:
        return "audio", "audio: not supported (the model writes text only)"
    if body.get("web_search_options") is not None:
        return "web_search_options", "web_search_options: not supported (this server has no web search)"
    effort = body.get("reasoning_effort")
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORT):
        return "reasoning_effort", f"reasoning_effort: expected one of {sorted(REASONING_EFFORT)}, got {effort!r}"
    return None


@dataclass(frozen=True)
class Limits:
    """The most a single request may ask of the worker through its `diffgemma` settings (serve's --limit flags).
    None = the model's own value is the limit (canvas_length)."""

    canvas_length: int | None = None  # default: the model's canvas_length
    max_denoising_steps: int = 256
    empty_reply_retry: int = 8
    tool_repair_attempts: int = 4  # each round of a tool repair is a whole generation (core/repair.py)
    stop_strings: int = 16  # how many stop texts
    stop_string_chars: int = 256  # the longest one

    @staticmethod
    def names() -> tuple[str, ...]:
        return ("canvas_length", "max_denoising_steps", "empty_reply_retry", "tool_repair_attempts", "stop_strings",
                "stop_string_chars")

    def replace(self, items) -> "Limits":
        """A copy with NAME=VALUE strings applied (serve's --limit); a bad one raises ValueError naming it."""
        import dataclasses

        changes = {}
        for item in items:
            name, sep, value = str(item).partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in self.names():
                raise ValueError(f"--limit {item!r}: expected NAME=VALUE with NAME one of {', '.join(self.names())}")
            try:
                changes[name] = int(value)
            except ValueError:
                raise ValueError(f"--limit {item!r}: expected a positive integer") from None
            if changes[name] < (0 if name == "empty_reply_retry" else 1):
                raise ValueError(f"--limit {item!r}: expected a positive integer")
        return dataclasses.replace(self, **changes)


def over_limit(settings, base, limits: Limits, model_canvas: int | None) -> tuple[str, str] | None:
    """-> (setting, message) for the first setting a request changed from the server's own (`base`) past the
    server's limits, or None. The server's own settings are the operator's choice and are not limited."""
    canvas_cap = limits.canvas_length or model_canvas
    if canvas_cap is not None and settings.canvas_length is not None and settings.canvas_length > canvas_cap \
            and settings.canvas_length != base.canvas_length:
        return "canvas_length", (f"canvas_length {settings.canvas_length}: over this server's limit of {canvas_cap} "
                                 f"(serve --limit canvas_length=N)")
    for name in ("max_denoising_steps", "empty_reply_retry", "tool_repair_attempts"):
        value, cap = getattr(settings, name), getattr(limits, name)
        if value > cap and value != getattr(base, name):
            return name, f"{name} {value}: over this server's limit of {cap} (serve --limit {name}=N)"
    if len(settings.stop_strings) > limits.stop_strings:
        return "stop", (f"stop: {len(settings.stop_strings)} stop texts, over this server's limit of "
                        f"{limits.stop_strings}")
    longest = max((len(s) for s in settings.stop_strings), default=0)
    if longest > limits.stop_string_chars:
        return "stop", f"stop: a stop text of {longest} characters, over this server's limit of " \
                       f"{limits.stop_string_chars}"
    return None
