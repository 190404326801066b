"""tito's HTTP app through the real openai and anthropic SDKs, over a fake engine (see fake_engine.py)."""

from __future__ import annotations

import json

import anthropic
import httpx
import msgspec
import openai
import pytest

from tito import Trajectory, create_app

pytestmark = pytest.mark.anyio

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def new_session(client: httpx.AsyncClient) -> dict:
    reply = await client.post("/sessions")
    assert reply.status_code == 200
    return reply.json()


def openai_client(client, session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused", http_client=client)


def anthropic_client(client, session) -> anthropic.AsyncAnthropic:
    """The anthropic SDK brings its own fork of httpx, so it gets its own ASGI transport on the same app."""
    import httpx2

    transport = httpx2.ASGITransport(app=client._transport.app)
    http_client = httpx2.AsyncClient(transport=transport, base_url=str(client.base_url))
    return anthropic.AsyncAnthropic(
        base_url=session["session_url"], api_key="unused", http_client=http_client
    )


async def trajectory(client, session) -> Trajectory:
    reply = await client.get(f"/sessions/{session['id']}/trajectory")
    return msgspec.json.decode(reply.content, type=Trajectory)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_openai_tool_call_round_trip_stays_one_segment(client, fake_engine, tokenizer):
    session = await new_session(client)
    sdk = openai_client(client, session)
    sampled = encode(tokenizer, CALL) + [tokenizer.eos_token_id]
    fake_engine.script = [sampled, encode(tokenizer, "5") + [tokenizer.eos_token_id]]
    messages = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "2+3?"}]
    first = await sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert first.usage.completion_tokens == len(sampled)
    assert first.usage.prompt_tokens == len(fake_engine.prompts[0])

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = await sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "5"
    (segment,) = (await trajectory(client, session)).segments
    assert (
        fake_engine.prompts[1]
        == fake_engine.prompts[0]
        + sampled
        + fake_engine.prompts[1][len(fake_engine.prompts[0]) + len(sampled) :]
    )
    start = len(fake_engine.prompts[0])
    assert segment.token_ids[start : start + len(sampled)] == sampled
    assert segment.loss_mask.count(1) == len(sampled) + 2
    assert set(segment.versions[start : start + len(sampled)]) == {0}


async def test_tool_calls_are_not_parsed_when_tool_choice_is_none(client, fake_engine, tokenizer):
    sdk = openai_client(client, await new_session(client))
    fake_engine.script = [encode(tokenizer, CALL) + [tokenizer.eos_token_id]]
    messages = [{"role": "user", "content": "2+3?"}]
    reply = await sdk.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none"
    )
    assert (reply.choices[0].message.content, reply.choices[0].message.tool_calls) == (CALL, None)


async def test_openai_streaming_tool_call_and_usage(client, fake_engine, tokenizer):
    session = await new_session(client)
    sdk = openai_client(client, session)
    sampled = encode(tokenizer, "ok " + CALL) + [tokenizer.eos_token_id]
    fake_engine.script = [sampled]
    stream = await sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "2+3?"}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert text == "ok "
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"a": 2, "b": 3}]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(sampled)
    assert chunks[-1].usage.prompt_tokens == len(fake_engine.prompts[0])


