"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions and /v1/completions (plain and streamed),
/v1/models, /health.

Handlers only translate: the request is checked and rendered here (protocol.py, the chat template), the
worker thread runs the generation (in its continuous batch), and its events (events.py) become a response or
server-sent events. A full queue is a 503 with Retry-After. A streaming client that disconnects cancels its
generation at its next denoise step (the next write fails). A
non-streaming handler polls `request.is_disconnected()`; where the ASGI server does not report a client that left
once the body is in, the reply runs to its end and the slot's KV is kept for the conversation.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import DiffgemmaError
from ..events import BlockEvent, CancelledEvent, DoneEvent, ErrorEvent, RetryEvent, StartEvent
from ..reply import reply_parts
from ..vision.prompt import has_images, render_prompt, vision_for
from . import frames, handlers, images, playground, structured
from .openai_fields import Limits
from .protocol import (Policy, RequestError, chunk, completion, new_id, parse_chat_request, parse_completion_request,
                       text_chunk, text_completion, usage)
from .reply_text import CompletionDeltas, ReplyDeltas, completion_text, final_message, reply_token_count
from .worker import QueueFull

POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there


def metrics_exporter(worker):
    """-> a call giving /metrics' (body, media type), or raising the 404 that says why there is none (a worker
    without metrics; no prometheus_client, which `diffgemma serve` requires but a bare app does not)."""
    why = None if hasattr(worker, "metrics") else "this server's worker keeps no metrics"
    if why is None:
        try:
            from .metrics import exposition, registry_for
        except ImportError:
            why = "/metrics needs prometheus_client: pip install 'diffgemma[serve]'"
    if why is not None:
        def unavailable():
            raise RequestError(404, why, None, "not_found")
        return unavailable
    registry = registry_for(worker)
    return lambda: exposition(registry)


