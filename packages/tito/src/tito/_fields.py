"""What tito does with each request field that is not a plain message, per protocol.

A field that changes what is sampled is honoured (the protocol's schema maps it to vLLM's sampling
parameters or to the chat template) or refused with a 400 naming it; it is never dropped silently.
A field that does not change the tokens (metadata, cache and context-management hints, storage flags)
is accepted and recorded in the session's trajectory with the turn (`Turn.fields`), and so is a field
tito does not know, with a note saying it was ignored: an agent harness that sends something new keeps
working, and the trajectory says what it sent.

Under a trainer (`Tito(fixed_sampling=...)`), a request that constrains decoding (a forced tool call,
a JSON response format, a logit bias) is refused: the trainer recomputes the model's unconstrained
softmax, so tokens sampled under a constraint would train with the wrong logprobs.
"""

from __future__ import annotations

from typing import Any

from ._protocol import ProtocolError

# Accepted and recorded: they do not change the tokens the engine samples.
NEUTRAL = {
    "chat.completions": {
        "metadata", "user", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
        "prompt_cache_retention", "safety_identifier", "logprobs", "top_logprobs", "prediction",
        "modalities",
    },
    "messages": {"metadata", "service_tier", "context_management", "container", "inference_geo"},
    "responses": {
        "metadata", "user", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
        "prompt_cache_retention", "safety_identifier", "include", "truncation", "top_logprobs",
        "stream_options", "client_metadata",
    },
}  # fmt: skip

# Refused with a 400: each would change the reply in a way tito cannot honour.
REFUSED = {
    "chat.completions": {
        "functions": "legacy function calling: send `tools` instead",
        "function_call": "legacy function calling: send `tool_choice` instead",
        "audio": "audio output is not supported",
        "web_search_options": "hosted web search is not supported: offer a function tool",
    },
    "messages": {"mcp_servers": "remote MCP servers are not supported: offer their tools as client tools"},
    "responses": {
        "background": "background responses are not supported: send the request and wait for it",
        "conversation": "stored conversations are not supported: use previous_response_id or send input",
        "prompt": "stored prompt templates are not supported: send instructions and input",
        "max_tool_calls": "a cap on hosted tool calls is not supported",
    },
}

_CONSTRAINT_WHY = (
    "constrains decoding, and this server trains on what it samples: the trainer computes the model's "
    "unconstrained softmax, so tokens sampled under a constraint would train with wrong logprobs"
)


def extra_fields(route: str, extras: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The request's fields beyond those its schema reads: refused ones raise; the rest are returned
    (to be recorded), with a note for each that tito does not know."""
    recorded, notes = dict(extras or {}), []
    for name in recorded:
        if name in REFUSED[route]:
            raise ProtocolError(400, f"{name}: {REFUSED[route][name]}", param=name)
        if name not in NEUTRAL[route]:
            notes.append(f"{name}: not a field tito knows; ignored")
    return recorded, notes


def check_constraints(fixed_sampling: bool, constraints: list[str]) -> None:
    """Refuse a constrained request under a trainer (module docstring); `constraints` names the fields
    (with their values) that constrain this request's decoding."""
    if fixed_sampling and constraints:
        raise ProtocolError(
            400, f"{constraints[0]} {_CONSTRAINT_WHY}; leave it out", param=constraints[0].split(" ")[0]
        )
