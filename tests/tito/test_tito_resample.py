"""An SDK's retry replaces the reply it retries; a deliberate resample is kept (the stock SDKs' retries,
through the real openai and anthropic clients, over the fake engine).

Both SDKs number each attempt in `x-stainless-retry-count` (0 first, then 1, 2, ...). A retry of a turn
tito committed (its reply was lost on the way back) replaces that turn; the same request sent again as
a first attempt is a second sample, and an agent that keeps the first (best-of-n) gets the reply it
continued from trained.
"""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest
from test_tito_app import encode, new_session, trajectory

pytestmark = pytest.mark.anyio

PROTOCOLS = ["openai", "anthropic"]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def sdk_on(protocol: str, client, session: dict, lose: tuple[int, ...] = ()):
    """The protocol's SDK on tito's app through a transport that notes each POST's retry count and, for
    the POSTs numbered in `lose`, answers 503 in place of tito's reply (read whole first, so tito has
    committed the turn), as if the reply were lost on its way back: the SDK retries it on its own."""
    http = httpx if protocol == "openai" else httpx2
    inner = http.ASGITransport(app=client._transport.app)
    counts: list[str | None] = []

    class Lossy(http.AsyncBaseTransport):
        async def handle_async_request(self, request):
            response = await inner.handle_async_request(request)
            if request.method == "POST":
                counts.append(request.headers.get("x-stainless-retry-count"))
                if len(counts) - 1 in lose:
                    await response.aread()
                    return http.Response(503, json={"error": "lost"}, headers={"retry-after-ms": "1"})
            return response

    http_client = http.AsyncClient(transport=Lossy(), base_url=str(client.base_url))
    if protocol == "openai":
        sdk = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused", http_client=http_client)
    else:
        sdk = anthropic.AsyncAnthropic(
            base_url=session["session_url"], api_key="unused", http_client=http_client
        )
    return sdk, counts


async def ask(protocol: str, sdk, messages: list[dict], *, stream: bool = False) -> str:
    if protocol == "openai":
        reply = await sdk.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, stream=stream
        )
        if stream:
            return "".join([chunk.choices[0].delta.content or "" async for chunk in reply if chunk.choices])
        return reply.choices[0].message.content
    if stream:
        async with sdk.messages.stream(model="tiny", max_tokens=16, messages=messages) as events:
            return "".join([delta async for delta in events.text_stream])
    reply = await sdk.messages.create(model="tiny", max_tokens=16, messages=messages)
    return reply.content[0].text


def sampled(segment) -> list[int]:
    return [token for token, mask in zip(segment.token_ids, segment.loss_mask, strict=True) if mask]


def words(tokenizer, *texts: str) -> list[list[int]]:
    return [encode(tokenizer, text) + [tokenizer.eos_token_id] for text in texts]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_best_of_two_trains_the_reply_the_conversation_continues_from(
    client, fake_engine, tokenizer, protocol
):
    """Two samples of one request, the agent keeps the first: it is trained, where the conversation
    goes on from it (from its sampled ids, here not the text's own tokenization), and the second is
    kept as a segment of its own."""
    session = await new_session(client)
    sdk, counts = sdk_on(protocol, client, session)
    fox, done = words(tokenizer, "fox", "done")
    owl = tokenizer.convert_tokens_to_ids(["o", "w", "l"]) + [tokenizer.eos_token_id]
    assert owl != words(tokenizer, "owl")[0]
    fake_engine.script = [owl, fox, done]
    messages = [{"role": "user", "content": "name an animal"}]
    assert [await ask(protocol, sdk, messages) for _ in range(2)] == ["owl", "fox"]
    messages += [{"role": "assistant", "content": "owl"}, {"role": "user", "content": "and now?"}]
    assert await ask(protocol, sdk, messages) == "done"
    assert counts == ["0", "0", "0"]
    first, again, on = fake_engine.prompts
    assert again == first and on[: len(first) + len(owl)] == first + owl  # owl as sampled, not re-rendered
    conversation, resample = (await trajectory(client, session)).segments
    assert (conversation.token_ids, sampled(conversation)) == (on + done, owl + done)
    assert (resample.token_ids, sampled(resample)) == (first + fox, fox)
    turns = (await trajectory(client, session)).turns
    assert [(turn.segment, turn.start) for turn in turns] == [(0, len(first)), (1, len(first)), (0, len(on))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_sdk_retry_of_a_committed_turn_replaces_its_reply(
    client, fake_engine, tokenizer, protocol, stream
):
    """tito committed the first turn but its reply was lost: the SDK's retry (retry count 1) samples again
    and takes its place, so the conversation's one segment holds the reply the agent received."""
    session = await new_session(client)
    sdk, counts = sdk_on(protocol, client, session, lose=(0,))
    owl, fox, done = words(tokenizer, "owl", "fox", "done")
    fake_engine.script = [owl, fox, done]
    messages = [{"role": "user", "content": "name an animal"}]
    assert await ask(protocol, sdk, messages, stream=stream) == "fox"
    messages += [{"role": "assistant", "content": "fox"}, {"role": "user", "content": "and now?"}]
    assert await ask(protocol, sdk, messages) == "done"
    assert counts == ["0", "1", "0"]
    (segment,) = (await trajectory(client, session)).segments
    assert (segment.token_ids, sampled(segment)) == (fake_engine.prompts[-1] + done, fox + done)
    assert len((await trajectory(client, session)).turns) == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_sdk_retry_of_a_resample_that_failed_keeps_the_first_sample(
    client, fake_engine, tokenizer, protocol
):
    """The second sample's first attempt fails at the engine (tito answers 503, nothing committed); the
    SDK retries it with retry count 1. That retry replaces nothing: the first sample, which the agent
    goes on from, stays and is trained."""
    session = await new_session(client)
    sdk, counts = sdk_on(protocol, client, session)
    owl, fox, done = words(tokenizer, "owl", "fox", "done")
    fake_engine.script = [owl, fox, done]
    messages = [{"role": "user", "content": "name an animal"}]
    assert await ask(protocol, sdk, messages) == "owl"
    fake_engine.fail_next = 1
    assert await ask(protocol, sdk, messages) == "fox"
    messages += [{"role": "assistant", "content": "owl"}, {"role": "user", "content": "and now?"}]
    assert await ask(protocol, sdk, messages) == "done"
    assert counts == ["0", "0", "1", "0"]
    conversation, resample = (await trajectory(client, session)).segments
    assert sampled(conversation) == owl + done and sampled(resample) == fox
