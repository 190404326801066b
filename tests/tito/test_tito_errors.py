"""Bad input gets a 4xx in the caller's protocol, and the server keeps serving (fake engine)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

USER = [{"role": "user", "content": "hi"}]
OPENAI_CASES = [
    pytest.param(b"{not json", 400, id="malformed-json"),
    pytest.param({"model": "other", "messages": USER}, 404, id="unknown-model"),
    pytest.param({"model": "tiny", "messages": []}, 400, id="no-messages"),
    pytest.param({"model": "tiny", "messages": [{"role": "tool", "content": "5"}]}, 400, id="tool-first"),
    pytest.param(
        {"model": "tiny", "messages": [*USER, {"role": "system", "content": "x"}, *USER]},
        400,
        id="system-late",
    ),
    pytest.param(
        {"model": "tiny", "messages": [*USER, {"role": "assistant", "content": "x"}]},
        400,
        id="assistant-last",
    ),
    pytest.param({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, id="unknown-role"),
    pytest.param({"model": "tiny", "messages": USER, "n": 2}, 400, id="n-2"),
    pytest.param(
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
                }
            ],
        },
        400,
        id="image-on-text-model",
    ),
    pytest.param({"model": "tiny", "messages": USER, "temperature": -1}, 400, id="bad-temperature"),
    pytest.param(
        {"model": "tiny", "messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        400,
        id="bad-tool-name",
    ),
    pytest.param(
        {
            "model": "tiny",
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
        },
        400,
        id="bad-tool-schema",
    ),
    pytest.param(
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]},
        400,
        id="longer-than-context",
    ),
    pytest.param(
        {"model": "tiny", "messages": USER, "logit_bias": {"\u00b2": 1}}, 400, id="logit-bias-not-an-id"
    ),
    pytest.param(
        {
            "model": "tiny",
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": "f"},
        },
        400,
        id="tool-choice-function-not-an-object",
    ),
    pytest.param(
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * (17 << 20)}]},
        413,
        id="oversized-body",
    ),
]
ANTHROPIC_CASES = [
    pytest.param(b"[1,", 400, id="malformed-json"),
    pytest.param({"model": "other", "max_tokens": 4, "messages": USER}, 404, id="unknown-model"),
    pytest.param({"model": "tiny", "messages": USER}, 400, id="no-max-tokens"),
    pytest.param(
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "assistant", "content": "x"}]},
        400,
        id="assistant-first",
    ),
    pytest.param({"model": "tiny", "max_tokens": 4, "messages": [*USER, *USER]}, 400, id="not-alternating"),
    pytest.param(
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": USER,
            "tools": [{"name": "f", "input_schema": {"type": "string"}}],
        },
        400,
        id="bad-tool-schema",
    ),
    pytest.param(
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        },
        400,
        id="image-on-text-model",
    ),
    *(
        pytest.param({"model": "tiny", "max_tokens": 4, "messages": messages}, 400, id=name)
        for name, messages in [
            ("text-not-a-string", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            (
                "tool-result-without-id",
                [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}],
            ),
            (
                "tool-result-content-not-text",
                [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [5]}]}],
            ),
            (
                "tool-use-without-name",
                [
                    *USER,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]},
                    *USER,
                ],
            ),
        ]
    ),
    pytest.param(
        {"model": "tiny", "max_tokens": 4, "messages": USER, "system": [{"type": "text", "text": 5}]},
        400,
        id="system-text-not-a-string",
    ),
    pytest.param(
        {"model": "tiny", "max_tokens": 4, "messages": USER, "output_config": {"format": "json"}},
        400,
        id="format-not-an-object",
    ),
]
RESPONSES_CASES = [
    pytest.param({"model": "tiny", "input": [{"role": "user", "content": 5}]}, 400, id="content-not-text"),
    pytest.param(
        {"model": "tiny", "input": [{"role": "user", "content": [5]}]}, 400, id="part-not-an-object"
    ),
    pytest.param(
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        400,
        id="text-not-a-string",
    ),
    pytest.param(
        {
            "model": "tiny",
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": 5},
            ],
        },
        400,
        id="output-not-text",
    ),
    pytest.param(
        {"model": "tiny", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 5}]},
        400,
        id="tool-schema-not-an-object",
    ),
    pytest.param(
        {"model": "tiny", "input": "hi", "text": {"format": "json"}}, 400, id="format-not-an-object"
    ),
]


def post(client, path, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return asyncio.run(client.post(path, content=content, headers=headers))


def new_session(client) -> str:
    return asyncio.run(client.post("/sessions")).json()["id"]


def assert_openai_error(reply: httpx.Response, status: int) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"]


def assert_anthropic_error(reply: httpx.Response, status: int) -> None:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]


@pytest.mark.parametrize(("body", "status"), OPENAI_CASES)
def test_openai_bad_input(client, body, status):
    session = new_session(client)
    assert_openai_error(post(client, f"/s/{session}/v1/chat/completions", body), status)
    good = post(client, f"/s/{session}/v1/chat/completions", {"model": "tiny", "messages": USER})
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(("body", "status"), ANTHROPIC_CASES)
def test_anthropic_bad_input(client, body, status):
    session = new_session(client)
    assert_anthropic_error(post(client, f"/s/{session}/v1/messages", body), status)
    good = post(client, f"/s/{session}/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": USER})
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(("body", "status"), RESPONSES_CASES)
def test_responses_bad_input(client, body, status):
    session = new_session(client)
    assert_openai_error(post(client, f"/s/{session}/v1/responses", body), status)
    good = post(client, f"/s/{session}/v1/responses", {"model": "tiny", "input": "hi"})
    assert good.status_code == 200, good.text


def test_unknown_session_in_each_protocol(client):
    assert_openai_error(post(client, "/s/0000/v1/chat/completions", {"model": "tiny", "messages": USER}), 404)
    assert_anthropic_error(
        post(client, "/s/0000/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": USER}), 404
    )
    assert asyncio.run(client.get("/sessions/0000/trajectory")).status_code == 404
    assert asyncio.run(client.delete("/sessions/0000")).status_code == 404


def test_a_bad_request_does_not_touch_the_session_capture(client):
    session = new_session(client)
    post(client, f"/s/{session}/v1/chat/completions", {"model": "tiny", "messages": USER})
    before = asyncio.run(client.get(f"/sessions/{session}/trajectory")).json()
    for param in OPENAI_CASES[:-1]:
        post(client, f"/s/{session}/v1/chat/completions", param.values[0])
    assert asyncio.run(client.get(f"/sessions/{session}/trajectory")).json() == before


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]), "content": json_values}
)
near_valid = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other"]), "messages": st.lists(message, max_size=4)},
    optional={
        "max_tokens": json_values,
        "tools": json_values,
        "stop": json_values,
        "stream": st.booleans(),
        "temperature": json_values,
        "n": st.integers(0, 3),
        "system": json_values,
    },
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(json_values, near_valid), anthropic=st.booleans())
def test_fuzzed_requests_never_get_a_server_error(client, body, anthropic):
    session = new_session(client)
    path = f"/s/{session}/v1/messages" if anthropic else f"/s/{session}/v1/chat/completions"
    reply = post(client, path, body)
    assert reply.status_code < 500, reply.text
    if reply.status_code >= 400:
        (assert_anthropic_error if anthropic else assert_openai_error)(reply, reply.status_code)
