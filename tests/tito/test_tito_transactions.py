"""A turn that does not complete leaves the session's trajectory exactly as it was (fake engine: it must
fail on cue, once, or drop a stream halfway, which a real engine does not do on demand).

The SDKs run with their default retries (max_retries unset): a failed turn is retried by the SDK, and the
trajectory must hold that turn once.
"""

from __future__ import annotations

import anthropic
import anyio
import httpx
import msgspec
import openai
import pytest
from test_tito_app import anthropic_client, encode, new_session, openai_client, trajectory
from tito_helpers import LiveServer

from tito import Tito, Trajectory, create_app

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def assert_one_clean_conversation(segment, prompts, replies):
    """The segment is the last prompt plus its reply, and every earlier prompt extends into it once."""
    assert segment.token_ids == prompts[-1] + replies[-1]
    assert segment.loss_mask.count(1) == sum(len(reply) for reply in replies)
    for prompt, reply in zip(prompts, replies, strict=True):
        assert segment.token_ids[: len(prompt) + len(reply)] == prompt + reply


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_openai_default_retry_after_an_engine_failure_is_one_clean_turn(
    client, fake_engine, tokenizer, stream
):
    session = await new_session(client)
    sdk = openai_client(client, session)
    replies = [encode(tokenizer, "owl") + [tokenizer.eos_token_id], encode(tokenizer, "fox") + [2]]
    replies[1][-1] = tokenizer.eos_token_id
    fake_engine.script = [list(reply) for reply in replies]
    messages = [{"role": "user", "content": "copy the word: owl"}]
    first = await sdk.chat.completions.create(model="tiny", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "fox"}]
    fake_engine.fail_next = 1
    second = await sdk.chat.completions.create(model="tiny", messages=messages, stream=stream)
    text = "".join([c.choices[0].delta.content or "" async for c in second]) if stream else None
    assert (text if stream else second.choices[0].message.content) == "fox"
    assert len(fake_engine.requests) == 3  # the failed request was retried by the SDK
    failed, retried = (request["token_ids"] for request in fake_engine.requests[1:])
    assert retried == failed  # the retry renders the conversation as the failed request did
    (segment,) = (await trajectory(client, session)).segments
    assert_one_clean_conversation(segment, fake_engine.prompts, replies)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_anthropic_default_retry_after_an_engine_failure_is_one_clean_turn(
    client, fake_engine, tokenizer, stream
):
    session = await new_session(client)
    sdk = anthropic_client(client, session)
    replies = [encode(tokenizer, "owl") + [tokenizer.eos_token_id], encode(tokenizer, "fox")]
    replies[1].append(tokenizer.eos_token_id)
    fake_engine.script = [list(reply) for reply in replies]
    messages = [{"role": "user", "content": "copy the word: owl"}]
    first = await sdk.messages.create(model="tiny", max_tokens=16, messages=messages)
    messages += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "fox"}]
    fake_engine.fail_next = 1
    if stream:
        async with sdk.messages.stream(model="tiny", max_tokens=16, messages=messages) as events:
            text = "".join([delta async for delta in events.text_stream])
    else:
        text = (await sdk.messages.create(model="tiny", max_tokens=16, messages=messages)).content[0].text
    assert text == "fox"
    assert len(fake_engine.requests) == 3
    failed, retried = (request["token_ids"] for request in fake_engine.requests[1:])
    assert retried == failed
    (segment,) = (await trajectory(client, session)).segments
    assert_one_clean_conversation(segment, fake_engine.prompts, replies)


async def test_a_failed_env_turn_leaves_the_capture_untouched(fake_tito, fake_engine, tokenizer):
    session = fake_tito.new_session()
    fake_engine.script = [[5, tokenizer.eos_token_id], [6, tokenizer.eos_token_id]]
    await fake_tito.generate(session, [1, 2], max_tokens=4)
    before = session.capture.trajectory()
    fake_engine.fail_next = 1
    with pytest.raises(Exception, match="503"):
        await fake_tito.generate(session, [1, 2, 5, tokenizer.eos_token_id, 3], max_tokens=4)
    assert session.capture.trajectory() == before
    await fake_tito.generate(session, [1, 2, 5, tokenizer.eos_token_id, 3], max_tokens=4)
    (segment,) = session.capture.trajectory().segments
    assert segment.token_ids == [1, 2, 5, tokenizer.eos_token_id, 3, 6, tokenizer.eos_token_id]


@pytest.fixture
def live_engine_tito(tiny_model_dir, fake_engine):
    """tito and the fake engine each on a loopback socket: a real stream a client can walk away from and
    an engine connection that can drop halfway."""
    with LiveServer(fake_engine.app) as engine:
        tito = Tito([engine.url], tiny_model_dir, served_model_name="tiny")
        with LiveServer(create_app(tito)) as server:
            yield server.url


def live_trajectory(url: str, session: dict) -> Trajectory:
    reply = httpx.get(f"{url}/sessions/{session['id']}/trajectory")
    return msgspec.json.decode(reply.content, type=Trajectory)


