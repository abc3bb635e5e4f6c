"""The FastAPI exception handlers that send every failure the HTTP layer can meet as OpenAI's error object
(errors.py): a refused request (RequestError), routing errors (404, 405), FastAPI's own validation errors, a body
nested too deep to parse, and anything unexpected (500, its traceback logged, not sent)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import RequestError, error_body

log = logging.getLogger("diffgemma.server")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, kind), status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into an OpenAI-shaped body."""

    @app.exception_handler(RequestError)
    async def refused(_, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}; this server serves /v1/chat/completions, " \
                      f"/v1/completions, /v1/models, /health and a playground page at /"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error_response(400, f"{where or 'request'}: {first.get('msg', 'invalid')}", where)

    @app.exception_handler(RecursionError)
    async def too_deep(_, e: RecursionError):
        return error_response(400, "the request body is nested too deeply")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}", code="internal_error")
