"""The Responses API through the real openai SDK's `client.responses.create`, over a fake engine (see
fake_engine.py: it scripts a well-formed tool call, which a random tiny model does not write)."""

from __future__ import annotations

import json

import openai
import pytest
from test_tito_app import CALL, encode, new_session, openai_client, trajectory

pytestmark = pytest.mark.anyio
TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    }
]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_string_input_with_instructions(client, fake_engine, tokenizer):
    session = await new_session(client)
    sdk = openai_client(client, session)
    fake_engine.script = [encode(tokenizer, "owl") + [tokenizer.eos_token_id]]
    reply = await sdk.responses.create(
        model="tiny", instructions="copy words", input="copy the word: owl", max_output_tokens=8
    )
    assert reply.status == "completed" and reply.output_text == "owl"
    prompt = tokenizer.decode(fake_engine.prompts[0])
    assert prompt.index("copy words") < prompt.index("copy the word: owl")
    assert reply.usage.input_tokens == len(fake_engine.prompts[0]) and reply.usage.output_tokens == 2
    assert fake_engine.requests[0]["sampling_params"]["max_tokens"] == 8
    captured = await trajectory(client, session)
    assert [turn.route for turn in captured.turns] == ["responses"]


async def test_a_cut_reply_is_incomplete(client, fake_engine, tokenizer):
    session = await new_session(client)
    fake_engine.script = [encode(tokenizer, "a b c d")]
    reply = await openai_client(client, session).responses.create(
        model="tiny", input="hi", max_output_tokens=2
    )
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("continuation", ["previous_response_id", "full_input"])
async def test_function_call_round_trip_is_one_token_exact_segment(
    client, fake_engine, tokenizer, continuation
):
    session = await new_session(client)
    sdk = openai_client(client, session)
    sampled = encode(tokenizer, CALL) + [tokenizer.eos_token_id]
    answer = encode(tokenizer, "5") + [tokenizer.eos_token_id]
    fake_engine.script = [sampled, answer]
    first_input = [{"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]}]
    first = await sdk.responses.create(model="tiny", instructions="use tools", input=first_input, tools=TOOLS)
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "add", {"a": 2, "b": 3})
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    if continuation == "previous_response_id":
        second = await sdk.responses.create(
            model="tiny", instructions="use tools", input=[output], tools=TOOLS, previous_response_id=first.id
        )
    else:
        items = [*first_input, call.model_dump(exclude_none=True), output]
        second = await sdk.responses.create(model="tiny", instructions="use tools", input=items, tools=TOOLS)
    assert second.output_text == "5"
    (segment,) = (await trajectory(client, session)).segments
    start = len(fake_engine.prompts[0])
    assert fake_engine.prompts[1][: start + len(sampled)] == fake_engine.prompts[0] + sampled
    assert segment.token_ids == fake_engine.prompts[1] + answer
    assert segment.loss_mask.count(1) == len(sampled) + len(answer)


async def test_streamed_events_follow_the_responses_sequence(client, fake_engine, tokenizer):
    session = await new_session(client)
    sdk = openai_client(client, session)
    sampled = encode(tokenizer, "ok " + CALL) + [tokenizer.eos_token_id]
    fake_engine.script = [sampled]
    stream = await sdk.responses.create(model="tiny", input="2+3?", tools=TOOLS, stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "ok " and json.loads(arguments) == {"a": 2, "b": 3}
    for kind in ("output_item.added", "content_part.added", "output_text.done", "output_item.done",
                 "function_call_arguments.done"):  # fmt: skip
        assert f"response.{kind}" in kinds
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.usage.output_tokens == len(sampled) and final.usage.input_tokens == len(
        fake_engine.prompts[0]
    )
    (segment,) = (await trajectory(client, session)).segments
    assert segment.token_ids == fake_engine.prompts[0] + sampled


@pytest.mark.parametrize(
    ("body", "named"),
    [
        pytest.param({"tools": [{"type": "web_search"}]}, "tools[0].type", id="hosted-tool"),
        pytest.param({"background": True}, "background", id="background"),
        pytest.param({"previous_response_id": "resp_unknown"}, "previous_response_id", id="unknown-previous"),
        pytest.param(
            {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}]},
            "input[0].type",
            id="reasoning-item",
        ),
        pytest.param({"text": {"format": {"type": "grammar"}}}, "text.format", id="text-format"),
    ],
)
async def test_unsupported_fields_get_a_400_naming_them(client, body, named):
    session = await new_session(client)
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(client, session).responses.create(model="tiny", **{"input": "hi", **body})
    assert named in refused.value.message
    assert (await trajectory(client, session)).turns == []
