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
import json
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import _anthropic as anthropic
from . import _openai as openai
from . import _responses as responses
from ._engines import EngineRejected, EngineUnavailable, ExpansionMismatch
from ._guard import MAX_BODY_BYTES, Guard, error_response
from ._protocol import Asked, ProtocolError
from ._service import Session, Tito, TooManySessions
from ._turn import ChatTurn
from ._workers import Forward, Workers

__all__ = ["create_app"]


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "invalid request: " + "; ".join(parts)


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

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(request, 400, _validation_message(error))

    @app.exception_handler(ProtocolError)
    async def refused(request: Request, error: ProtocolError) -> JSONResponse:
        return error_response(request, error.status, error.message, error.kind, error.param)

    @app.exception_handler(TooManySessions)
    async def too_many(request: Request, error: TooManySessions) -> JSONResponse:
        return error_response(request, 429, str(error), "rate_limit_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 413: "request_too_large"}.get(error.status_code, "invalid_request_error")
        return error_response(request, error.status_code, str(error.detail), kind)

    @app.exception_handler(EngineRejected)
    async def rejected(request: Request, error: EngineRejected) -> JSONResponse:
        return error_response(request, 400, str(error))

    @app.exception_handler(ExpansionMismatch)
    async def mismatch(request: Request, error: ExpansionMismatch) -> JSONResponse:
        return error_response(request, 502, str(error), "image_expansion_mismatch")

    @app.exception_handler(EngineUnavailable)
    async def unavailable(request: Request, error: EngineUnavailable) -> JSONResponse:
        return error_response(request, 503, f"{error}; this session cannot continue", "engine_unavailable")

    def session_of(session_id: str) -> Session:
        if session_id not in tito.sessions:
            if session_id in tito.ended:
                why = f"session {session_id!r} {tito.ended[session_id]} and cannot continue"
                raise ProtocolError(404, f"{why}: create a new one with POST /sessions", "not_found")
            raise ProtocolError(
                404, f"no session {session_id!r}: create one with POST /sessions", "not_found"
            )
        session = tito.sessions[session_id]
        session.last_used = time.monotonic()
        return session

    def check_model(model: str) -> None:
        if model != tito.model_name:
            why = f"model {model!r} is not served here; use {tito.model_name!r}"
            raise ProtocolError(404, why, "not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        if await tito.ready():
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
        body = msgspec.json.encode(session_of(session_id).capture.trajectory())
        return Response(body, media_type="application/json")

    @app.delete("/sessions/{session_id}")
    async def end_session(session_id: str) -> Response:
        session = session_of(session_id)
        async with session.lock:
            trajectory = tito.end_session(session_id)
        return Response(msgspec.json.encode(trajectory), media_type="application/json")

    @app.get("/s/{session_id}/v1/models")
    async def models(session_id: str) -> dict:
        session_of(session_id)
        return {"object": "list", "data": [{"id": tito.model_name, "object": "model", "owned_by": "tito"}]}

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request):
        body = await _parsed(request, openai.ChatRequest)
        session = session_of(session_id)
        check_model(body.model)
        messages, tools = openai.to_messages(body)
        turn = ChatTurn(
            tito,
            session,
            messages,
            tools,
            stops=body.stop,
            parse_tools=body.parse_tools(),
            id_prefix="call_",
            route="chat.completions",
            retry=_sdk_retry(request),
        )
        asked = body.asked(tools, tito.vocab_size)
        request_id = "chatcmpl-" + secrets.token_hex(12)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _openai_events(turn, request_id, tito, usage)
            return await _stream(session, turn, asked, events, openai.error_event)
        parsed = await _whole(request, session, turn, asked, openai.reply_message)
        return openai.chat_completion(
            request_id, tito.model_name, parsed, turn.generation.finish_reason, turn.counts
        )

    @app.post("/s/{session_id}/v1/messages")
    async def messages(session_id: str, request: Request):
        body = await _parsed(request, anthropic.MessagesRequest)
        session = session_of(session_id)
        check_model(body.model)
        messages, tools = anthropic.to_messages(body)
        turn = ChatTurn(
            tito,
            session,
            messages,
            tools,
            stops=body.stop_sequences,
            parse_tools=body.parse_tools(),
            id_prefix="toolu_",
            route="messages",
            retry=_sdk_retry(request),
        )
        asked = body.asked(tools, tito.vocab_size)
        if request.query_params:  # `?beta=true` from Claude Code: changes nothing here
            asked.fields["query"] = dict(request.query_params)
        if body.stream:
            events = _anthropic_events(turn, tito)
            return await _stream(session, turn, asked, events, anthropic.error_event)
        parsed = await _whole(request, session, turn, asked, anthropic.reply_message)
        reason = anthropic.stop_reason(turn.generation.finish_reason, turn.generation.stop_reason, parsed)
        return anthropic.message_reply(tito.model_name, parsed, reason, turn.counts)

    @app.post("/s/{session_id}/v1/responses")
    async def create_response(session_id: str, request: Request):
        body = await _parsed(request, responses.ResponsesRequest)
        session = session_of(session_id)
        check_model(body.model)
        tools = body.chat_tools()
        messages, conversation = responses.to_messages(body, session.responses.get(body.previous_response_id))
        turn = ChatTurn(
            tito,
            session,
            messages,
            tools,
            stops=None,
            parse_tools=body.parse_tools(),
            id_prefix="call_",
            route="responses",
            retry=_sdk_retry(request),
        )
        asked = body.asked(tools)
        response_id = "resp_" + secrets.token_hex(12)

        def remember(parsed) -> None:  # what previous_response_id will continue from
            session.responses.add(response_id, [*conversation, responses.reply_message(parsed)])

        if body.stream:

            def done(parsed) -> None:
                turn.commit(responses.reply_message(parsed))
                remember(parsed)

            events = responses.stream_events(turn, body, response_id, tito.model_name, done)
            return await _stream(session, turn, asked, events, responses.error_event)
        parsed = await _whole(request, session, turn, asked, responses.reply_message)
        if turn.committed:
            remember(parsed)
        items = responses.output_items(parsed, "msg_" + secrets.token_hex(12))
        finish = turn.generation.finish_reason
        return responses.encode(
            responses.response_body(body, response_id, tito.model_name, items, finish, turn.counts)
        )

    return app


def _sdk_retry(request: Request) -> bool:
    """Whether the request is an SDK's retry of an earlier attempt: the stock openai and anthropic SDKs
    number each attempt in `x-stainless-retry-count`, 0 on the first (their `_base_client.py`)."""
    count = request.headers.get("x-stainless-retry-count", "0")
    return count.isdigit() and int(count) > 0


async def _parsed(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, parsed and validated by pydantic in one pass (a FastAPI body parameter
    decodes the JSON with `json`, then validates the objects: twice the CPU)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None


async def _whole(request: Request, session: Session, turn: ChatTurn, asked: Asked, reply_message) -> object:
    """A turn answered in one body. It is committed only if the client is still there to receive it."""
    async with session.lock:
        await turn.start(asked, stream=False)
        parsed = await turn.run()
        if not _disconnected(request.receive):
            turn.commit(reply_message(parsed))
    return parsed


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


async def _stream(
    session: Session, turn: ChatTurn, asked: Asked, events: AsyncIterator[str], error_event
) -> StreamingResponse:
    """Hold the session's lock for the whole stream; errors before the first token are plain 4xx/503.

    `events` commits the turn after its last event was sent: a client that leaves mid-stream closes it
    first, and the turn leaves no trace. An engine that fails mid-stream ends the stream with an error
    event in the protocol's format (the turn is not committed).
    """
    await session.lock.acquire()
    try:
        await turn.start(asked, stream=True)
    except BaseException:
        session.lock.release()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (EngineUnavailable, ExpansionMismatch) as error:
            yield error_event(f"{error}; the turn was not captured: retry it")
        finally:
            session.lock.release()

    return StreamingResponse(body(), media_type="text/event-stream")


async def _openai_events(
    turn: ChatTurn, request_id: str, tito: Tito, include_usage: bool
) -> AsyncIterator[str]:
    model = tito.model_name
    yield openai.chat_chunk(request_id, model, {"role": "assistant", "content": ""})
    async for delta in turn.deltas():
        yield openai.chat_chunk(request_id, model, {"content": delta})
    for delta in openai.stream_tool_deltas(turn.parsed):
        yield openai.chat_chunk(request_id, model, delta)
    yield openai.chat_chunk(
        request_id, model, {}, openai.finish_reason(turn.generation.finish_reason, turn.parsed)
    )
    if include_usage:
        yield openai.chat_chunk(request_id, model, None, usage=openai.usage(*turn.counts))
    yield "data: [DONE]\n\n"
    turn.commit(openai.reply_message(turn.parsed))


async def _anthropic_events(turn: ChatTurn, tito: Tito) -> AsyncIterator[str]:
    num_prompt = turn.counts[0]
    message = anthropic.message_reply(tito.model_name, turn.parsed, ("end_turn", None), (num_prompt, 0))
    yield anthropic.sse("message_start", {"message": {**message, "content": [], "stop_reason": None}})
    index = 0  # the text block, if any, is block 0; tool_use blocks follow
    async for delta in turn.deltas():
        if index == 0:
            yield anthropic.sse(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            )
            index = 1
        yield anthropic.sse(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}}
        )
    if index == 1:
        yield anthropic.sse("content_block_stop", {"index": 0})
    for block in anthropic.content_blocks(turn.parsed):
        if block["type"] != "tool_use":
            continue
        start = {**block, "input": {}}
        yield anthropic.sse("content_block_start", {"index": index, "content_block": start})
        partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield anthropic.sse("content_block_delta", {"index": index, "delta": partial})
        yield anthropic.sse("content_block_stop", {"index": index})
        index += 1
    reason, sequence = anthropic.stop_reason(
        turn.generation.finish_reason, turn.generation.stop_reason, turn.parsed
    )
    yield anthropic.sse(
        "message_delta",
        {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": turn.counts[1]},
        },
    )
    yield anthropic.sse("message_stop", {})
    turn.commit(anthropic.reply_message(turn.parsed))