def create_app(worker, tokenizer, model_id: str, base_settings, tool_validate: int = 0, api_key: str | None = None,
               limits=None, fresh_seed: bool = False, image_limits=None):
    """The ASGI app over a running Worker. `base_settings`: the server's GenerationSettings, which each request's
    fields (max_tokens, seed, diffgemma) override. tool_validate: a request with tools gets a malformed tool call
    regenerated up to this many times (session.run_turn; the held-back call text is never streamed). api_key: when
    set, every request but /health must carry `Authorization: Bearer <api_key>` (a 401 otherwise). limits: the
    bounds on a request's `diffgemma` settings (openai_fields.Limits; None: the model's canvas_length only).
    fresh_seed: a request that names no seed gets a fresh random one (returned in the response's `diffgemma`
    field and journaled in the op-log), else the server's. image_limits: what a request's image_url parts may be
    (images.ImageLimits; None: its defaults, URLs refused)."""
    app = FastAPI(title="diffgemma", version="1")
    created = int(time.time())
    model_config = getattr(getattr(worker, "model", None), "config", None)
    policy = Policy(limits=limits or Limits(), model_canvas=getattr(model_config, "canvas_length", None),
                    fresh_seed=fresh_seed, images=image_limits)
    handlers.install(app)
    app.include_router(playground.router(worker, base_settings, keyed=bool(api_key)))

    if api_key:
        want = api_key.encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
            given = given.strip().encode() if scheme.lower() == "bearer" else b""
            if request.url.path not in playground.PUBLIC and not hmac.compare_digest(given, want):
                return JSONResponse({"error": {"message": "a valid API key is needed: send the header "
                                               "'Authorization: Bearer <key>'", "type": "authentication_error",
                                               "param": None, "code": "invalid_api_key"}}, status_code=401)
            return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    exporter = metrics_exporter(worker)

    @app.get("/metrics")
    async def metrics():
        body, media_type = exporter()
        return Response(content=body, media_type=media_type)

    def model_card():
        return {"id": model_id, "object": "model", "created": created, "owned_by": "diffgemma",
                "max_model_len": worker.max_tokens}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise RequestError(404, f"model {name!r} is not served here; this server serves {model_id!r}", "model",
                               "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        want_frames = frames.requested(body)  # taken out of the body's diffgemma settings
        req = parse_chat_request(body, model_id, base_settings, policy)
        fmt, forced = req.response_format, req.tool_choice in ("required", "function")
        messages, pictures = req.messages, {}
        if has_images(messages):  # decoded here: a bad image is the request's 400, before it is queued
            images.count_images(messages, image_limits)
            messages = images.prepare(getattr(worker, "model", None), messages, image_limits)
        messages = messages if fmt is None else structured.with_instruction(messages, fmt)
        prefix = tokenizer.encode(structured.forced_call_text(req.forced_name)) if forced else []
        try:
            vision = vision_for(worker.model) if has_images(messages) else None
            ids, pictures = render_prompt(tokenizer, vision, messages, tools=req.tools, add_generation_prompt=True,
                                          enable_thinking=req.think)
            ids = ids + prefix
        except DiffgemmaError as e:
            raise RequestError(400, str(e), "messages") from None
        except Exception as e:  # the template's own errors (a missing field, a wrong type)
            raise RequestError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                               "messages") from None
        retries = tool_validate if req.tools is not None else 0

        def submit(settings, on_step=None):
            return _submit(worker, "messages", ids, settings, retries, **({"images": pictures} if pictures else {}),
                           **({"on_step": on_step} if on_step else {}))

        tools_on = req.tools is not None and req.tool_choice != "none"
        stops = req.settings.stop_strings
        extra = {"seed": req.settings.seed}
        cid, t0 = new_id("chatcmpl-"), int(time.time())

        def message_chunk(delta, finish=None, usage_=None, choices=True):
            return dict(chunk(cid, model_id, t0, delta, finish, usage_, choices), diffgemma=extra)

        def build(result):
            canvas = req.settings.canvas_length or policy.model_canvas
            return final_message(tokenizer, prefix + list(result.tokens), tools_on, stops, req.tools,
                                 req.parallel_tool_calls, None if canvas is None else len(prefix) + canvas)

        def counted(result, cached):
            return usage(len(ids), reply_token_count(tokenizer, result.tokens), cached)

        # with --tool-validate, a call that parses but names a function not offered or breaks its parameter schema is
        # regenerated whole too (a stream sends as it goes, so there such a call is only left out)
        validate_calls = retries > 0 and tools_on and not req.stream
        if fmt is not None or forced or validate_calls:  # a checked reply: regenerated while it fails its check
            written = {}

            def build_checked(result):
                written["tokens"] = prefix + list(result.tokens)
                return build(result)

            def check(message, calls):
                if forced:
                    return structured.call_problem(calls, req.forced_name)
                if not calls and reply_parts(tokenizer, written["tokens"], stops)[3]:
                    return "its tool calls do not fit the offered tools"
                return None if calls or fmt is None else fmt.problem(message.get("content"))

            async def generate(settings):
                return await _result(submit(settings), request)

            attempts = structured.FORMAT_ATTEMPTS if fmt is not None or forced else retries + 1
            done = await structured.checked(generate, req.settings, build_checked, check, attempts)
            if not isinstance(done, tuple):
                return done
            cached, result, message, calls, attempts, problem = done
            if problem is not None and (fmt is not None or forced):
                raise structured.call_failed(attempts, problem) if forced else \
                    structured.format_failed(fmt, attempts, problem)
            extra["attempts"] = attempts
            use = counted(result, cached)
            if req.stream:
                return _streaming(structured.buffered_chunks(message_chunk, message, _finish(result, calls),
                                                             use if req.include_usage else None))
            return dict(completion(model_id, message, _finish(result, calls), use), diffgemma=extra)
        live = frames.FrameStream(tokenizer, req.settings, lambda: message_chunk({}, choices=False)) \
            if want_frames and req.stream else None
        job = submit(req.settings, None if live is None else frames.snapshot)
        if req.stream:
            deltas = ReplyDeltas(tokenizer, tools_on, stops, req.tools, req.parallel_tool_calls)
            return _streaming(_events(job, len(ids), req.include_usage, deltas, message_chunk,
                                      first={"role": "assistant", "content": ""}, empty={}, live=live))
        done = await _result(job, request)
        if not isinstance(done, tuple):
            return done
        cached, result = done
        message, calls = build(result)
        return dict(completion(model_id, message, _finish(result, calls), counted(result, cached)), diffgemma=extra)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion_request(await _json(request), model_id, base_settings, policy)
        ids = prompt_ids(tokenizer, req.prompt)
        job = _submit(worker, "prompt", ids, req.settings)
        stops = req.settings.stop_strings
        extra = {"seed": req.settings.seed}
        if req.stream:
            cid, t0 = new_id("cmpl-"), int(time.time())

            def piece(text, finish=None, usage_=None, choices=True):
                return dict(text_chunk(cid, model_id, t0, text, finish, usage_, choices), diffgemma=extra)

            deltas = CompletionDeltas(tokenizer, stops)
            return _streaming(_events(job, len(ids), req.include_usage, deltas, piece, first=None, empty=""))
        done = await _result(job, request)
        if not isinstance(done, tuple):
            return done
        cached, result = done
        return dict(text_completion(model_id, completion_text(tokenizer, result.tokens, stops), _finish(result, []),
                                    usage(len(ids), reply_token_count(tokenizer, result.tokens), cached)),
                    diffgemma=extra)

    return app


