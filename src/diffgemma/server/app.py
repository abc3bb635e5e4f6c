"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions and /v1/completions (plain and streamed),
/v1/models, /health.

Handlers only translate: the body is read within the size limit (body_limit.py), the request is checked and
rendered in a thread pool (prepare.py: protocol.py's checks, images, the chat template, the tokenizer), the
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
import logging
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..errors import DiffgemmaError
from ..events import BlockEvent, CancelledEvent, DoneEvent, ErrorEvent, RetryEvent, StartEvent
from ..reply import reply_parts
from ..tool_repair import ToolRepair
from . import frames, handlers, images, playground, structured
from .body_limit import BodyLimit, read_body
from .limits import default_max_body_bytes
from .openai_fields import Limits
from .prepare import PreparedChat, Served, prepare_chat, prepare_completion
from .protocol import Policy, RequestError, chunk, completion, new_id, text_chunk, text_completion, usage
from .reply_text import CompletionDeltas, ReplyDeltas, completion_text, final_message, reply_token_count
from .text_limit import max_prompt_chars
from .worker import QueueFull

log = logging.getLogger("diffgemma.server")

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
               limits=None, fresh_seed: bool = False, image_limits=None, max_body_bytes: int | None = None,
               strict_tools: bool = True):
    """The ASGI app over a running Worker. `base_settings`: the server's GenerationSettings, which each request's
    fields (max_tokens, seed, diffgemma) override. tool_validate: a request with tools gets a malformed tool call
    regenerated up to this many times (core/turn.py; the held-back call text is never streamed). api_key: when
    set, every request but /health must carry `Authorization: Bearer <api_key>` (a 401 otherwise). limits: the
    bounds on a request's `diffgemma` settings (openai_fields.Limits; None: the model's canvas_length only).
    fresh_seed: a request that names no seed gets a fresh random one (returned in the response's `diffgemma`
    field and journaled in the op-log), else the server's. image_limits: what a request's image_url parts may be
    (images.ImageLimits; None: its defaults, URLs refused). max_body_bytes: the largest request body taken (a 413
    beyond it, body_limit.py; None: what the image limits need, limits.default_max_body_bytes). strict_tools: tools
    marked `strict` have their calls constrained by a grammar under tool_choice auto (server/structured.py)."""
    app = FastAPI(title="diffgemma", version="1")
    model_config = getattr(getattr(worker, "model", None), "config", None)
    context = getattr(worker, "max_tokens", None)
    policy = Policy(limits=limits or Limits(), model_canvas=getattr(model_config, "canvas_length", None),
                    fresh_seed=fresh_seed, images=image_limits, context_tokens=context,
                    max_text_chars=None if context is None else max_prompt_chars(tokenizer, context))
    served = Served(worker, tokenizer, model_id, base_settings, policy, tool_validate, strict_tools)
    if max_body_bytes is None:
        image_limits = image_limits or images.ImageLimits()
        max_body_bytes = default_max_body_bytes(image_limits.max_bytes)
    handlers.install(app)
    app.include_router(playground.router(worker, base_settings, keyed=bool(api_key)))
    if api_key:
        app.add_middleware(_RequireKey, api_key=api_key)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before anything reads the body
    app.include_router(_info_routes(worker, model_id))
    app.include_router(_generation_routes(served))
    return app


class _RequireKey:
    """ASGI middleware: every HTTP request but /health and the playground's page (playground.PUBLIC) must carry
    `Authorization: Bearer <api_key>`; a 401 otherwise, sent before anything reads the request's body."""

    def __init__(self, app, api_key: str):
        self.app, self.want = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in playground.PUBLIC:
            header = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"").decode("latin-1")
            scheme, _, given = header.strip().partition(" ")
            given = given.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
            if not hmac.compare_digest(given, self.want):
                refusal = JSONResponse({"error": {"message": "a valid API key is needed: send the header "
                                                  "'Authorization: Bearer <key>'", "type": "authentication_error",
                                                  "param": None, "code": "invalid_api_key"}}, status_code=401)
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def _info_routes(worker, model_id: str) -> APIRouter:
    """/health, /metrics and /v1/models."""
    router = APIRouter()
    created = int(time.time())
    exporter = metrics_exporter(worker)

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics():
        body, media_type = exporter()
        return Response(content=body, media_type=media_type)

    def model_card():
        return {"id": model_id, "object": "model", "created": created, "owned_by": "diffgemma",
                "max_model_len": worker.max_tokens}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise RequestError(404, f"model {name!r} is not served here; this server serves {model_id!r}", "model",
                               "model_not_found")
        return model_card()

    return router


