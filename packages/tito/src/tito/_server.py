"""The HTTP face of tito: sessions, OpenAI chat completions and responses, Anthropic messages, trajectories.

A client mistake gets a 4xx in the calling protocol's error format (Anthropic's under `/v1/messages`,
OpenAI's elsewhere); an engine that does not answer gets a 503 for that request only. Nothing a client
sends can end another session or lose its capture. With an API key every route but `/health` needs it
(`Authorization: Bearer KEY` or `x-api-key: KEY`); without one, a session id (128-bit random) is the
capability to use that session.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import _anthropic as anthropic
from . import _openai as openai
from . import _responses as responses
from ._engines import EngineNonFinite, EngineRejected, EngineUnavailable, ExpansionMismatch
from ._guard import MAX_BODY_BYTES, Guard, error_response
from ._protocol import ChatBody, ProtocolError
from ._routes import Handler, chat_route, session_of
from ._service import Tito, TooManySessions
from ._workers import Forward, Workers

# The chat routes under `/s/{session_id}/v1/`: each protocol's body schema and handler (`_routes`).
CHAT_ROUTES: dict[str, tuple[type[ChatBody], Handler]] = {
    "chat/completions": (openai.ChatRequest, openai.chat_completions),
    "messages": (anthropic.MessagesRequest, anthropic.messages),
    "responses": (responses.ResponsesRequest, responses.create_response),
}


def create_app(tito: Tito, *, api_key: str | None = None, workers: Workers | None = None) -> FastAPI:
    """The FastAPI app serving `tito`'s sessions; `workers`: this app is one of `tito serve --workers`."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        expiring = asyncio.create_task(tito.expire_idle_forever()) if tito.idle_timeout else None
        yield
        if expiring is not None:
            expiring.cancel()
        await tito.aclose()  # engine connections live on the server's event loop: close them there

    app = FastAPI(title="tito", summary="Token-exact chat capture over vLLM", lifespan=lifespan)

    app.add_middleware(Guard, api_key=api_key)
    if workers is not None:  # outermost: the owner of a session checks its requests
        app.add_middleware(Forward, workers=workers, error=error_response, max_body=MAX_BODY_BYTES)
    _answer_errors(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Ok while at least one engine answers."""
        for engine in tito.router.engines:
            if await engine.healthy():
                return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "no engine is answering"}, status_code=503)

    @app.post("/sessions")
    async def create_session(request: Request) -> JSONResponse:
        session = tito.new_session()
        base, headers = request.base_url, {}
        if workers is not None:  # the session's URLs name this worker's own port (`_workers`)
            base, headers = base.replace(port=workers.ports[workers.index]), {"connection": "close"}
        root = str(base).rstrip("/")
        urls = {"base_url": f"{root}/s/{session.id}/v1", "session_url": f"{root}/s/{session.id}"}
        return JSONResponse({"id": session.id, **urls}, headers=headers)

    @app.get("/sessions/{session_id}/trajectory")
    async def trajectory(session_id: str) -> Response:
        body = msgspec.json.encode(session_of(tito, session_id).capture.trajectory())
        return Response(body, media_type="application/json")

    @app.delete("/sessions/{session_id}")
    async def end_session(session_id: str) -> Response:
        async with session_of(tito, session_id).lock:
            session_of(tito, session_id)  # another request may have ended it while this one waited
            trajectory = tito.end_session(session_id)
        return Response(msgspec.json.encode(trajectory), media_type="application/json")

    @app.get("/s/{session_id}/v1/models")
    async def models(session_id: str) -> dict:
        session_of(tito, session_id)
        return {"object": "list", "data": [{"id": tito.model_name, "object": "model", "owned_by": "tito"}]}

    for path, (model, handle) in CHAT_ROUTES.items():
        app.post(f"/s/{{session_id}}/v1/{path}", name=handle.__name__)(chat_route(tito, model, handle))

    return app


def _answer_errors(app: FastAPI) -> None:
    """How each error a route raises is answered: in the calling protocol's format (`error_response`)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        parts = []
        for item in error.errors():
            where = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
            parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
        return error_response(request, 400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(ProtocolError)
    async def refused(request: Request, error: ProtocolError) -> JSONResponse:
        return error_response(request, error.status, error.message, error.kind, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(request, error.status_code, str(error.detail))

    def answer(status: int, kind: str, then: str = ""):
        """The handler of an error answered with its own message (and `then`)."""

        async def handler(request: Request, error: Exception) -> JSONResponse:
            return error_response(request, status, f"{error}{then}", kind)

        return handler

    app.add_exception_handler(TooManySessions, answer(429, "rate_limit_error"))
    app.add_exception_handler(EngineRejected, answer(400, "invalid_request_error"))
    app.add_exception_handler(ExpansionMismatch, answer(502, "image_expansion_mismatch"))
    app.add_exception_handler(EngineNonFinite, answer(502, "engine_nonfinite_logprob"))
    unavailable = answer(503, "engine_unavailable", "; this session cannot continue")
    app.add_exception_handler(EngineUnavailable, unavailable)
