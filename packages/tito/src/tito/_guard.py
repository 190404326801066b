"""What every request of tito's HTTP face passes first: the API key and the body-size limit; and the
error body of each protocol (Anthropic's under `/v1/messages`, OpenAI's elsewhere)."""

from __future__ import annotations

import secrets

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_BODY_BYTES = 16 * 1024 * 1024
_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
}
_OPENAI_KINDS = {401: "authentication_error", 404: "not_found", 413: "request_too_large"}


def error_response(
    request: Request, status: int, message: str, kind: str = "", param: str | None = None
) -> JSONResponse:
    """The error body of the request's protocol. `kind`: the OpenAI error type, by default the status's
    (`_OPENAI_KINDS`, else invalid_request_error); Anthropic's is the status's where it names one."""
    kind = kind or _OPENAI_KINDS.get(status, "invalid_request_error")
    if request.url.path.endswith("/v1/messages"):
        body = {"type": "error", "error": {"type": _ANTHROPIC_KINDS.get(status, kind), "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class Guard:
    """The API key and the body-size limit, checked before a request reaches a route (plain ASGI: the
    `@app.middleware` form wraps every request in extra tasks and streams, a measurable cost here)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if (refusal := self._refusal(Request(scope))) is not None:
                await refusal(scope, receive, send)
                return
            receive = _limited(receive)
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> JSONResponse | None:
        if self.api_key is not None and request.url.path != "/health":
            given = request.headers.get("x-api-key") or request.headers.get("authorization", "")
            if not secrets.compare_digest(given.removeprefix("Bearer ").encode(), self.api_key.encode()):
                return error_response(request, 401, "missing or wrong API key")
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            return error_response(request, 413, f"request body over {MAX_BODY_BYTES} bytes")
        return None


def _limited(receive):
    """`receive` that stops a body past MAX_BODY_BYTES as it arrives: a chunked body has no
    Content-Length to refuse it by. The 413 is raised as an HTTPException, which FastAPI's body
    reading passes on as it is."""
    received = 0

    async def limited():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, f"request body over {MAX_BODY_BYTES} bytes")
        return message

    return limited
