"""A request's preparation, from its body's bytes to the prompt ids the worker takes: JSON parsing, the request's
checks (protocol.py; JSON-schema checks of response_format and tools), image decoding and fetching (images.py),
the chat template's rendering and tokenizing. Plain blocking functions, which the HTTP handlers (app.py) run in a
thread pool, so the event loop keeps answering /health and streaming other replies while one request is prepared
(an image URL that never answers holds its own request only, until its deadline).

Every refusal is a RequestError in the client's terms; what only the operator can act on (a server file, its
configuration) goes to the server's log, and the client gets a 500 saying the server failed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ..errors import CheckpointError, ConfigError, DiffgemmaError
from ..vision.prompt import has_images, render_prompt, vision_for
from . import frames, images, structured
from .errors import RequestError
from .protocol import ChatRequest, CompletionRequest, Policy, parse_chat_request, parse_completion_request

log = logging.getLogger("diffgemma.server")


@dataclass(frozen=True)
class Served:
    """What every request is prepared against: the model (the worker's), its tokenizer, the served name, the
    server's settings and what it allows (Policy)."""

    worker: object
    tokenizer: object
    model_id: str
    base: object  # GenerationSettings, which a request's fields override
    policy: Policy
    tool_validate: int = 0  # a malformed tool call is regenerated up to this many times
    strict_tools: bool = True  # tools marked `strict` constrain their calls under tool_choice auto (structured.py)

    @property
    def model(self):
        return getattr(self.worker, "model", None)


@dataclass
class PreparedChat:
    req: ChatRequest
    ids: list[int]  # the rendered prompt, with `prefix` at its end
    prefix: list[int]  # a forced tool call's opener, written into the prompt (structured.forced_call_text)
    pictures: dict  # the prompt's images by key (vision/prompt.py), or {}
    frames: bool = False  # the stream carries canvas frames (frames.py)
    constraint: object = None  # structured.Constraint (its grammar is in req.settings), or None for free text


def parse_json(raw) -> object:
    """The request body's bytes -> its JSON value, or a 400 (malformed, or nested too deeply to parse)."""
    problem = None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"the request body is not valid JSON ({e})"
    except RecursionError:
        problem = "the request body is nested too deeply"
    raise RequestError(400, problem)  # raised here, not in the except: the error keeps no link to the body


def prepare_chat(served: Served, raw) -> PreparedChat:
    """A /v1/chat/completions body -> the request and its prompt ids, or RequestError."""
    body = parse_json(raw)
    want_frames = frames.requested(body)  # taken out of the body's diffgemma settings
    req = parse_chat_request(body, served.model_id, served.base, served.policy)
    messages = req.messages
    if has_images(messages):  # decoded here: a bad image is the request's 400, before it is queued
        images.count_images(messages, served.policy.images)
        messages = images.prepare(served.model, messages, served.policy.images)
    fmt = req.response_format
    messages = messages if fmt is None else structured.with_instruction(messages, fmt)
    constraint = structured.constrain(req, served.tokenizer.token_to_id, served.model, served.strict_tools)
    if constraint is not None and constraint.grammar is not None:
        if req.settings.grammar is not None:
            raise RequestError(400, "diffgemma.grammar: the request's response_format or tool_choice already "
                                    "constrains the reply; send one of them", "diffgemma")
        req.settings = req.settings.replace(grammar=constraint.grammar)
    # a grammar writes a forced call's opener itself: the prompt stays what the chat template renders
    forced = req.tool_choice in ("required", "function") and (constraint is None or constraint.grammar is None)
    prefix = served.tokenizer.encode(structured.forced_call_text(req.forced_name)) if forced else []
    try:
        vision = vision_for(served.model) if has_images(messages) else None
        ids, pictures = render_prompt(served.tokenizer, vision, messages, tools=req.tools,
                                      add_generation_prompt=True, enable_thinking=req.think)
    except (CheckpointError, ConfigError) as e:  # the server's files, not the request
        log.error("cannot render a chat: %s", e)
        raise RequestError(500, "the server cannot render chats (its log says why)", None, "internal_error") \
            from None
    except DiffgemmaError as e:
        raise RequestError(400, str(e), "messages") from None
    except Exception as e:  # the template's own errors (a missing field, a wrong type)
        raise RequestError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                           "messages") from None
    return PreparedChat(req, ids + prefix, prefix, pictures, want_frames, constraint)


def prepare_completion(served: Served, raw) -> tuple[CompletionRequest, list[int]]:
    """A /v1/completions body -> the request and its prompt ids, or RequestError."""
    req = parse_completion_request(parse_json(raw), served.model_id, served.base, served.policy)
    return req, prompt_ids(served.tokenizer, req.prompt)


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A /v1/completions prompt -> token ids: text gets the model's BOS in front (as a chat rendering starts with
    it) unless it spells BOS out itself; ids are taken as they are, each checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        bos = tokenizer.bos_id
        return ids if bos is None or ids[:1] == [bos] else [bos] + ids
    bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"prompt: token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})",
                           "prompt")
    return list(prompt)
