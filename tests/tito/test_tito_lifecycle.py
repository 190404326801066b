"""A standalone server's sessions: idle expiry, a cap on live sessions, the body limit for chunked bodies,
and the served model name read from the engine, a processor handed over (fake engine)."""

from __future__ import annotations

import time

import anyio
import httpx
import msgspec
import pytest
import typer
from tito_helpers import LiveServer

import tito._guard
from tito import Tito, Trajectory, create_app
from tito._cli import engine_model_name

pytestmark = pytest.mark.anyio
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def tito_over(fake_engine, tiny_model_dir, **options) -> Tito:
    transport = httpx.ASGITransport(app=fake_engine.app)
    return Tito(
        ["http://engine"], tiny_model_dir, served_model_name="tiny", engine_transport=transport, **options
    )


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tito")


async def test_an_idle_session_expires_is_dumped_and_says_so_afterwards(
    fake_engine, tiny_model_dir, tmp_path
):
    served = tito_over(fake_engine, tiny_model_dir, idle_timeout=60.0, dump=tmp_path / "dump.jsonl")
    client = client_of(create_app(served))
    idle, busy = [(await client.post("/sessions")).json() for _ in range(2)]
    assert (await client.post(f"/s/{idle['id']}/v1/chat/completions", json=BODY)).status_code == 200
    async with served.sessions[busy["id"]].lock:  # a session in a request is never expired
        assert served.expire_idle(now=time.monotonic() + 30) == []
        assert served.expire_idle(now=time.monotonic() + 61) == [idle["id"]]
    (line,) = (tmp_path / "dump.jsonl").read_bytes().splitlines()
    assert msgspec.json.decode(line, type=Trajectory).session_id == idle["id"]
    for _ in range(2):  # every later request hears why
        late = await client.post(f"/s/{idle['id']}/v1/chat/completions", json=BODY)
        assert late.status_code == 404 and "expired after 60 s" in late.json()["error"]["message"]
    assert busy["id"] in served.sessions


def test_the_server_expires_idle_sessions_by_itself(fake_engine, tiny_model_dir):
    served = tito_over(fake_engine, tiny_model_dir, idle_timeout=0.3)
    with LiveServer(create_app(served)) as server:
        session = httpx.post(f"{server.url}/sessions").json()
        deadline = time.monotonic() + 10
        while session["id"] in served.sessions:
            assert time.monotonic() < deadline, "the idle session was never expired"
            time.sleep(0.1)
        assert "expired" in httpx.get(f"{server.url}/sessions/{session['id']}/trajectory").text


async def test_a_cap_on_live_sessions_answers_429(fake_engine, tiny_model_dir):
    served = tito_over(fake_engine, tiny_model_dir, max_sessions=2)
    client = client_of(create_app(served))
    first, _ = (await client.post("/sessions")).json(), await client.post("/sessions")
    refused = await client.post("/sessions")
    assert refused.status_code == 429 and "DELETE /sessions" in refused.json()["error"]["message"]
    await client.delete(f"/sessions/{first['id']}")
    assert (await client.post("/sessions")).status_code == 200


async def test_the_body_limit_holds_for_a_chunked_body(client, monkeypatch):
    monkeypatch.setattr(tito._guard, "MAX_BODY_BYTES", 1000)
    session = (await client.post("/sessions")).json()

    async def chunks():  # no Content-Length: the body arrives in pieces
        for _ in range(10):
            yield b" " * 500

    for path in ("chat/completions", "messages"):
        reply = await client.post(f"/s/{session['id']}/v1/{path}", content=chunks())
        assert reply.status_code == 413, reply.text
        assert "1000 bytes" in reply.text
    assert reply.json()["type"] == "error"  # Anthropic's error shape under /v1/messages


def test_the_served_model_name_defaults_to_the_engines(fake_engine):
    with LiveServer(fake_engine.app) as engine:
        assert engine_model_name(engine.url) == "fake"
    with pytest.raises(typer.BadParameter, match="--served-model-name"):
        engine_model_name("http://127.0.0.1:1")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        pytest.param({"idle_timeout": -1.0}, "idle_timeout must be more than 0 seconds", id="idle-timeout"),
        pytest.param({"max_sessions": 0}, "max_sessions must be at least 1", id="max-sessions"),
    ],
)
def test_session_limits_out_of_range_are_refused(fake_engine, tiny_model_dir, options, says):
    with pytest.raises(ValueError, match=says):
        tito_over(fake_engine, tiny_model_dir, **options)


async def test_a_second_delete_waiting_on_a_running_turn_hears_the_session_ended(fake_engine, tiny_model_dir):
    served = tito_over(fake_engine, tiny_model_dir)
    client = client_of(create_app(served))
    session = (await client.post("/sessions")).json()
    replies = []

    async def delete():
        replies.append(await client.delete(f"/sessions/{session['id']}"))

    # A turn is running (it holds the session) while both DELETEs arrive.
    async with anyio.create_task_group() as group, served.sessions[session["id"]].lock:
        group.start_soon(delete)
        group.start_soon(delete)
        await anyio.sleep(0.1)  # both wait for the turn
    first, second = replies
    assert first.status_code == 200
    assert second.status_code == 404 and "was ended" in second.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_idle_time_counts_from_the_end_of_the_last_request(fake_engine, tiny_model_dir, stream):
    served = tito_over(fake_engine, tiny_model_dir, idle_timeout=60.0)
    client = client_of(create_app(served))
    session = (await client.post("/sessions")).json()
    replies = []

    async def turn():
        body = {**BODY, "stream": stream}
        replies.append(await client.post(f"/s/{session['id']}/v1/chat/completions", json=body))

    came = time.monotonic()
    # The request comes now and is served once the session is free: it ends 0.3 s after it came.
    async with anyio.create_task_group() as group, served.sessions[session["id"]].lock:
        group.start_soon(turn)
        await anyio.sleep(0.3)
    assert replies[0].status_code == 200
    assert served.expire_idle(now=came + 60.1) == []  # 60 s after the request came, not after it ended
    assert served.expire_idle(now=time.monotonic() + 60.1) == [session["id"]]


async def test_an_env_turn_waiting_on_a_session_ended_meanwhile_samples_nothing(fake_engine, tiny_model_dir):
    """`Tito.generate` (the Env form) queued behind a running turn while the session is ended: it refuses
    with the reason instead of sampling a reply that no trajectory would ever hold."""
    served = tito_over(fake_engine, tiny_model_dir)
    session = served.new_session()
    outcome = []

    async def turn():
        try:
            outcome.append(await served.generate(session, [1, 2, 3]))
        except Exception as error:
            outcome.append(error)

    async with anyio.create_task_group() as group, session.lock:  # a turn is running
        group.start_soon(turn)
        await anyio.sleep(0.1)
        served.end_session(session.id)
    (error,) = outcome
    assert isinstance(error, ValueError) and "was ended" in str(error), error
    assert fake_engine.requests == []
    await served.aclose()


async def test_a_processor_loaded_already_serves_without_reading_the_model_folder(
    fake_engine, tiny_model_dir, tmp_path
):
    """A trainer loads the processor while its engines start and hands it over (`Tito(processor=...)`)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    served = tito_over(fake_engine, tmp_path / "no-model-here", processor=processor)
    client = client_of(create_app(served))
    session = (await client.post("/sessions")).json()
    assert (await client.post(f"/s/{session['id']}/v1/chat/completions", json=BODY)).status_code == 200
    assert served.tokenizer is processor
