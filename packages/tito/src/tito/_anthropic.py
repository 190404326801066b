"""Anthropic messages: the route, its request schema and translation to messages, replies, SSE events.

Supported: `system` (a string or text blocks, and `role: system` messages among the turns), text /
image / tool_use / tool_result blocks, `tools`, `tool_choice`, `max_tokens`, `stop_sequences`,
`temperature`, `top_p`, `top_k`, `thinking` (the chat template's thinking switch), `output_config`
(`format`: structured outputs; other keys recorded), `stream`. Fields `_fields` knows as neutral
(metadata, context_management, ...) and unknown ones are recorded with the turn; cache_control marks
inside blocks are ignored, as they change nothing sampled. An image block (base64
source, or a URL source holding a data URL or a local file) becomes an OpenAI `image_url` part of the
user message, in place. Refused with a 400: images inside a tool_result or an assistant turn (never
dropped silently), a conversation that does not start with a user turn, does not alternate, or ends
with an assistant turn (prefill is not supported).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from ._chat import ParsedReply, is_text, message_text
from ._fields import extra_fields
from ._protocol import Asked, ChatBody, ToolName, check_json_schema, structured_outputs
from ._routes import sse, stream, whole
from ._service import Session, Tito
from ._turn import ChatTurn


class Tool(BaseModel):
    name: ToolName
    description: str | None = None
    input_schema: Annotated[dict[str, Any], AfterValidator(check_json_schema)]
    type: str | None = None  # "custom" or absent; a server tool ("web_search_...") is refused

    @field_validator("type")
    @classmethod
    def _client_tool(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(f"server tool type {kind!r} is not supported: offer a client tool instead")
        return kind


# The fields `to_messages` reads from each block: what a block must hold, and the check.
_BLOCKS = {
    "text": ("a string `text`", lambda block: isinstance(block.get("text"), str)),
    "tool_use": (
        "a string `name` and an `input`",
        lambda block: isinstance(block.get("name"), str) and "input" in block,
    ),
    "tool_result": (
        "a string `tool_use_id`, and `content` as a string or text blocks",
        lambda block: isinstance(block.get("tool_use_id"), str) and is_text(block.get("content")),
    ),
}


class Message(BaseModel):
    role: Literal["user", "assistant", "system"]  # "system": Claude Code puts one among the turns
    content: str | list[dict[str, Any]]

    @model_validator(mode="after")
    def _known_blocks(self) -> Message:
        for block in self.content if isinstance(self.content, list) else []:
            kind = block.get("type")
            if kind == "image":
                image_url_part(block)  # raises, naming the expected shape
                if self.role == "assistant":
                    raise ValueError("an assistant turn cannot carry images")
            elif kind not in _BLOCKS:
                raise ValueError(f"unsupported content block type {kind!r}")
            elif not _BLOCKS[kind][1](block):
                raise ValueError(f"a {kind} block needs {_BLOCKS[kind][0]}")
            elif kind == "tool_result" and any(
                isinstance(inner, dict) and inner.get("type") == "image"
                for inner in block.get("content") or ()
            ):
                raise ValueError(
                    "images inside a tool_result are not supported: send them in a user text turn"
                )
        return self


class MessagesRequest(ChatBody):
    route, id_prefix = "messages", "toolu_"
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    @field_validator("system")
    @classmethod
    def _system_text(cls, system: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if not is_text(system):
            raise ValueError("system is a string or text blocks, each with a string `text`")
        return system

    @model_validator(mode="after")
    def _alternating(self) -> MessagesRequest:
        roles = [m.role for m in self.messages if m.role != "system"]
        if not roles or roles[0] != "user" or roles[-1] != "user":
            raise ValueError("messages must start and end with a user turn")
        for position in range(1, len(roles)):
            if roles[position] == roles[position - 1]:
                raise ValueError(f"messages[{position}]: user and assistant turns must alternate")
        return self

    def asked(self, tools: list[dict] | None) -> Asked:
        """Sampling, constraints, recorded fields and the thinking switch this request asks for."""
        fields, notes = extra_fields(self.route, self.model_extra)
        choice = self.tool_choice or {}
        kind = choice.get("type")
        if "disable_parallel_tool_use" in choice:
            fields["tool_choice.disable_parallel_tool_use"] = choice["disable_parallel_tool_use"]
        config = dict(self.output_config or {})
        forced_by = kind if kind in ("any", "tool") else None
        name = choice.get("name") if kind == "tool" else None
        structured, constraints = structured_outputs(
            tools, forced_by, name, config.pop("format", None), "output_config.format"
        )
        if config:  # effort and other hints: the model has no such control here
            fields["output_config"] = config
            notes.append(f"output_config {sorted(config)}: no equivalent in this model; not applied")
        thinking = None if self.thinking is None else self.thinking.get("type") != "disabled"
        if "budget_tokens" in (self.thinking or {}):
            notes.append("thinking.budget_tokens: not enforced (max_tokens bounds the whole reply)")
        sampling = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "structured_outputs": structured,
        }
        return Asked(sampling, constraints, fields, notes, thinking, f"thinking {self.thinking!r}")

    def parse_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice or {}).get("type") != "none"


async def messages(tito: Tito, session: Session, body: MessagesRequest, request: Request) -> Response | dict:
    """`POST /s/{id}/v1/messages`: one turn, answered in one body or streamed as events."""
    chat_messages, tools = to_messages(body)
    asked = body.asked(tools)
    if request.query_params:  # `?beta=true` from Claude Code: changes nothing here
        asked.fields["query"] = dict(request.query_params)
    turn = ChatTurn(tito, session, request, body, chat_messages, tools, asked)
    if body.stream:
        return await stream(turn, stream_events(turn, tito.model_name), error_event)
    await whole(turn, ParsedReply.message)
    return message_reply(tito.model_name, turn)


def to_messages(request: MessagesRequest) -> tuple[list[dict], list[dict] | None]:
    """Internal (OpenAI-shaped) messages and tools for the chat template."""
    messages: list[dict] = []
    if request.system:
        messages.append({"role": "system", "content": message_text(request.system)})
    for message in request.messages:
        content = message.content
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if message.role == "system":  # rendered where it stands, or merged first (`ChatRenderer`)
            messages.append({"role": "system", "content": message_text(blocks)})
        elif message.role == "assistant":  # in the form tito remembers its own replies in
            calls = [
                {"id": b.get("id"), "name": b["name"], "arguments": b["input"]}
                for b in blocks
                if b["type"] == "tool_use"
            ]
            messages.append(ParsedReply(message_text(blocks), calls).message())
        else:
            results = [b for b in blocks if b["type"] == "tool_result"]
            messages += [
                {"role": "tool", "content": message_text(b.get("content")), "tool_call_id": b["tool_use_id"]}
                for b in results
            ]
            parts = [
                image_url_part(b) if b["type"] == "image" else b
                for b in blocks
                if b["type"] in ("text", "image")
            ]
            if parts or not results:
                has_images = any(part["type"] == "image_url" for part in parts)
                messages.append({"role": "user", "content": parts if has_images else message_text(parts)})
    functions = [
        {"name": t.name, "description": t.description, "parameters": t.input_schema}
        for t in request.tools or ()
    ]
    return messages, [{"type": "function", "function": function} for function in functions] or None


def image_url_part(block: dict) -> dict:
    """An Anthropic image block as the OpenAI `image_url` part tito renders (its URL a data URL or a
    local file path)."""
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise ValueError(
            'an image block needs "source": {"type": "base64", "media_type": ..., "data": ...} '
            'or {"type": "url", "url": "data:... or a file path"}'
        )
    return {"type": "image_url", "image_url": {"url": url}}


def stop_reason(turn: ChatTurn) -> dict:
    """The reply's `stop_reason` and `stop_sequence`: a tool call asks for the tool whatever ended the
    reply after it (as the openai route's finish says "tool_calls")."""
    if turn.generation.stop_reason is not None and turn.finish != "tool_calls":
        return {"stop_reason": "stop_sequence", "stop_sequence": turn.generation.stop_reason}
    reason = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}[turn.finish]
    return {"stop_reason": reason, "stop_sequence": None}


