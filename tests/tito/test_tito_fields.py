"""Every request field is honoured, refused with a 400 naming it, or recorded with the turn (fake engine:
the tests read the sampling parameters the engine was sent)."""

from __future__ import annotations

import json
import shutil

import httpx
import msgspec
import pytest
from test_tito_app import TOOLS, encode, new_session, trajectory

from tito import Tito, Trajectory, create_app

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "copy the word: owl"}]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def chat(client, session, **body):
    return await client.post(
        f"/s/{session['id']}/v1/chat/completions", json={"model": "tiny", "messages": USER, **body}
    )


async def messages(client, session, path_suffix="", **body):
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, **body}
    return await client.post(f"/s/{session['id']}/v1/messages{path_suffix}", json=body)


async def test_sampling_fields_reach_the_engine_and_the_trajectory(client, fake_engine):
    session = await new_session(client)
    schema = {"type": "object", "properties": {"word": {"type": "string"}}}
    reply = await chat(
        client, session, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.1, logit_bias={"7": 2.5}, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    sent = fake_engine.requests[-1]["sampling_params"]
    assert (sent["top_k"], sent["min_p"], sent["seed"]) == (5, 0.1, 3)
    assert (sent["presence_penalty"], sent["frequency_penalty"], sent["repetition_penalty"]) == (
        0.5,
        0.25,
        1.1,
    )
    assert sent["logit_bias"] == {"7": 2.5}
    assert sent["structured_outputs"] == {"json": schema}
    (turn,) = (await trajectory(client, session)).turns
    assert turn.route == "chat.completions"
    assert turn.sampling["top_k"] == 5 and turn.sampling["structured_outputs"] == {"json": schema}
    assert turn.num_sampled == len(fake_engine.prompts[0][-1:]) + 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"logit_bias": {"999999": 1}}, "logit_bias", id="logit-bias-outside-vocab"),
        pytest.param({"response_format": {"type": "grammar"}}, "response_format", id="response-format"),
        pytest.param({"functions": [{"name": "f"}]}, "functions", id="legacy-functions"),
        pytest.param({"web_search_options": {}}, "web_search_options", id="web-search"),
    ],
)
async def test_openai_fields_it_cannot_honour_are_refused_naming_the_field(client, body, param):
    session = await new_session(client)
    reply = await chat(client, session, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert (await trajectory(client, session)).turns == []


async def test_anthropic_refusals_use_anthropics_error_shape(client):
    session = await new_session(client)
    reply = await messages(client, session, mcp_servers=[{"type": "url", "url": "http://x"}])
    assert reply.status_code == 400
    assert reply.json()["type"] == "error" and "mcp_servers" in reply.json()["error"]["message"]
    hosted = [{"type": "web_search_20250305", "name": "web_search", "input_schema": {"type": "object"}}]
    reply = await messages(client, session, tools=hosted)
    assert reply.status_code == 400 and "web_search_20250305" in reply.json()["error"]["message"]


async def test_fields_that_do_not_change_tokens_are_recorded(client, fake_engine):
    session = await new_session(client)
    reply = await chat(
        client, session, metadata={"run": "a"}, parallel_tool_calls=False, store=True, novel_hint=1
    )
    assert reply.status_code == 200, reply.text
    (turn,) = (await trajectory(client, session)).turns
    assert turn.fields == {
        "metadata": {"run": "a"},
        "parallel_tool_calls": False,
        "store": True,
        "novel_hint": 1,
    }
    assert turn.notes == ["novel_hint: not a field tito knows; ignored"]
    assert "metadata" not in fake_engine.requests[-1]["sampling_params"]


async def test_a_claude_code_request_is_accepted_and_what_was_done_recorded(client, fake_engine, tokenizer):
    """What stock Claude Code sends: `?beta=true`, thinking, output_config, context_management, a system
    message among the turns, cache_control marks."""
    session = await new_session(client)
    body = {
        "system": [{"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "system", "content": "reminder: be brief"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "copy the word: owl"},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "u"},
        "stream": True,
    }
    reply = await messages(client, session, "?beta=true", **body)
    assert reply.status_code == 200, reply.text
    assert "message_stop" in reply.text
    prompt = tokenizer.decode(fake_engine.prompts[-1])
    assert prompt.index("hi") < prompt.index("reminder: be brief") < prompt.index("hello")  # in place
    (turn,) = (await trajectory(client, session)).turns
    assert turn.route == "messages"
    assert turn.fields["query"] == {"beta": "true"}
    assert turn.fields["context_management"] == body["context_management"]
    assert turn.fields["output_config"] == {"effort": "high"}
    assert any("no thinking switch" in note for note in turn.notes)  # the tiny template has none


@pytest.fixture
def thinking_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with a template that has Qwen3's `enable_thinking` switch."""
    target = tmp_path / "thinking-model"
    shutil.copytree(tiny_model_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template_path = target / "chat_template.jinja"
    template = template_path.read_text() if template_path.exists() else config["chat_template"]
    switch = "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    template += switch
    if template_path.exists():
        template_path.write_text(template)
    else:
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("route", "body", "think"),
    [
        pytest.param(
            "messages", {"max_tokens": 8, "thinking": {"type": "disabled"}}, False, id="anthropic-off"
        ),
        pytest.param(
            "messages", {"max_tokens": 8, "thinking": {"type": "adaptive"}}, True, id="anthropic-on"
        ),
        pytest.param("chat/completions", {"reasoning_effort": "none"}, False, id="openai-off"),
    ],
)
async def test_thinking_maps_to_the_templates_switch(thinking_model_dir, fake_engine, route, body, think):
    tito = Tito(
        ["http://engine"], thinking_model_dir, served_model_name="tiny",
        engine_transport=httpx.ASGITransport(app=fake_engine.app),
    )  # fmt: skip
    assert tito.renderer.thinking_switch == "enable_thinking"
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tito)), base_url="http://tito")
    session = await new_session(client)
    reply = await client.post(
        f"/s/{session['id']}/v1/{route}", json={"model": "tiny", "messages": USER, **body}
    )
    assert reply.status_code == 200, reply.text
    prompt = tito.tokenizer.decode(fake_engine.prompts[-1])
    assert ("<think>" in prompt) is (not think)
    (turn,) = msgspec.json.decode(
        (await client.get(f"/sessions/{session['id']}/trajectory")).content, type=Trajectory
    ).turns
    assert f"enable_thinking={think}" in " ".join(turn.notes)


