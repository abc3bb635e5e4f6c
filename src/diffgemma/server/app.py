"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions (plain and streamed), /v1/models, /health.

Handlers only translate: the request is checked and rendered here (protocol.py, the chat template), the
worker thread runs the generation, and its events become a response or server-sent events. A streaming
client that disconnects cancels its generation between denoise steps (seen with uvicorn: the next write
fails). A non-streaming handler also polls `request.is_disconnected()`, but under uvicorn 0.54 a client that
left was not noticed (a curl timing out after 0.3 s: its 345-token reply ran to the end), presumably because
the server stops reading the socket once the body is in; such a reply costs its time, and the slot's KV is
still kept for the conversation.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import DiffgemmaError
from .protocol import RequestError, chunk, completion, new_id, parse_chat_request, usage
from .reply_text import ReplyDeltas, final_message

POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there


def create_app(worker, tokenizer, model_id: str, base_settings, tool_validate: int = 0):
    """The ASGI app over a running Worker. `base_settings`: the server's GenerationSettings, which each request's
    fields (max_tokens, seed, diffgemma) override. tool_validate: a request with tools gets a malformed tool call
    regenerated up to this many times (session.run_turn; the held-back call text is never streamed)."""
    app = FastAPI(title="diffgemma", version="1")
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def refused(_, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "diffgemma"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON ({e})") from None
        req = parse_chat_request(body, model_id, base_settings)
        try:
            ids = tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                enable_thinking=req.think)
            job = worker.submit(ids, req.settings, tool_validate if req.tools is not None else 0)
        except DiffgemmaError as e:
            raise RequestError(400, str(e), "messages") from None
        except Exception as e:  # the template's own errors (a missing field, a wrong type)
            raise RequestError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                               "messages") from None
        tools_on = req.tools is not None and req.tool_choice == "auto"
        if req.stream:
            return StreamingResponse(_events(job, len(ids), tools_on, req.include_usage, req.settings.stop_strings),
                                     media_type="text/event-stream")
        cached, result = 0, None
        while result is None:
            kind, payload = await _next(job, request)
            if kind == "start":
                cached = payload["cached_tokens"]
            elif kind == "done":
                result = payload
            elif kind == "error":
                return JSONResponse(_error_body(payload), status_code=500)
            elif kind == "cancelled":  # the client left; nobody reads this
                return JSONResponse({"error": {"message": "cancelled", "type": "cancelled"}}, status_code=499)
        message, calls = final_message(tokenizer, result.tokens, tools_on, req.settings.stop_strings)
        return completion(model_id, message, _finish(result, calls), usage(len(ids), len(result.tokens), cached))

    async def _events(job, prompt_tokens: int, tools_on: bool, include_usage: bool, stops):
        cid, t0 = new_id("chatcmpl-"), int(time.time())
        deltas = ReplyDeltas(tokenizer, tools_on, stops)
        cached = 0

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            yield sse(chunk(cid, model_id, t0, {"role": "assistant", "content": ""}))
            while True:
                kind, payload = await asyncio.to_thread(job.get)
                if kind == "start":
                    cached = payload["cached_tokens"]
                elif kind == "block":
                    delta = deltas.feed(payload.tokens)
                    if delta:
                        yield sse(chunk(cid, model_id, t0, delta))
                elif kind == "retry":  # a malformed tool call is regenerated: its text was held back, not sent
                    deltas.rewind(payload["kept"])
                elif kind == "done":
                    delta, _, calls = deltas.finish()
                    if delta:
                        yield sse(chunk(cid, model_id, t0, delta))
                    yield sse(chunk(cid, model_id, t0, {}, _finish(payload, calls)))
                    if include_usage:
                        yield sse(chunk(cid, model_id, t0, {}, usage_=usage(prompt_tokens, len(payload.tokens),
                                                                            cached), choices=False))
                    break
                elif kind == "error":
                    yield sse(_error_body(payload))
                    break
                else:  # cancelled
                    break
            yield "data: [DONE]\n\n"
        finally:  # also reached when the client disconnects and the response is torn down
            job.cancel()

    return app


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
            return await asyncio.to_thread(job.get, POLL_S)
        except queue.Empty:
            if await request.is_disconnected():
                job.cancel()