def content_blocks(parsed: ParsedReply) -> list[dict]:
    text = [{"type": "text", "text": parsed.content}] if parsed.content else []
    return text + [
        {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
        for c in parsed.tool_calls
    ]


def message_reply(model: str, turn: ChatTurn) -> dict:
    num_input, num_output = turn.counts
    return {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(turn.parsed),
        **stop_reason(turn),
        "usage": {"input_tokens": num_input, "output_tokens": num_output},
    }


async def stream_events(turn: ChatTurn, model: str) -> AsyncIterator[str]:
    """The events of one streamed turn; the turn is committed after the last was sent."""
    message = {**message_reply(model, turn), "content": [], "stop_reason": None}  # nothing sampled yet
    yield sse("message_start", message=message)
    index = 0  # the text block, if any, is block 0; tool_use blocks follow
    async for delta in turn.deltas():
        if index == 0:
            yield sse("content_block_start", index=0, content_block={"type": "text", "text": ""})
            index = 1
        yield sse("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
    if index == 1:
        yield sse("content_block_stop", index=0)
    for block in [block for block in content_blocks(turn.parsed) if block["type"] == "tool_use"]:
        yield sse("content_block_start", index=index, content_block={**block, "input": {}})
        partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield sse("content_block_delta", index=index, delta=partial)
        yield sse("content_block_stop", index=index)
        index += 1
    yield sse("message_delta", delta=stop_reason(turn), usage={"output_tokens": turn.counts[1]})
    yield sse("message_stop")
    turn.commit(turn.parsed.message())


def error_event(message: str) -> str:
    """A stream's error event, as the Anthropic SDK reads it (it raises `APIStatusError`)."""
    return sse("error", error={"type": "api_error", "message": message})