async def test_anthropic_tool_use_round_trip_streamed_and_not(client, fake_engine, tokenizer):
    session = await new_session(client)
    sdk = anthropic_client(client, session)
    sampled = encode(tokenizer, CALL) + [tokenizer.eos_token_id]
    answer = encode(tokenizer, "five") + [tokenizer.eos_token_id]
    fake_engine.script = [sampled, answer]
    tools = [{"name": "add", "description": "a + b", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "2+3?"}]
    first = await sdk.messages.create(
        model="tiny", max_tokens=64, system="use tools", messages=messages, tools=tools
    )
    assert first.stop_reason == "tool_use"
    (block,) = first.content
    assert (block.type, block.name, block.input) == ("tool_use", "add", {"a": 2, "b": 3})
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "5"}]},
    ]
    async with sdk.messages.stream(
        model="tiny", max_tokens=64, system="use tools", messages=messages, tools=tools
    ) as stream:
        text = "".join([delta async for delta in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "five"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(answer)
    assert len((await trajectory(client, session)).segments) == 1


async def test_an_anthropic_tool_call_before_a_stop_sequence_asks_for_a_tool(client, fake_engine, tokenizer):
    """The reply holds a whole tool call, then a stop sequence: `stop_reason` is "tool_use" (as the openai
    route's finish is "tool_calls"), so an agent looping on it runs the tool."""
    session = await new_session(client)
    sdk = anthropic_client(client, session)
    fake_engine.script = [encode(tokenizer, CALL + " END")]
    tools = [{"name": "add", "description": "a + b", "input_schema": TOOLS[0]["function"]["parameters"]}]
    reply = await sdk.messages.create(
        model="tiny", max_tokens=64, messages=[{"role": "user", "content": "2+3?"}], tools=tools,
        stop_sequences=["END"],
    )  # fmt: skip
    assert (reply.stop_reason, reply.stop_sequence) == ("tool_use", None)
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert (call.name, call.input) == ("add", {"a": 2, "b": 3})


async def test_sampled_ids_that_are_not_the_canonical_tokenization_are_kept(client, fake_engine, tokenizer):
    """The engine spelled "fox" letter by letter; the client sees "fox", the trace keeps the letters."""
    session = await new_session(client)
    sdk = openai_client(client, session)
    letters = tokenizer.convert_tokens_to_ids(["f", "o", "x"])
    assert encode(tokenizer, "fox") != letters
    fake_engine.script = [letters + [tokenizer.eos_token_id]]
    messages = [{"role": "user", "content": "copy the word: fox"}]
    reply = await sdk.chat.completions.create(model="tiny", messages=messages)
    assert reply.choices[0].message.content == "fox"
    messages += [{"role": "assistant", "content": "fox"}, {"role": "user", "content": "again"}]
    await sdk.chat.completions.create(model="tiny", messages=messages)
    (segment,) = (await trajectory(client, session)).segments
    sampled = [t for t, m in zip(segment.token_ids, segment.loss_mask, strict=True) if m]
    assert sampled[:4] == letters + [tokenizer.eos_token_id]


async def test_a_resample_and_a_compaction_each_open_a_segment(client, fake_engine, tokenizer):
    session = await new_session(client)
    sdk = openai_client(client, session)
    messages = [{"role": "user", "content": "copy the word: owl"}]
    await sdk.chat.completions.create(model="tiny", messages=messages)
    await sdk.chat.completions.create(model="tiny", messages=messages)  # a second sample (retry count 0)
    first, second = (await trajectory(client, session)).segments
    reply = [fake_engine.prompts[1][-1], tokenizer.eos_token_id]
    assert first.token_ids == second.token_ids == fake_engine.prompts[1] + reply
    await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "summary: owl"}])
    assert len((await trajectory(client, session)).segments) == 3


async def test_env_form_goes_through_the_same_capture(fake_tito, fake_engine, tokenizer):
    session = fake_tito.new_session()
    fake_engine.script = [[5, 6, tokenizer.eos_token_id]]
    result = await fake_tito.generate(session, [1, 2, 3], max_tokens=8, temperature=1.0)
    assert result.token_ids == [5, 6, tokenizer.eos_token_id]
    assert result.logprobs == [-0.5] * 3 and result.versions == [0] * 3
    assert result.finish_reason == "stop"
    (segment,) = session.capture.trajectory().segments
    assert segment.token_ids == [1, 2, 3, 5, 6, tokenizer.eos_token_id]
    assert segment.loss_mask == [0, 0, 0, 1, 1, 1]


async def test_end_session_returns_and_dumps_the_trajectory(client, fake_tito, tmp_path):
    session = await new_session(client)
    assert len(session["id"]) == 32 and int(session["id"], 16) >= 0  # 128 random bits, hex
    await openai_client(client, session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}]
    )
    ended = await client.delete(f"/sessions/{session['id']}")
    assert ended.status_code == 200
    (line,) = (tmp_path / "dump.jsonl").read_bytes().splitlines()
    assert msgspec.json.decode(line, type=Trajectory) == msgspec.json.decode(ended.content, type=Trajectory)
    assert (await client.get(f"/sessions/{session['id']}/trajectory")).status_code == 404