def two_turns(url: str, fake_engine, tokenizer, protocol: str):
    """Turn one completes; turn two is streamed: returns (session, sdk, messages for turn two)."""
    session = httpx.post(f"{url}/sessions").json()
    owl = encode(tokenizer, "owl") + [tokenizer.eos_token_id]
    fake_engine.script = [owl, encode(tokenizer, "a b c d e f g h i j k l")]
    messages = [{"role": "user", "content": "copy the word: owl"}]
    if protocol == "openai":
        sdk = openai.OpenAI(base_url=session["base_url"], api_key="unused")
        first = sdk.chat.completions.create(model="tiny", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    else:
        sdk = anthropic.Anthropic(base_url=session["session_url"], api_key="unused")
        first = sdk.messages.create(model="tiny", max_tokens=16, messages=messages)
        messages += [{"role": "assistant", "content": "".join(b.text for b in first.content)}]
    return session, sdk, [*messages, {"role": "user", "content": "more"}]


def open_stream(sdk, messages, protocol: str):
    if protocol == "openai":
        return sdk.chat.completions.create(model="tiny", messages=messages, stream=True, max_tokens=64)
    return sdk.messages.create(model="tiny", max_tokens=64, messages=messages, stream=True)


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_client_that_leaves_mid_stream_leaves_the_trajectory_as_it_was(
    live_engine_tito, fake_engine, tokenizer, protocol
):
    url = live_engine_tito
    session, sdk, messages = two_turns(url, fake_engine, tokenizer, protocol)
    before = live_trajectory(url, session)
    fake_engine.token_delay = 0.05
    stream = open_stream(sdk, messages, protocol)
    next(iter(stream))
    stream.close()  # the client goes away after the first event
    fake_engine.token_delay = 0.0
    fake_engine.script = [[7, tokenizer.eos_token_id]]
    # The next request waits for the abandoned one to let go of the session, then continues from `before`.
    if protocol == "openai":
        sdk.chat.completions.create(model="tiny", messages=messages)
    else:
        sdk.messages.create(model="tiny", max_tokens=16, messages=messages)
    (segment,) = live_trajectory(url, session).segments
    (old,) = before.segments
    assert segment.token_ids == fake_engine.prompts[-1] + [7, tokenizer.eos_token_id]
    assert segment.token_ids[: len(old.token_ids)] == old.token_ids
    assert segment.loss_mask.count(1) == old.loss_mask.count(1) + 2
    sdk.close()


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("fault", ["drops", "nan-logprob"])
def test_an_engine_that_fails_a_stream_halfway_leaves_the_trajectory_as_it_was(
    live_engine_tito, fake_engine, tokenizer, protocol, fault
):
    """The engine drops the stream, or gives a token no logprob (vLLM's null for NaN), after 3 tokens: the
    client's stream fails (with the reason where the stream can still carry one), nothing is captured."""
    url = live_engine_tito
    session, sdk, messages = two_turns(url, fake_engine, tokenizer, protocol)
    before = live_trajectory(url, session)
    error = openai.APIError if protocol == "openai" else anthropic.APIError
    if fault == "drops":
        fake_engine.break_after, raised = 3, pytest.raises((error, httpx.HTTPError))
    else:
        fake_engine.null_logprob_from, raised = 3, pytest.raises(error, match="no logprob for token 0 of a")
    with raised:
        for _ in open_stream(sdk, messages, protocol):
            pass
    assert live_trajectory(url, session) == before
    sdk.close()


async def asgi_chat(app, session: dict, messages: list[dict], *, client_leaves: bool) -> int:
    """One chat completion straight through ASGI; with `client_leaves`, the server hears `http.disconnect`
    as soon as it asks after the body (the client left while the engine sampled). Returns the status."""
    body = msgspec.json.encode({"model": "tiny", "messages": messages, "max_tokens": 8})
    path = f"/s/{session['id']}/v1/chat/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"tito"), (b"content-type", b"application/json")],
        "server": ("tito", 80), "client": ("127.0.0.1", 1),
    }  # fmt: skip
    messages_in = [{"type": "http.request", "body": body, "more_body": False}]
    still_there = anyio.Event()

    async def receive():
        if messages_in:
            return messages_in.pop(0)
        if client_leaves:
            return {"type": "http.disconnect"}
        await still_there.wait()

    sent = []

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"]


async def test_a_whole_reply_is_committed_only_if_the_client_is_still_there(client, fake_engine, tokenizer):
    app = client._transport.app
    session = await new_session(client)
    fake_engine.script = [[5, tokenizer.eos_token_id]]
    messages = [{"role": "user", "content": "copy the word: owl"}]
    assert await asgi_chat(app, session, messages, client_leaves=True) == 200
    assert (await trajectory(client, session)).segments == []
    fake_engine.script = [[6, tokenizer.eos_token_id]]
    assert await asgi_chat(app, session, messages, client_leaves=False) == 200
    (segment,) = (await trajectory(client, session)).segments
    assert segment.token_ids == fake_engine.prompts[-1] + [6, tokenizer.eos_token_id]
