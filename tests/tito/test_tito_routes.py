"""MoE routes in the capture (`--train.routing_replay`'s engine side): each segment keeps the experts the
engine routed its tokens to, asking the engine only for routes it does not hold yet.

vLLM's route capture runs only in its GPU model runner, so the engine here is the fake one (fake_engine.py),
whose routes are a fixed function of (token, position, layer, slot), as a prefix-cached engine's are."""

from __future__ import annotations

import base64
import io

import httpx
import msgspec
import numpy as np
import openai
import pytest

from tito import Capture, Generation, Segment, Tito, create_app, serve_on_loop

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def expected_routes(fake_engine, tokens: list[int]) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(fake_engine.routes(tokens, 0))))


async def test_routes_of_a_multi_turn_env_session_cover_every_forwarded_token(fake_tito, fake_engine):
    fake_engine.route_shape = (3, 2)
    fake_engine.script = [[21, 22, 23], [31, 32]]
    session = fake_tito.new_session()
    await fake_tito.generate(session, [1, 2, 3, 4])
    await fake_tito.generate(session, [1, 2, 3, 4, 21, 22, 23, 5, 6])

    first, second = (request["sampling_params"] for request in fake_engine.requests)
    assert "routed_experts_prompt_start" not in first  # the first turn asks for all of them
    assert second["routed_experts_prompt_start"] == 6  # 4 prompt + 2 of 3 sampled: the last was unforwarded

    (segment,) = session.capture.trajectory().segments
    assert segment.token_ids == [1, 2, 3, 4, 21, 22, 23, 5, 6, 31, 32]
    routes = segment.routes()
    assert routes.shape == (10, 3, 2) and routes.dtype == np.uint8
    np.testing.assert_array_equal(routes, expected_routes(fake_engine, segment.token_ids))


async def test_a_retry_and_a_compaction_keep_routes_aligned_with_their_segment(fake_tito, fake_engine):
    fake_engine.route_shape = (2, 1)
    fake_engine.script = [[21, 22], [23], [41, 42]]
    session = fake_tito.new_session()
    await fake_tito.generate(session, [1, 2, 3])
    await fake_tito.generate(session, [1, 2, 3], retry=True)  # replaces the reply and its routes
    assert fake_engine.requests[1]["sampling_params"]["routed_experts_prompt_start"] == 3
    await fake_tito.generate(session, [1, 9])  # a rewritten prefix: a new segment, routes from token 0
    assert "routed_experts_prompt_start" not in fake_engine.requests[2]["sampling_params"]

    first, second = session.capture.trajectory().segments
    assert first.token_ids == [1, 2, 3, 23] and second.token_ids == [1, 9, 41, 42]
    for segment in (first, second):
        np.testing.assert_array_equal(segment.routes(), expected_routes(fake_engine, segment.token_ids))


async def test_a_resample_keeps_its_own_routes_and_the_first_sample_goes_on_with_its_own(
    fake_tito, fake_engine
):
    fake_engine.route_shape = (2, 1)
    fake_engine.script = [[21, 22], [23], [31]]
    session = fake_tito.new_session()
    await fake_tito.generate(session, [1, 2, 3])
    await fake_tito.generate(session, [1, 2, 3])  # a second sample: a segment of its own, routes from 0
    assert "routed_experts_prompt_start" not in fake_engine.requests[1]["sampling_params"]
    await fake_tito.generate(session, [1, 2, 3, 21, 22, 4])  # goes on from the first sample
    assert fake_engine.requests[2]["sampling_params"]["routed_experts_prompt_start"] == 4

    first, second = session.capture.trajectory().segments
    assert first.token_ids == [1, 2, 3, 21, 22, 4, 31] and second.token_ids == [1, 2, 3, 23]
    for segment in (first, second):
        np.testing.assert_array_equal(segment.routes(), expected_routes(fake_engine, segment.token_ids))


async def test_a_streamed_chat_turn_through_the_openai_sdk_captures_routes(fake_tito, fake_engine):
    fake_engine.route_shape = (2, 2)
    fake_engine.script = [[11, 12, 13]]
    async with serve_on_loop(create_app(fake_tito)) as url:
        session = fake_tito.new_session()
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session.id}/v1", api_key="none")
        chunks = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for _ in chunks:
            pass
        await client.close()
    (segment,) = session.capture.trajectory().segments
    np.testing.assert_array_equal(segment.routes(), expected_routes(fake_engine, segment.token_ids))


def test_routes_survive_the_json_trajectory_and_are_left_out_without_them():
    capture = Capture("s")
    capture.commit_turn([1, 2], [], Generation([7], [-0.1]))
    assert b"routed_experts" not in msgspec.json.encode(capture.trajectory())

    routes = np.arange(2 * 4 * 2, dtype=np.uint16).reshape(2, 4, 2)
    buffer = io.BytesIO()
    np.save(buffer, routes)
    capture = Capture("s")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    capture.commit_turn([1, 2], [], Generation([7], [-0.1], routed_experts=encoded))
    segment = msgspec.json.decode(msgspec.json.encode(capture.trajectory().segments[0]), type=Segment)
    np.testing.assert_array_equal(segment.routes(), routes)


def test_routes_that_do_not_fit_the_segment_are_refused():
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((5, 2, 1), dtype=np.uint8))  # 5 rows for a 3-token segment
    capture = Capture("s")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    with pytest.raises(ValueError, match="routes for tokens 0..4 of a segment of 3 tokens"):
        capture.commit_turn([1, 2], [], Generation([7], [-0.1], routed_experts=encoded))


async def test_a_reply_streamed_from_the_engine_for_a_whole_turn_captures_what_one_reply_does(
    tiny_model_dir, fake_engine
):
    # `stream_replies`: the engine streams every reply and tito gathers the chunks (one a token here);
    # tokens, logprobs, weight versions, finish and routes must come out as from the one whole reply,
    # also from refit's compact route (`compact_stream`: each logprob a bare float).
    fake_engine.route_shape, fake_engine.version = (2, 1), "7"
    captured = []
    for stream_replies, compact_stream in ((False, False), (True, False), (True, True)):
        fake_engine.script = [[21, 22, 23, 24]]
        transport = httpx.ASGITransport(app=fake_engine.app)
        flags = {"stream_replies": stream_replies, "compact_stream": compact_stream}
        tito = Tito(["http://engine"], tiny_model_dir, engine_transport=transport, **flags)
        session = tito.new_session()
        result = await tito.generate(session, [1, 2, 3], max_tokens=3)
        asked, path = fake_engine.requests[-1], fake_engine.paths[-1]
        assert asked.get("stream", False) is stream_replies
        assert path == ("/refit/generate" if compact_stream else "/inference/v1/generate")
        assert asked["sampling_params"].get("flat_logprobs", False) is compact_stream
        assert tito.router.engines[0].num_in_flight == 0
        (segment,) = session.capture.trajectory().segments
        captured.append((result, msgspec.to_builtins(segment)))
        await tito.aclose()
    (whole, whole_segment), *streams = captured
    for streamed, streamed_segment in streams:
        assert streamed.token_ids == whole.token_ids == [21, 22, 23]
        assert streamed.logprobs == whole.logprobs == [-0.5] * 3
        assert streamed.versions == whole.versions == [7] * 3
        assert streamed.finish_reason == whole.finish_reason == "length"
        assert streamed.routed_experts == whole.routed_experts is not None
        assert streamed_segment == whole_segment