async def test_an_api_key_guards_every_route_but_health(fake_tito):
    guarded = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(fake_tito, api_key="k")), base_url="http://tito"
    )
    assert (await guarded.get("/health")).status_code == 200
    assert (await guarded.post("/sessions")).status_code == 401
    session = (await guarded.post("/sessions", headers={"Authorization": "Bearer k"})).json()
    assert (await guarded.get(f"/sessions/{session['id']}/trajectory")).status_code == 401
    assert (
        await guarded.delete(f"/sessions/{session['id']}", headers={"x-api-key": "no"})
    ).status_code == 401
    sdk = openai.AsyncOpenAI(base_url=session["base_url"], api_key="k", http_client=guarded)
    reply = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None


async def test_an_engine_refusal_is_the_clients_error_not_a_dead_engine(client, fake_engine, fake_tito):
    """An engine 4xx (a sampling value it rejects, say) is a 400 for that request; the engine stays live."""
    session = await new_session(client)
    original = fake_engine.reply_for

    def refuse(prompt, max_tokens):
        from fastapi import HTTPException

        raise HTTPException(400, "bad sampling value")

    fake_engine.reply_for = refuse
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    refused = await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)
    assert refused.status_code == 400 and "bad sampling value" in refused.json()["error"]["message"]
    fake_engine.reply_for = original
    assert all(engine.alive for engine in fake_tito.router.engines)
    assert (await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)).status_code == 200


async def test_a_reply_without_logprobs_is_refused_naming_the_cause_and_captures_nothing(
    client, fake_engine, fake_tito
):
    """vLLM writes a NaN logprob as null (NaN weights): the request fails with what that means, nothing
    of it enters the trajectory, the engine stays live, and the next reply is captured as usual."""
    session = await new_session(client)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    fake_engine.null_logprob_from = 0
    failed = await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)
    assert failed.status_code == 502
    assert "no logprob for token 0" in failed.json()["error"]["message"]
    assert "NaN or infinite" in failed.json()["error"]["message"]
    assert not (await trajectory(client, session)).segments
    assert all(engine.alive for engine in fake_tito.router.engines)
    fake_engine.null_logprob_from = None
    assert (await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)).status_code == 200
    (segment,) = (await trajectory(client, session)).segments
    assert set(
        logp for logp, trained in zip(segment.logprobs, segment.loss_mask, strict=True) if trained
    ) == {-0.5}


def test_a_compact_chunk_without_a_logprob_is_refused():
    from tito import EngineNonFinite
    from tito._engines import _decode_reply, _generation

    chunk = b'{"choices": [{"token_ids": [5, 9], "token_logprobs": [-0.1, null]}]}'
    with pytest.raises(EngineNonFinite, match=r"token 1 of a reply chunk \(id \[9\]\)"):
        _generation(_decode_reply(chunk))


async def test_health_follows_the_engines(client, fake_engine):
    assert (await client.get("/health")).status_code == 200
    fake_engine.app.router.routes = [r for r in fake_engine.app.router.routes if r.path != "/health"]
    assert (await client.get("/health")).status_code == 503


def test_a_restarted_engine_takes_the_dead_ones_place_once_its_owner_says_it_serves():
    """`Router.replace`: the sessions bound to the dead engine stay bound to it (and fail), and no new session
    goes to the restarted one until it is marked alive (its owner gives it the current weights first)."""
    import httpx

    from tito import EngineUnavailable
    from tito._engines import Router

    answer = httpx.MockTransport(lambda request: httpx.Response(200))
    router = Router(["http://old"], transport=answer, stream_replies=True, compact_stream=True)
    dead = router.assign()
    dead.alive = False
    back = router.replace(dead, "http://new")
    assert router.engines == [back] and back.url == "http://new" and back.num_sessions == 0
    assert back.stream_replies and back.stream_url == "http://new/refit/generate"  # spoken to as the old one
    with pytest.raises(EngineUnavailable, match="no engine is answering"):
        router.assign()
    back.alive = True
    assert router.assign() is back
    router.release(dead)  # a session of the dead engine ends: the new one's count is its own
    assert (dead.num_sessions, back.num_sessions) == (0, 1)