def _generation_routes(served: Served) -> APIRouter:
    """/v1/chat/completions and /v1/completions: the body is read (within the size limit), prepared in a thread
    (prepare.py), then queued on the worker and answered from its events."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _chat_reply(served, request, await _prepared(prepare_chat, served, request))

    @router.post("/v1/completions")
    async def completions(request: Request):
        req, ids = await _prepared(prepare_completion, served, request)
        return await _completion_reply(served, request, req, ids)

    return router


async def _prepared(prepare, served: Served, request: Request):
    """Read the body and run `prepare(served, body)` in the thread pool. A refusal leaves with nothing of the body
    attached (no traceback into the frames that held it, no chained error holding the text)."""
    raw = await read_body(request)
    try:
        return await run_in_threadpool(prepare, served, raw)
    except RequestError as e:
        error = e
    finally:
        del raw
    error.__context__ = None
    raise error.with_traceback(None)


async def _chat_reply(served: Served, request: Request, prep: PreparedChat):
    """Queue a prepared chat and answer it: whole, streamed, constrained by a grammar (response_format, a forced
    tool call, strict tools: written once, streamed as usual), or checked (what no grammar expresses, or
    --tool-validate without streaming: regenerated while the reply fails its check; structured.py). With the tool
    repair on, a reply is streamed only once it is whole (the repair may write it again) and the response's
    `diffgemma.tool_repair` says how many rounds it took and whether a call stayed invalid."""
    req, ids, prefix, tokenizer, model_id = prep.req, prep.ids, prep.prefix, served.tokenizer, served.model_id
    fmt, forced = req.response_format, req.tool_choice in ("required", "function")
    tools_on = req.tools is not None and req.tool_choice != "none"
    # the tool repair (the setting tool_repair: serve --tool-repair, or the request's `diffgemma` field) takes the
    # place of --tool-validate: one retry rule a turn (core/repair.py)
    repair = ToolRepair(tokenizer, req.tools) if tools_on and req.settings.tool_repair else None
    retries = served.tool_validate if req.tools is not None and repair is None else 0

    def submit(settings, on_step=None):
        return _submit(served.worker, "messages", ids, settings, retries,
                       **({"images": prep.pictures} if prep.pictures else {}),
                       **({"on_step": on_step} if on_step else {}), **({"repair": repair} if repair else {}))

    stops = req.settings.stop_strings
    extra = {"seed": req.settings.seed}
    cid, t0 = new_id("chatcmpl-"), int(time.time())

    def message_chunk(delta, finish=None, usage_=None, choices=True):
        return dict(chunk(cid, model_id, t0, delta, finish, usage_, choices), diffgemma=extra)

    def build(result):
        canvas = req.settings.canvas_length or served.policy.model_canvas
        return final_message(tokenizer, prefix + list(result.tokens), tools_on, stops, req.tools,
                             req.parallel_tool_calls, None if canvas is None else len(prefix) + canvas)

    def counted(result, cached):
        return usage(len(ids), reply_token_count(tokenizer, result.tokens), cached)

    def check(message, calls):
        if forced:
            return structured.call_problem(calls, req.forced_name)
        if not calls and reply_parts(tokenizer, prefix + list(written["result"].tokens), stops)[3]:
            return "its tool calls do not fit the offered tools"
        return None if calls or fmt is None else fmt.problem(message.get("content"))

    def build_checked(result):
        written["result"] = result
        return build(result)

    written = {}
    path = prep.constraint.path if prep.constraint is not None else None
    if path is not None:
        extra["structured"] = path
    if path == "grammar" and not req.stream:  # valid by construction: written once, checked, never regenerated
        done = await _result(submit(req.settings), request)
        if not isinstance(done, tuple):
            return done
        cached, result = done
        message, calls = build_checked(result)
        problem = check(message, calls)
        if problem is not None and (fmt is not None or forced):
            if _finish(result, calls) == "length":
                problem = structured.budget_problem(req.settings.max_new_tokens, problem)
            raise structured.call_failed(1, problem) if forced else structured.format_failed(fmt, 1, problem)
        extra["attempts"] = 1
        return dict(completion(model_id, message, _finish(result, calls), counted(result, cached)), diffgemma=extra)
    # with --tool-validate, a call that parses but names a function not offered or breaks its parameter schema is
    # regenerated whole too (a stream sends as it goes, so there such a call is only left out)
    validate_calls = retries > 0 and tools_on and not req.stream
    if path == "checked" or validate_calls:  # a checked reply: regenerated while it fails its check
        async def generate(settings):
            return await _result(submit(settings), request)

        attempts = structured.FORMAT_ATTEMPTS if path == "checked" else retries + 1
        done = await structured.checked(generate, req.settings, build_checked, check, attempts)
        if not isinstance(done, tuple):
            return done
        cached, result, message, calls, attempts, problem = done
        if problem is not None and (fmt is not None or forced):
            raise structured.call_failed(attempts, problem) if forced else \
                structured.format_failed(fmt, attempts, problem)
        extra["attempts"] = attempts
        return _whole(req, model_id, message_chunk, message, _finish(result, calls), counted(result, cached), extra)
    live = frames.FrameStream(tokenizer, req.settings, lambda: message_chunk({}, choices=False)) \
        if prep.frames and req.stream and repair is None else None
    job = submit(req.settings, None if live is None else frames.snapshot)
    if req.stream and repair is None:
        deltas = ReplyDeltas(tokenizer, tools_on, stops, req.tools, req.parallel_tool_calls)
        return _streaming(_events(job, len(ids), req.include_usage, deltas, message_chunk,
                                  first={"role": "assistant", "content": ""}, empty={}, live=live))
    done = await _result(job, request)
    if not isinstance(done, tuple):
        return done
    cached, result = done
    message, calls = build(result)
    if repair is not None:  # a stream of a reply the repair may write again is sent once it is whole
        extra["tool_repair"] = {"rounds": result.tool_repairs, "failed": result.tool_repair_failed}
    return _whole(req, model_id, message_chunk, message, _finish(result, calls), counted(result, cached), extra)


def _whole(req, model_id: str, message_chunk, message: dict, finish: str, use: dict, extra: dict):
    """A reply answered once it is whole: a completion, or for a stream its chunks sent at once."""
    if req.stream:
        usage_ = use if req.include_usage else None
        return _streaming(structured.buffered_chunks(message_chunk, message, finish, usage_))
    return dict(completion(model_id, message, finish, use), diffgemma=extra)


async def _completion_reply(served: Served, request: Request, req, ids: list[int]):
    """Queue a prepared /v1/completions request and answer it, whole or streamed."""
    tokenizer, model_id = served.tokenizer, served.model_id
    job = _submit(served.worker, "prompt", ids, req.settings)
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


def _submit(worker, param: str, *args, **kw):
    """worker.submit, its refusals as HTTP errors: a request that cannot fit is a 400 naming `param`; a full queue a
    503 with Retry-After."""
    try:
        return worker.submit(*args, **kw)
    except QueueFull as e:
        raise RequestError(503, str(e), None, "server_busy", headers={"Retry-After": str(e.retry_after)}) from None
    except DiffgemmaError as e:
        raise RequestError(400, str(e), param) from None


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
    """A failed generation's 500: its kind for the client, the detail (which may name server files) in the log."""
    log.error("generation failed", exc_info=e)
    return {"error": {"message": f"generation failed ({type(e).__name__}); the server's log has the details",
                      "type": "server_error", "param": None, "code": None}}


async def _next(job, request):
    """The job's next event; cancels the job if the client goes away while it waits."""
    while True:
        try:
            return await asyncio.wait_for(job.aget(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
