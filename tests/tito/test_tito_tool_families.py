"""Tool calls in each common template family, parsed with vLLM's own parsers (fake engine: it samples the
family's exact tool-call tokens; the tiny model gets each family's marker tokens and a template naming
them, which is what the family is recognised by)."""

from __future__ import annotations

import json

import httpx
import pytest
from test_tito_app import TOOLS, encode, new_session, openai_client, trajectory

from tito import Tito, create_app
from tito._tools import tool_family

pytestmark = pytest.mark.anyio
FAMILIES = {
    "qwen3_coder": (
        [],  # its markers are plain text; <tool_call> is already a token of the tiny model
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    "mistral": (["[TOOL_CALLS]", "[ARGS]"], '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}'),
    "llama3_json": (["<|python_tag|>"], '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}'),
}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.parametrize(
    ("template", "family"),
    [
        pytest.param("<tool_call>{{ tool | tojson }}</tool_call>", "hermes", id="hermes"),
        pytest.param("<tool_call>\n<function={{ name }}>", "qwen3_coder", id="qwen3-coder"),
        pytest.param("[AVAILABLE_TOOLS]...[TOOL_CALLS]", "mistral", id="mistral"),
        pytest.param('<|python_tag|>{"name": ...', "llama3_json", id="llama3-python-tag"),
        pytest.param('<|eot_id|> {"name": name, "parameters": ...}', "llama3_json", id="llama3-json"),
        pytest.param(None, "hermes", id="no-template"),
    ],
)
def test_the_family_is_read_from_the_template(template, family):
    assert tool_family(template) == family


def family_model(tiny_model_dir, tmp_path, family: str):
    from transformers import AutoTokenizer

    from molt.tiny import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    markers, _ = FAMILIES[family]
    if markers:
        tokenizer.add_special_tokens({"additional_special_tokens": markers})
    teaches = {"qwen3_coder": "<function=", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
    tokenizer.chat_template = CHAT_TEMPLATE + "{#- this template teaches " + teaches[family] + " #}"
    target = tmp_path / family
    tokenizer.save_pretrained(target)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_model_dir / name).exists():
            (target / name).write_bytes((tiny_model_dir / name).read_bytes())
    return target


@pytest.fixture(params=sorted(FAMILIES))
def family_client(request, tiny_model_dir, tmp_path, fake_engine):
    family = request.param
    tito = Tito(
        ["http://engine"], family_model(tiny_model_dir, tmp_path, family), served_model_name="tiny",
        engine_transport=httpx.ASGITransport(app=fake_engine.app),
    )  # fmt: skip
    assert tito.tool_calls.family == family
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tito)), base_url="http://tito")
    return family, tito, client


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_tool_call_in_each_family_arrives_structured(family_client, fake_engine, stream):
    family, tito, client = family_client
    session = await new_session(client)
    sampled = encode(tito.tokenizer, FAMILIES[family][1]) + [tito.tokenizer.eos_token_id]
    fake_engine.script = [sampled]
    sdk = openai_client(client, session)
    messages = [{"role": "user", "content": "2+3?"}]
    reply = await sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stream=stream)
    if stream:
        chunks = [chunk async for chunk in reply]
        calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    assert finish == "tool_calls"
    (segment,) = (await trajectory(client, session)).segments
    assert segment.token_ids == fake_engine.prompts[0] + sampled


async def test_a_call_that_does_not_parse_is_counted_in_each_family(family_client, fake_engine):
    family, tito, client = family_client
    session = await new_session(client)
    broken = FAMILIES[family][1][: len(FAMILIES[family][1]) // 2]  # cut off halfway
    fake_engine.script = [encode(tito.tokenizer, broken)]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS}
    reply = await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)
    assert reply.json()["choices"][0]["message"].get("tool_calls") is None
    assert (await trajectory(client, session)).tool_parse_failures == 1


async def test_forced_calls_outside_the_hermes_form_are_refused(family_client):
    family, _, client = family_client
    session = await new_session(client)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "tools": TOOLS,
        "tool_choice": "required",
    }
    reply = await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)
    assert reply.status_code == 400 and family in reply.json()["error"]["message"]
