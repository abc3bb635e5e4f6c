"""OpenAI's error object, and the exception that carries one: `{"error": {"message", "type", "param", "code"}}`.
Pure (no HTTP framework), so protocol checks and reply checks can raise it; handlers.py sends it."""

from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               kind: str | None = None) -> dict:
    """OpenAI's error object for an HTTP status (its `type` follows from the status unless given)."""
    kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestError(Exception):
    """A request the server refuses: the HTTP status and a message naming the field and what was expected."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # extra response headers (a 503's Retry-After)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