def _submit(worker, param: str, *args, **kw):
    """worker.submit, its refusals as HTTP errors: a request that cannot fit is a 400 naming `param`; a full queue a
    503 with Retry-After."""
    try:
        return worker.submit(*args, **kw)
    except QueueFull as e:
        raise RequestError(503, str(e), None, "server_busy", headers={"Retry-After": str(e.retry_after)}) from None
    except DiffgemmaError as e:
        raise RequestError(400, str(e), param) from None


async def _json(request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError(400, "the request body is nested too deeply") from None


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


def _streaming(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def _result(job, request):
    """Wait for a non-streaming job -> (cached tokens, GenerationResult), or the error response to send."""
    cached = 0
    while True:
        event = await _next(job, request)
        if isinstance(event, StartEvent):
            cached = event.cached_tokens
        elif isinstance(event, DoneEvent):
            return cached, event.result
        elif isinstance(event, ErrorEvent):
            return JSONResponse(_error_body(event.error), status_code=500)
        elif isinstance(event, CancelledEvent):  # the client left; nobody reads this
            return JSONResponse(RequestError(499, "cancelled", code="cancelled").body(), status_code=499)


async def _events(job, prompt_tokens: int, include_usage: bool, deltas, make, first, empty, live=None):
    """A job's events as server-sent events: `make(delta, finish, usage, choices)` builds a chunk from what
    `deltas` (ReplyDeltas or CompletionDeltas) gives; `first`, if any, opens the stream; `empty` is a chunk's
    delta with nothing in it. live: the stream's frames.FrameStream, when its request asked for frames."""

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    cached = 0
    try:
        if first is not None:
            yield sse(make(first))
        while True:
            event = await job.aget()
            if live is not None and (text := live.sse(event)) is not None:
                yield text
            if isinstance(event, StartEvent):
                cached = event.cached_tokens
            elif isinstance(event, BlockEvent):
                delta = deltas.feed(event.tokens)
                if delta:
                    yield sse(make(delta))
            elif isinstance(event, RetryEvent):  # a malformed tool call is regenerated: its text was held back
                deltas.rewind(event.kept)
            elif isinstance(event, DoneEvent):
                delta, _, calls = deltas.finish()
                if delta:
                    yield sse(make(delta))
                yield sse(make(empty, _finish(event.result, calls)))
                if include_usage:
                    count = reply_token_count(deltas.tokenizer, event.result.tokens)
                    yield sse(make(empty, None, usage(prompt_tokens, count, cached), False))
                break
            elif isinstance(event, ErrorEvent):
                yield sse(_error_body(event.error))
                break
            elif isinstance(event, CancelledEvent):
                break
        yield "data: [DONE]\n\n"
    finally:  # also reached when the client disconnects and the response is torn down
        job.cancel()


def _finish(result, calls) -> str:
    if calls:
        return "tool_calls"
    return "stop" if result.stop_token is not None or result.stop_string is not None else "length"


def _error_body(e: Exception) -> dict:
    return {"error": {"message": f"generation failed: {type(e).__name__}: {e}", "type": "server_error",
                      "param": None, "code": None}}


async def _next(job, request):
    """The job's next event; cancels the job if the client goes away while it waits."""
    while True:
        try:
            return await asyncio.wait_for(job.aget(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
