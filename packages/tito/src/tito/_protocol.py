"""What the OpenAI and Anthropic routes share: tool schema checks, role order, errors, streamed text.

`TextStream` turns sampled token ids into text deltas for SSE. Text from the first `<tool_call>` on is
held back until the turn ends, when the whole reply is parsed once; what was streamed is always a
prefix of the final content, so a streamed and a non-streamed reply carry the same message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TOOL_OPEN = "<tool_call>"


@dataclass
class Asked:
    """What one request asks of its turn beyond its messages, whichever protocol it came in."""

    sampling: dict[str, Any]  # vLLM sampling parameters (None: not asked)
    constraints: list[str] = field(default_factory=list)  # fields that constrain decoding, as sent
    fields: dict[str, Any] = field(default_factory=dict)  # fields that do not change the tokens
    notes: list[str] = field(default_factory=list)  # what was done with fields tito mapped or ignored
    thinking: bool | None = None  # the client asked the model to think (True), not to (False), or neither
    thinking_field: str = ""  # the field that asked, as it was sent


class ChatBody(BaseModel):
    """What every chat route's request body has. Fields beyond a route's own are kept (`model_extra`):
    `_fields.extra_fields` refuses or records them."""

    model_config = ConfigDict(extra="allow")
    route: ClassVar[str]  # the route's name in a `Turn` and in `_fields`
    id_prefix: ClassVar[str]  # of the ids of the tool calls in its replies

    model: str
    stream: bool = False
    tools: list[Any] | None = None  # each route's own tool schema
    tool_choice: Any = None

    def parse_tools(self) -> bool:
        """Whether the reply is parsed for tool calls: tools are offered, and tool_choice allows them."""
        return bool(self.tools) and self.tool_choice != "none"


class ProtocolError(Exception):
    """A client mistake, answered in the calling protocol's error format."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None
    ) -> None:
        super().__init__(message)
        # `param`: the request field at fault, where one is.
        self.status, self.message, self.kind, self.param = status, message, kind, param


def check_tool_name(name: str) -> str:
    if not _TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return name


def check_json_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is not None and not (isinstance(schema, dict) and schema.get("type", "object") == "object"):
        raise ValueError(f"a tool's parameter schema must be a JSON schema of type 'object', got {schema!r}")
    return schema


ToolName = Annotated[str, AfterValidator(check_tool_name)]


class ToolFunction(BaseModel):  # fields beyond these are ignored (pydantic's default)
    name: ToolName
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(check_json_schema)] = None


def check_role_order(roles: list[str], has_tool_calls: list[bool]) -> None:
    """Refuse conversations a chat template cannot render faithfully."""
    for position, role in enumerate(roles):
        if role in ("system", "developer") and position != 0:
            raise ValueError(f"messages[{position}]: a {role} message may only come first")
        if role == "tool":
            previous = roles[position - 1] if position else None
            if not (previous == "tool" or (previous == "assistant" and has_tool_calls[position - 1])):
                raise ValueError(
                    f"messages[{position}]: a tool message must follow an assistant message with tool_calls"
                )
    if roles[-1] not in ("user", "tool"):
        raise ValueError(f"the last message must be from the user or a tool, not {roles[-1]!r}")


# JSON scalars only: no leading zero in a number, no control character in a string.
_SCALAR = r'("[^"\\\x00-\x1f]{0,64}"|-?(0|[1-9][0-9]{0,8})(\.[0-9]{1,6})?|true|false|null)'
_FLAT_OBJECT = rf'\{{("[A-Za-z0-9_]{{1,32}}": {_SCALAR}(, "[A-Za-z0-9_]{{1,32}}": {_SCALAR}){{0,15}})?\}}'


