"""OpenAI chat completions: the route, its request schema and translation to messages, replies, SSE chunks.

Supported: system/developer, user (text and `image_url` parts), assistant (with tool_calls) and tool
messages; `tools` and `tool_choice`; `temperature`, `top_p`, `top_k`, `min_p`, the penalties,
`logit_bias`, `response_format` (JSON object or schema, through vLLM's structured outputs),
`max_tokens` / `max_completion_tokens`, `stop`, `seed`, `reasoning_effort` (the chat template's thinking
switch); `stream` with `stream_options.include_usage`. Refused with a 400: `n` other than 1, a role
order the template cannot render (a tool message without a tool call before it, an assistant turn
last), and the fields `_fields.REFUSED` names. Other fields are recorded with the turn (`_fields`).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator, model_validator

from ._chat import ParsedReply, parse_arguments, tool_call
from ._fields import extra_fields
from ._images import part_url
from ._protocol import Asked, ChatBody, ToolFunction, check_role_order, logit_bias, structured_outputs
from ._routes import stream, whole
from ._service import Session, Tito
from ._turn import ChatTurn


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = str | list[dict[str, Any]] | None  # a message's text, or its parts


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_and_image_parts(cls, content: Content) -> Content:
        for part in content if isinstance(content, list) else []:
            kind = part.get("type")
            if kind == "image_url":
                part_url(part)  # raises, naming the expected shape
            elif kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {kind!r}: tito reads text and image_url parts")
        return content


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(ChatBody):
    route, id_prefix = "chat.completions", "call_"
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported: a session is one trajectory; open more sessions")
        return n

    @field_validator("tool_choice")
    @classmethod
    def _named_function(cls, choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(choice, dict) and not isinstance(choice.get("function"), dict):
            raise ValueError('a tool_choice object is {"type": "function", "function": {"name": ...}}')
        return choice

    @model_validator(mode="after")
    def _roles(self) -> ChatRequest:
        check_role_order([m.role for m in self.messages], [bool(m.tool_calls) for m in self.messages])
        return self

    def asked(self, tools: list[dict] | None, vocab_size: int) -> Asked:
        """Sampling, constraints, recorded fields and the thinking switch this request asks for."""
        fields, notes = extra_fields(self.route, self.model_extra)
        choice = self.tool_choice
        forced_by = choice if choice == "required" or isinstance(choice, dict) else None
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        structured, constraints = structured_outputs(
            tools, forced_by, name, self.response_format, "response_format"
        )
        bias = logit_bias(self.logit_bias, vocab_size)
        if bias:
            constraints.append("logit_bias")
        sampling = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": bias,
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "seed": self.seed,
            "structured_outputs": structured,
        }
        effort = self.reasoning_effort
        thinking = None if effort is None else effort not in ("none", "minimal")
        return Asked(sampling, constraints, fields, notes, thinking, f"reasoning_effort {effort!r}")


async def chat_completions(tito: Tito, session: Session, body: ChatRequest, request: Request) -> Response:
    """`POST /s/{id}/v1/chat/completions`: one turn, answered in one body or streamed as chunks."""
    messages, tools = to_messages(body)
    turn = ChatTurn(tito, session, request, body, messages, tools, body.asked(tools, tito.vocab_size))
    request_id = "chatcmpl-" + secrets.token_hex(12)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = stream_events(turn, request_id, tito.model_name, include_usage)
        return await stream(turn, events, error_event)
    await whole(turn, reply_message)
    return chat_completion(request_id, tito.model_name, turn)


def to_messages(request: ChatRequest) -> tuple[list[dict], list[dict] | None]:
    """Internal messages and tools for the chat template (tool-call arguments as objects)."""
    messages = []
    for message in request.messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.content}
        for call in message.tool_calls or ():
            arguments = parse_arguments(call.function.arguments)
            entry.setdefault("tool_calls", []).append(tool_call(call.id, call.function.name, arguments))
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    return messages, tools


def reply_message(parsed: ParsedReply) -> dict:
    """The assistant message as the client receives it (and as tito remembers it): no content as None,
    tool-call arguments as JSON text."""
    message = {**parsed.message(), "content": parsed.content or None}
    for call in message.get("tool_calls", ()):
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return message


def usage(num_prompt: int, num_completion: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def chat_body(request_id: str, model: str, kind: str, choices: list[dict], **extra) -> dict:
    """A chat completion (`kind` "chat.completion") or a chunk of a streamed one ("chat.completion.chunk")."""
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def chat_completion(request_id: str, model: str, turn: ChatTurn) -> Response:
    """The reply, encoded here: FastAPI's own encoding of a returned dict walks every value first."""
    message = reply_message(turn.parsed)
    choice = {"index": 0, "message": message, "finish_reason": turn.finish, "logprobs": None}
    body = chat_body(request_id, model, "chat.completion", [choice], usage=usage(*turn.counts))
    return Response(msgspec.json.encode(body), media_type="application/json")


def chat_chunk(request_id: str, model: str, delta: dict | None, finish: str | None = None, **extra) -> str:
    """One SSE event of a streamed completion (choices empty when only usage is sent)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = chat_body(request_id, model, "chat.completion.chunk", choices, **extra)
    return f"data: {msgspec.json.encode(body).decode()}\n\n"


async def stream_events(
    turn: ChatTurn, request_id: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    """The chunks of one streamed turn; the turn is committed after the last was sent."""
    yield chat_chunk(request_id, model, {"role": "assistant", "content": ""})
    async for delta in turn.deltas():
        yield chat_chunk(request_id, model, {"content": delta})
    for index, call in enumerate(reply_message(turn.parsed).get("tool_calls", ())):
        yield chat_chunk(request_id, model, {"tool_calls": [{"index": index, **call}]})
    yield chat_chunk(request_id, model, {}, turn.finish)
    if include_usage:
        yield chat_chunk(request_id, model, None, usage=usage(*turn.counts))
    yield "data: [DONE]\n\n"
    turn.commit(reply_message(turn.parsed))


def error_event(message: str) -> str:
    """A stream's error, as the OpenAI SDK reads it (it raises `APIError`)."""
    body = {"error": {"message": message, "type": "engine_unavailable", "param": None, "code": 503}}
    return f"data: {msgspec.json.encode(body).decode()}\n\n"
