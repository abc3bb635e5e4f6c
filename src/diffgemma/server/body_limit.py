"""The request body's size limit, enforced before the body is held in memory (an ASGI middleware).

A request whose Content-Length is over the limit is answered 413 at once, before any of its body is read (a
client waiting for `100 Continue` is never told to send it). A body without a Content-Length (chunked) is counted
as its pieces arrive: the piece that takes it over the limit raises BodyTooLarge from `receive`, which the
handler's exception handler (handlers.py) answers with the 413; the server (uvicorn) reads and drops the rest of
the upload, a piece at a time. `read_body` then holds at most the limit in one growing buffer.
"""

from __future__ import annotations

from .errors import RequestError
from .handlers import error_response
from .limits import MB


class BodyTooLarge(RequestError):
    """A request body over the server's limit: a 413 in OpenAI's error shape."""

    def __init__(self, limit: int):
        size = f"{limit} bytes" + (f" ({limit / MB:.1f} MB)" if limit >= MB else "")
        super().__init__(413, f"the request body is over this server's limit of {size}; send less (large "
                              f"images: fewer or smaller ones)", None, "request_too_large")


class BodyLimit:
    """ASGI middleware: HTTP requests get at most `max_bytes` of body through to the app (413 beyond)."""

    def __init__(self, app, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes: expected a positive number of bytes, got {max_bytes!r}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await _send_error(BodyTooLarge(self.max_bytes), scope, send)
        seen, started, limit = 0, False, self.max_bytes

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyTooLarge as e:  # raised where no exception handler answers it (e.g. outside a route)
            if started:
                raise
            await _send_error(e, scope, send)


def declared_length(scope) -> int | None:
    """The request's Content-Length as a number, or None when it sends none (chunked, or no body)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses a malformed one before the app sees it
                return None
    return None


async def read_body(request) -> bytearray:
    """The whole request body in one buffer, grown in place as pieces arrive (no list of pieces joined at the end,
    so the peak is the body once); never more than the limit, which BodyLimit enforces."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
    return body


async def _send_error(error: RequestError, scope, send) -> None:
    response = error_response(error.status, error.message, error.param, error.code)
    await response(scope, _no_receive, send)


async def _no_receive():  # pragma: no cover - a JSONResponse never reads the request
    return {"type": "http.disconnect"}
