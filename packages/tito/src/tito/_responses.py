"""The OpenAI Responses API: the route, its request schema and translation to messages, replies, SSE events.

Supported: `input` as a string or items (messages with input_text / output_text / input_image parts,
`function_call`, `function_call_output`), `instructions` (the system message, not carried over to a
later response, as OpenAI does), function `tools` and `tool_choice`, `max_output_tokens`, `temperature`,
`top_p`, `text.format` (JSON through vLLM's structured outputs), `reasoning.effort` (the template's
thinking switch), `previous_response_id` naming one of the session's own recent responses, and
`stream` (response.created, output items, text and function-call argument deltas, response.completed
with usage). Refused with a 400 naming the field: tools other than functions, input items of other
types, and the fields `_fields.REFUSED` names. A turn is rendered and captured like a chat completion.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from ._chat import ParsedReply, message_text, parse_arguments, tool_call
from ._fields import extra_fields
from ._protocol import Asked, ChatBody, ProtocolError, check_json_schema, check_tool_name, structured_outputs
from ._routes import sse, stream, whole
from ._service import Session, Tito
from ._turn import ChatTurn

NUM_RESPONSES_REMEMBERED = 32  # a session's recent responses that `previous_response_id` may name


class ResponsesRequest(ChatBody):
    route, id_prefix = "responses", "call_"
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for index, tool in enumerate(tools or ()):
            if tool.get("type") != "function":
                raise ValueError(
                    f"tools[{index}].type {tool.get('type')!r}: only function tools are supported"
                )
            check_tool_name(str(tool.get("name")))
            check_json_schema(tool.get("parameters"))
        return tools

    def chat_tools(self) -> list[dict] | None:
        """The tools in the chat-completions form the template renders."""
        keys = ("name", "description", "parameters")
        functions = [{k: tool[k] for k in keys if tool.get(k) is not None} for tool in self.tools or ()]
        return [{"type": "function", "function": function} for function in functions] or None

    def asked(self, tools: list[dict] | None) -> Asked:
        """Sampling, constraints, recorded fields and the thinking switch this request asks for."""
        fields, notes = extra_fields(self.route, self.model_extra)
        choice = self.tool_choice
        forced_by = choice if choice == "required" or isinstance(choice, dict) else None
        if tools and isinstance(choice, dict) and choice.get("type") != "function":
            raise ProtocolError(400, f"tool_choice {choice!r}: only function tools", param="tool_choice")
        text = dict(self.text or {})
        name = choice.get("name") if isinstance(choice, dict) else None
        structured, constraints = structured_outputs(
            tools, forced_by, name, text.pop("format", None), "text.format"
        )
        if text:
            fields["text"] = text
        effort = (self.reasoning or {}).get("effort")
        thinking = None if effort is None else effort not in ("none", "minimal")
        if self.reasoning:
            fields["reasoning"] = self.reasoning
        sampling = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_output_tokens,
            "structured_outputs": structured,
        }
        return Asked(sampling, constraints, fields, notes, thinking, f"reasoning.effort {effort!r}")


async def create_response(tito: Tito, session: Session, body: ResponsesRequest, request: Request) -> Response:
    """`POST /s/{id}/v1/responses`: one turn, answered in one body or streamed as events; the session
    remembers its conversation for a later `previous_response_id`."""
    tools = body.chat_tools()
    previous = body.previous_response_id
    if previous is not None and previous not in session.responses:
        raise ProtocolError(
            400,
            f"previous_response_id {previous!r} is not one of this session's last "
            f"{NUM_RESPONSES_REMEMBERED} responses: send the conversation as input instead",
            param="previous_response_id",
        )
    messages, conversation = to_messages(body, session.responses[previous] if previous is not None else [])
    turn = ChatTurn(tito, session, request, body, messages, tools, body.asked(tools))
    response_id = "resp_" + secrets.token_hex(12)

    def remember(parsed: ParsedReply) -> None:  # what previous_response_id will continue from
        session.responses[response_id] = [*conversation, parsed.message()]
        while len(session.responses) > NUM_RESPONSES_REMEMBERED:
            session.responses.popitem(last=False)

    if body.stream:
        events = stream_events(turn, body, response_id, tito.model_name, remember)
        return await stream(turn, events, error_event)
    await whole(turn, ParsedReply.message)
    if turn.committed:
        remember(turn.parsed)
    items = output_items(turn.parsed, "msg_" + secrets.token_hex(12))
    reply = response_body(body, response_id, tito.model_name, items, turn)
    return Response(msgspec.json.encode(reply), media_type="application/json")


def to_messages(request: ResponsesRequest, history: list[dict]) -> tuple[list[dict], list[dict]]:
    """(messages for the template, the conversation to remember): the earlier response's conversation,
    then this input; `instructions` lead the first only."""
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    conversation = list(history)
    for index, item in enumerate(items):
        _add_item(conversation, item, f"input[{index}]")
    _check_order(conversation)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    return system + conversation, conversation


def _add_item(conversation: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ProtocolError(
                400, f"{where}.role {role!r}: user, assistant, system or developer", param=where
            )
        content = _content(item.get("content"), where)
        conversation.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "function_call":
        call = tool_call(item.get("call_id"), item.get("name"), parse_arguments(item.get("arguments", "{}")))
        last = conversation[-1] if conversation else None
        if last is not None and last["role"] == "assistant":  # a copy: `history` stays as it was
            conversation[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
        else:
            conversation.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        text = message_text(_content(item.get("output"), where))
        conversation.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    else:
        raise ProtocolError(
            400,
            f"{where}.type {kind!r}: input items are messages, function_call and function_call_output",
            param=where,
        )


def _content(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise ProtocolError(400, f"{where}.content: a string or a list of parts", param=where)
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text", ""), str):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ProtocolError(
                400,
                f"{where}.content[{index}]: text parts (a string `text`) and input_image parts only",
                param=where,
            )
    return parts if any(part["type"] == "image_url" for part in parts) else message_text(parts)


def _check_order(conversation: list[dict]) -> None:
    for position, message in enumerate(conversation):
        previous = conversation[position - 1] if position else {}
        if message["role"] == "tool" and not (previous.get("role") == "tool" or previous.get("tool_calls")):
            raise ProtocolError(400, "a function_call_output must follow its function_call", param="input")
    if not conversation or conversation[-1]["role"] not in ("user", "tool"):
        raise ProtocolError(
            400, "input must end with a user message or a function_call_output", param="input"
        )


def output_items(parsed: ParsedReply, message_id: str) -> list[dict]:
    text = {"type": "output_text", "text": parsed.content, "annotations": [], "logprobs": []}
    message = [_message_item(message_id, "completed", [text])] if parsed.content else []
    return message + [
        {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": call["name"],
            "arguments": json.dumps(call["arguments"]),
            "status": "completed",
        }
        for call in parsed.tool_calls
    ]


def _message_item(message_id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def response_body(
    request: ResponsesRequest, response_id: str, model: str, output: list[dict], turn: ChatTurn | None
) -> dict:
    """The Response object of `turn` once it has ended (None: still in progress)."""
    status, usage = "in_progress", None
    if turn is not None:
        status = "incomplete" if turn.finish == "length" else "completed"
        num_input, num_output = turn.counts
        usage = {
            "input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output,
        }
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "model": model,
        "output": output,
        "parallel_tool_calls": bool((request.model_extra or {}).get("parallel_tool_calls", True)),
        "previous_response_id": request.previous_response_id,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "text": request.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": (request.model_extra or {}).get("metadata") or {},
        "usage": usage,
    }


async def stream_events(
    turn: ChatTurn, request: ResponsesRequest, response_id: str, model: str, remember
) -> AsyncIterator[str]:
    """The Responses event sequence for one turn; after the last event was sent the turn is committed
    and `remember(parsed)` runs."""
    numbers = itertools.count()

    def event(kind: str, **data) -> str:  # numbered in order
        return sse(kind, sequence_number=next(numbers), **data)

    started = response_body(request, response_id, model, [], None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    message_id, text, index = "msg_" + secrets.token_hex(12), "", 0
    at = {"item_id": message_id, "output_index": 0, "content_index": 0}  # the text, in the message item
    async for delta in turn.deltas():
        if not text:
            item = _message_item(message_id, "in_progress", [])
            yield event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", **at, part=part)
        text += delta
        yield event("response.output_text.delta", **at, delta=delta, logprobs=[])
    items = output_items(turn.parsed, message_id)
    if text:
        (part,) = items[0]["content"]
        yield event("response.output_text.done", **at, text=part["text"], logprobs=[])
        yield event("response.content_part.done", **at, part=part)
        yield event("response.output_item.done", output_index=0, item=items[0])
        index = 1
    for position, item in enumerate(items[index:], start=index):
        start = {**item, "arguments": "", "status": "in_progress"}
        yield event("response.output_item.added", output_index=position, item=start)
        at_call = {"item_id": item["id"], "output_index": position}
        yield event("response.function_call_arguments.delta", **at_call, delta=item["arguments"])
        done = {"name": item["name"], "arguments": item["arguments"]}
        yield event("response.function_call_arguments.done", **at_call, **done)
        yield event("response.output_item.done", output_index=position, item=item)
    body = response_body(request, response_id, model, items, turn)
    yield event(f"response.{body['status']}", response=body)  # response.completed or response.incomplete
    turn.commit(turn.parsed.message())
    remember(turn.parsed)


def error_event(message: str) -> str:
    """A stream's error, as the OpenAI SDK reads a Responses stream's `error` event."""
    return sse("error", code="engine_unavailable", message=message, param=None, sequence_number=0)
