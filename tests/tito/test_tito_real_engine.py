"""tito in front of a real vLLM CPU server, driven by the stock openai and anthropic SDKs."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import msgspec
import openai
import pytest

from tito import Tito, Trajectory, create_app

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {"name": "now", "description": "the time", "parameters": {"type": "object"}},
    },
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
    },
]


@pytest.fixture
def closing():
    """SDK clients made in a test, closed after it (their connection pools would outlive it)."""
    clients = []
    yield clients.append
    for client in clients:
        client.close()


def new_session(url: str) -> dict:
    return httpx.post(f"{url}/sessions").json()


def get_trajectory(url: str, session: dict) -> Trajectory:
    return msgspec.json.decode(
        httpx.get(f"{url}/sessions/{session['id']}/trajectory").content, type=Trajectory
    )


def sampled_runs(segment) -> list[list[int]]:
    """The runs of consecutive sampled tokens in a segment: one per assistant turn."""
    runs, current = [], []
    for token, mask in zip(segment.token_ids, segment.loss_mask, strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_openai_sync_multi_turn_with_tools_is_one_token_exact_segment(real_tito, tokenizer, closing):
    _, url = real_tito
    session = new_session(url)
    sdk = openai.OpenAI(base_url=session["base_url"], api_key="unused")
    closing(sdk)
    messages = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "copy the word: fox"}]
    first = sdk.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        max_tokens=120,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and isinstance(json.loads(call.function.arguments), dict)

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=6, seed=2)
    messages += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "again"},
    ]
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    (segment,) = get_trajectory(url, session).segments
    canonical = tokenizer.apply_chat_template(
        messages[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    first_prompt = tokenizer(canonical, add_special_tokens=False)["input_ids"]
    assert segment.token_ids[: len(first_prompt)] == first_prompt
    runs = sampled_runs(segment)
    assert [len(run) for run in runs] == [
        first.usage.completion_tokens,
        second.usage.completion_tokens,
        chunks[-1].usage.completion_tokens,
    ]
    assert tokenizer.decode(runs[0], skip_special_tokens=True).startswith("<tool_call>")
    assert tokenizer.decode(runs[2], skip_special_tokens=True).startswith(streamed)
    assert len(segment.token_ids) == chunks[-1].usage.total_tokens
    sampled = [i for i, mask in enumerate(segment.loss_mask) if mask]
    assert all(segment.logprobs[i] <= 0.0 and segment.versions[i] == 0 for i in sampled)
    assert all(segment.versions[i] == -1 for i, mask in enumerate(segment.loss_mask) if not mask)


def test_anthropic_sync_and_async_streamed_tool_use(real_tito, closing):
    _, url = real_tito
    session = new_session(url)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    sync = anthropic.Anthropic(base_url=session["session_url"], api_key="unused")
    closing(sync)
    messages = [{"role": "user", "content": "what time is it"}]
    first = sync.messages.create(
        model="tiny",
        max_tokens=60,
        messages=messages,
        tools=tools,
        tool_choice={"type": "tool", "name": "now"},
    )
    assert first.stop_reason == "tool_use"
    (block,) = [b for b in first.content if b.type == "tool_use"]
    assert (block.name, block.input) == ("now", {})
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "noon"}]},
    ]

    async def follow_up():
        async with (
            anthropic.AsyncAnthropic(base_url=session["session_url"], api_key="unused") as client,
            client.messages.stream(model="tiny", max_tokens=6, messages=messages, tools=tools) as stream,
        ):
            text = "".join([delta async for delta in stream.text_stream])
            return text, await stream.get_final_message()

    text, final = asyncio.run(follow_up())
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in final.content if b.type == "text") == text
    (segment,) = get_trajectory(url, session).segments
    assert [len(run) for run in sampled_runs(segment)] == [
        first.usage.output_tokens,
        final.usage.output_tokens,
    ]


def test_compaction_gives_two_segments(real_tito, closing):
    _, url = real_tito
    session = new_session(url)
    sdk = openai.OpenAI(base_url=session["base_url"], api_key="unused")
    closing(sdk)
    messages = [{"role": "user", "content": "copy the word: owl"}]
    for turn in range(3):
        reply = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"go {turn}"},
        ]
    compacted = [{"role": "user", "content": "summary: owl"}, *messages[-2:]]
    sdk.chat.completions.create(model="tiny", messages=compacted, max_tokens=5)
    first, second = get_trajectory(url, session).segments
    assert len(sampled_runs(first)) == 3 and len(sampled_runs(second)) == 1


def test_64_concurrent_sessions_never_cross_tokens(real_tito, tokenizer):
    _, url = real_tito
    words = ["fox", "cat", "dog", "owl", "bee", "the", "word", "next"]

    async def one(client: httpx.AsyncClient, index: int) -> None:
        session = (await client.post(f"{url}/sessions")).json()
        sdk = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused", http_client=client)
        messages = [{"role": "user", "content": f"copy the word: {words[index % 8]} {index}"}]
        replies = []
        for turn in range(2):
            if index % 2:  # half the sessions stream
                stream = await sdk.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=6, seed=index, stream=True
                )
                replies.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
            else:
                reply = await sdk.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=6, seed=index
                )
                replies.append(reply.choices[0].message.content or "")
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": f"{index}.{turn}"},
            ]
        body = (await client.get(f"{url}/sessions/{session['id']}/trajectory")).content
        (segment,) = msgspec.json.decode(body, type=Trajectory).segments
        text = tokenizer.decode(segment.token_ids)
        assert f"{words[index % 8]} {index}<|im_end|>" in text and f"\n{index}.0<|im_end|>" in text
        runs = sampled_runs(segment)
        assert [tokenizer.decode(run, skip_special_tokens=True) for run in runs] == replies

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=128)) as client:
            await asyncio.gather(*(one(client, index) for index in range(64)))

    asyncio.run(main())


def test_a_dead_engine_fails_only_its_own_sessions(tiny_model_dir, vllm_server):
    from molt.vllm_server import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # a killed engine: nothing listens there any more
    tito = Tito([vllm_server.url, dead], tiny_model_dir, served_model_name="tiny")
    app = create_app(tito)

    async def main():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://tito"
        ) as client:
            live, doomed = [(await client.post("/sessions")).json() for _ in range(2)]
            assert tito.sessions[live["id"]].engine.url != tito.sessions[doomed["id"]].engine.url
            if tito.sessions[live["id"]].engine.url == dead:
                live, doomed = doomed, live
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            failed = await client.post(f"/s/{doomed['id']}/v1/chat/completions", json=body)
            assert failed.status_code == 503 and "not answering" in failed.json()["error"]["message"]
            anthropic_body = {**body, "messages": [{"role": "user", "content": "hi"}]}
            failed = await client.post(f"/s/{doomed['id']}/v1/messages", json=anthropic_body)
            assert failed.status_code == 503 and failed.json()["type"] == "error"
            assert (await client.post(f"/s/{live['id']}/v1/chat/completions", json=body)).status_code == 200
            later = (await client.post("/sessions")).json()
            assert tito.sessions[later["id"]].engine.url == vllm_server.url
            assert (await client.post(f"/s/{later['id']}/v1/chat/completions", json=body)).status_code == 200
        await tito.aclose()

    asyncio.run(main())


def test_env_form_on_the_real_engine(tiny_model_dir, vllm_server, tokenizer):
    """Token ids in, token ids out, through the same capture as the HTTP routes, in the caller's process."""
    prompt = tokenizer(
        "<|im_start|>user\ncopy the word: bee<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )["input_ids"]

    async def main():
        tito = Tito([vllm_server.url], tiny_model_dir)
        session = tito.new_session()
        first = await tito.generate(session, prompt, max_tokens=4)
        follow = prompt + first.token_ids + tokenizer("\nmore", add_special_tokens=False)["input_ids"]
        second = await tito.generate(session, follow, max_tokens=4, temperature=0.0)
        await tito.aclose()
        return session, first, second, follow

    session, first, second, follow = asyncio.run(main())
    assert len(first.token_ids) == len(first.logprobs) == len(first.versions) <= 4
    (segment,) = session.capture.trajectory().segments
    assert segment.token_ids == follow + second.token_ids
    assert sum(segment.loss_mask) == len(first.token_ids) + len(second.token_ids)


def test_a_reply_streamed_from_the_real_engine_is_the_reply_it_sends_whole(
    tiny_model_dir, vllm_server, tokenizer
):
    """`stream_replies`: vLLM's token endpoint streams the same seeded tokens and logprobs it sends whole."""
    prompt = tokenizer("<|im_start|>user\ncount: one two<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)["input_ids"]  # fmt: skip

    async def sample(stream_replies: bool):
        tito = Tito([vllm_server.url], tiny_model_dir, stream_replies=stream_replies)
        result = await tito.generate(tito.new_session(), prompt, max_tokens=12, temperature=1.0, seed=5)
        await tito.aclose()
        return result

    whole, streamed = asyncio.run(sample(False)), asyncio.run(sample(True))
    assert len(streamed.token_ids) == len(streamed.logprobs) == len(streamed.versions) > 1
    assert streamed.token_ids == whole.token_ids and streamed.finish_reason == whole.finish_reason
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-5)
