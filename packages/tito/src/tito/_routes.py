"""The one shape of tito's chat routes (chat completions, messages, responses), and what they share.

Each protocol module exports its route as a handler, `async def handle(tito, session, body, request)`,
which turns the parsed body into a `ChatTurn` and answers it in one body (`whole`) or as a stream
(`stream`). `chat_route` makes a handler the FastAPI endpoint of `POST /s/{session_id}/v1/...`: the body
parsed and validated, the session looked up, the model name checked, in that order. Errors are raised
as exceptions (`ProtocolError`, the engine's) and answered by the app's handlers (`_server`), in the
calling protocol's format.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from ._engines import EngineNonFinite, EngineUnavailable, ExpansionMismatch
from ._protocol import ChatBody, ProtocolError
from ._service import Session, Tito
from ._turn import ChatTurn

# A route's handler; its body (Any here) is the route's own request model, a `ChatBody`.
Handler = Callable[[Tito, Session, Any, Request], Awaitable[Response | dict]]


def chat_route(tito: Tito, model: type[ChatBody], handle: Handler):
    """The endpoint serving `handle` for `tito`'s sessions, its body parsed as `model`."""

    async def route(session_id: str, request: Request):
        # Parsed and validated by pydantic in one pass (a FastAPI body parameter decodes the JSON with
        # `json`, then validates the objects: twice the CPU).
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError as error:
            raise RequestValidationError(error.errors(include_url=False)) from None
        session = session_of(tito, session_id)
        if body.model != tito.model_name:
            why = f"model {body.model!r} is not served here; use {tito.model_name!r}"
            raise ProtocolError(404, why, "not_found")
        return await handle(tito, session, body, request)

    return route


def session_of(tito: Tito, session_id: str) -> Session:
    """The live session `session_id` names (marked used now), or a 404 saying why there is none."""
    if (session := tito.sessions.get(session_id)) is None:
        if session_id in tito.ended:
            why = f"session {session_id!r} {tito.ended[session_id]} and cannot continue"
            raise ProtocolError(404, f"{why}: create a new one with POST /sessions", "not_found")
        raise ProtocolError(404, f"no session {session_id!r}: create one with POST /sessions", "not_found")
    session.last_used = time.monotonic()
    return session


async def whole(turn: ChatTurn, reply_message) -> None:
    """A turn answered in one body (`turn.parsed`). It is committed only if the client is still there to
    receive it."""
    async with turn.session.lock:
        try:
            await turn.start(stream=False)
            async for _ in turn.deltas():  # `parsed` holds the whole reply once this ends
                pass
            if not _disconnected(turn.request.receive):
                turn.commit(reply_message(turn.parsed))
        finally:
            turn.session.last_used = time.monotonic()  # idle from the end of its last request


def _disconnected(receive) -> bool:
    """Whether the client has left, without waiting: one step of `receive()` (the body was read) answers
    `http.disconnect` at once if it left, else waits and is abandoned. Starlette's `is_disconnected`
    asks the same through an anyio cancel scope, a tenth of a request's CPU here."""
    step = receive()
    try:
        step.send(None)
    except StopIteration as done:
        return done.value.get("type") == "http.disconnect"
    step.close()
    return False


async def stream(turn: ChatTurn, events: AsyncIterator[str], error_event) -> StreamingResponse:
    """Hold the session's lock for the whole stream; errors before the first token are plain 4xx/503.

    `events` commits the turn after its last event was sent: a client that leaves mid-stream closes it
    first, and the turn leaves no trace. An engine that fails mid-stream ends the stream with an error
    event in the protocol's format (the turn is not committed).
    """
    lock = turn.session.lock
    await lock.acquire()
    try:
        await turn.start(stream=True)
    except BaseException:
        lock.release()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (EngineUnavailable, EngineNonFinite, ExpansionMismatch) as error:
            yield error_event(f"{error}; the turn was not captured: retry it")
        finally:
            turn.session.last_used = time.monotonic()  # idle from the end of its last request
            lock.release()

    return StreamingResponse(body(), media_type="text/event-stream")


def sse(kind: str, **data) -> str:
    """One named SSE event, its data an object whose `type` is the name (the Anthropic and Responses form)."""
    return f"event: {kind}\ndata: {msgspec.json.encode({'type': kind, **data}).decode()}\n\n"