@pytest.fixture
def trainer_client(tiny_model_dir, fake_engine):
    """tito as molt's trainer embeds it: fixed sampling."""
    tito = Tito(
        ["http://engine"], tiny_model_dir, served_model_name="tiny",
        fixed_sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 16},
        engine_transport=httpx.ASGITransport(app=fake_engine.app),
    )  # fmt: skip
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tito)), base_url="http://tito")


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        pytest.param("chat", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice", id="required"),
        pytest.param(
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
            id="named-function",
        ),
        pytest.param(
            "chat", {"response_format": {"type": "json_object"}}, "response_format", id="json-object"
        ),
        pytest.param("chat", {"logit_bias": {"5": 3}}, "logit_bias", id="logit-bias"),
        pytest.param(
            "messages",
            {"tools": [{"name": "add", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
            "tool_choice",
            id="anthropic-any",
        ),
    ],
)
async def test_under_a_trainer_constrained_decoding_is_refused_saying_why(trainer_client, route, body, param):
    session = await new_session(trainer_client)
    reply = await (chat if route == "chat" else messages)(trainer_client, session, **body)
    assert reply.status_code == 400, reply.text
    message = reply.text
    assert param in message and "unconstrained softmax" in message


async def test_under_a_trainer_distribution_shaping_is_dropped_and_recorded(trainer_client, fake_engine):
    session = await new_session(trainer_client)
    reply = await chat(trainer_client, session, temperature=0.3, top_k=4, tools=TOOLS, tool_choice="auto")
    assert reply.status_code == 200, reply.text
    sent = fake_engine.requests[-1]["sampling_params"]
    assert sent["temperature"] == 1.0 and "top_k" not in sent
    (turn,) = (await trajectory(trainer_client, session)).turns
    assert turn.asked["temperature"] == 0.3 and turn.asked["top_k"] == 4


async def test_a_tool_call_that_does_not_parse_is_counted(client, fake_engine, tokenizer):
    session = await new_session(client)
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    fake_engine.script = [encode(tokenizer, broken) + [tokenizer.eos_token_id]]
    reply = await chat(client, session, tools=TOOLS)
    assert reply.json()["choices"][0]["message"]["content"] == broken  # kept as the model wrote it
    captured = await trajectory(client, session)
    assert captured.tool_parse_failures == 1 and captured.turns[0].tool_parse_failures == 1


@pytest.mark.parametrize("engine_model", [None, "policy"])
async def test_every_engine_request_names_the_engine_model(tiny_model_dir, fake_engine, engine_model):
    """A trainer of LoRA adapters: each request names the adapter the engines serve (else no model)."""
    tito = Tito(
        ["http://engine"], tiny_model_dir, served_model_name="tiny", engine_model=engine_model,
        engine_transport=httpx.ASGITransport(app=fake_engine.app),
    )  # fmt: skip
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tito)), base_url="http://tito")
    session = await new_session(client)
    for _ in range(2):
        assert (await chat(client, session)).status_code == 200
    assert [request.get("model") for request in fake_engine.requests] == [engine_model] * 2