def forced_tool_call(tools: list[dict], name: str | None) -> dict:
    """vLLM structured-output constraint for a required tool call (`tool_choice` required or named).

    The reply is constrained to one Hermes-form call of the named tool (or any offered tool); its
    arguments to a flat JSON object of scalars, or `{}` for a tool without properties. That is enough
    for the model to call a tool when told to; nested arguments are left to the unconstrained path.
    """
    functions = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    if not functions:
        raise ProtocolError(400, f"tool_choice names {name!r}, which is not among the tools")
    alternatives = []
    for function in functions:
        arguments = _FLAT_OBJECT if (function.get("parameters") or {}).get("properties") else r"\{\}"
        alternatives.append(rf'"{re.escape(function["name"])}", "arguments": {arguments}')
    return {"regex": r'<tool_call>\{"name": (' + "|".join(alternatives) + r")\}</tool_call>"}


class TextStream:
    """Incremental detokenization of one reply.

    Text that could still turn out to be part of a stop string, or that follows the first tool-call
    marker, is held back: stop strings never reach the client, and tool calls are parsed once at the end.
    """

    def __init__(
        self, tokenizer, *, stops: list[str] | None, hold_tool_calls: bool, hold_all: bool = False
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer._tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stops = list(stops or [])
        self._markers = self._stops + ([_TOOL_OPEN] if hold_tool_calls else [])
        self._hold_all = hold_all  # a tool-call form without one opening marker: send all at the end
        self.text = ""
        self.sent = 0
        self.stop: str | None = None  # the stop string that ended the reply, once `finish` has run

    def push(self, token_ids: list[int]) -> str:
        """Add sampled tokens; return the text that may be sent now."""
        for token_id in token_ids:
            self.text += self._decoder.step(self._tokenizer, token_id) or ""
        if self._hold_all:
            return ""
        end = min([self._safe_end(marker) for marker in self._markers], default=len(self.text))
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self) -> str:
        """The whole reply text, ending before the first stop string in it (`stop`: that string). vLLM
        ends a reply at the first stop string its text holds and counts the string's tokens as sampled."""
        if found := [(self.text.find(stop), stop) for stop in self._stops if stop in self.text]:
            cut, self.stop = min(found)
            self.text = self.text[:cut]
        return self.text

    def _safe_end(self, marker: str) -> int:
        """Where text stops being safe to send: at the marker, or before a tail that may begin it."""
        found = self.text.find(marker, max(0, self.sent - len(marker)))
        if found >= 0:
            return found
        for size in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-size:]):
                return len(self.text) - size
        return len(self.text)


def structured_outputs(
    tools: list[dict] | None, forced_by: Any, name: str | None, response_format: dict | None, where: str
) -> tuple[dict | None, list[str]]:
    """vLLM structured outputs for a request, and the fields that constrain it (as sent): a tool call
    that `forced_by` (the request's tool choice; None: not forced) forces, of tool `name` (None: any
    offered), or an OpenAI-style response format at `where` in the request (`text`: none)."""
    forced = forced_tool_call(tools, name) if tools and forced_by is not None else None
    response_format = response_format or {}
    if not isinstance(response_format, dict):
        raise ProtocolError(400, f"{where}: an object with a `type`, got {response_format!r}", param=where)
    kind = response_format.get("type", "text")
    if kind == "text":
        return forced, [f"tool_choice {forced_by!r}"] if forced else []
    if kind == "json_object":
        structured: dict[str, Any] = {"json_object": True}
    elif kind == "json_schema":
        spec = response_format.get("json_schema", response_format)  # chat nests it; responses does not
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ProtocolError(400, f"{where}: a json_schema format needs a `schema` object", param=where)
        structured = {"json": schema}
    else:
        raise ProtocolError(
            400, f"{where}: type {kind!r} is not supported (text, json_object, json_schema)", param=where
        )
    if forced:
        raise ProtocolError(400, f"tool_choice and {where} both constrain the reply: send one")
    return structured, [f"{where} {kind!r}"]


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings to -100..100) for vLLM, each id checked against the vocab."""
    out = {}
    for key, value in (bias or {}).items():
        if not (str(key).isdecimal() and int(key) < vocab_size and -100 <= value <= 100):
            raise ProtocolError(
                400,
                f"logit_bias: {key!r}: {value} needs a token id below {vocab_size} and a bias in -100..100",
                param="logit_bias",
            )
        out[int(key)] = float(value)
    return out or None
