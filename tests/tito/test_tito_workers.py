"""`tito serve --workers 2` for real: two processes over the fake engine on loopback, driven by the openai
SDK. Every session lands whole on one worker (the one its id names), both workers get sessions, requests
sent to the shared port reach the owner, and the dump holds every session once, complete."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import time

import httpx
import msgspec
import openai
import pytest
from tito_helpers import LiveServer

from tito import Trajectory
from tito._guard import MAX_BODY_BYTES
from tito._workers import session_owner

NUM_SESSIONS, NUM_TURNS = 16, 3


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        try:
            for offset in range(count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise RuntimeError("no free ports")


@pytest.fixture
def two_workers(tiny_model_dir, fake_engine, tmp_path):
    """(shared URL, its port, the dump) of `tito serve --workers 2` in front of the fake engine."""
    port = free_ports(3)
    dump = tmp_path / "dump.jsonl"
    with LiveServer(fake_engine.app) as engine:
        command = [
            sys.executable, "-m", "tito", "serve", "--engine", engine.url, "--model", str(tiny_model_dir),
            "--served-model-name", "tiny", "--port", str(port), "--workers", "2", "--dump", str(dump),
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            for worker_port in (port + 1, port + 2):
                wait_healthy(f"http://127.0.0.1:{worker_port}", process)
            yield f"http://127.0.0.1:{port}", port, dump
        finally:
            process.terminate()
            _, errors = process.communicate(timeout=60)
    assert process.returncode == 0, errors.decode()[-2000:]


def wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy")


@pytest.mark.slow
def test_sessions_land_whole_on_their_worker_and_dump_complete(two_workers, tokenizer):
    url, port, dump = two_workers
    http = httpx.Client()  # one kept-alive client creates every session, as an orchestrator would
    ended = {}
    for index in range(NUM_SESSIONS):
        session = http.post(f"{url}/sessions").raise_for_status().json()
        owner = session_owner(session["id"], 2)
        assert session["base_url"] == f"http://127.0.0.1:{port + 1 + owner}/s/{session['id']}/v1"
        direct = openai.OpenAI(base_url=session["base_url"], api_key="unused")
        shared = openai.OpenAI(base_url=f"{url}/s/{session['id']}/v1", api_key="unused")
        messages = []
        for turn in range(NUM_TURNS):
            messages.append({"role": "user", "content": f"copy the word: <<{index}>> {turn}"})
            if turn == 1:  # the middle turn through the shared port, streamed
                chunks = shared.chat.completions.create(model="tiny", messages=messages, stream=True)
                text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            else:
                reply = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
                text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
        so_far = http.get(f"{url}/sessions/{session['id']}/trajectory").raise_for_status()
        deleted = http.delete(f"{url}/sessions/{session['id']}").raise_for_status()
        assert so_far.content == deleted.content
        ended[session["id"]] = (index, owner, deleted)
        direct.close(), shared.close()
    http.close()
    assert {owner for _, owner, _ in ended.values()} == {0, 1}, "both workers should have sessions"
    dumped = [msgspec.json.decode(line, type=Trajectory) for line in dump.read_bytes().splitlines()]
    assert sorted(t.session_id for t in dumped) == sorted(ended)
    for trajectory in dumped:
        index, _, deleted = ended[trajectory.session_id]
        assert trajectory == msgspec.json.decode(deleted.content, type=Trajectory)
        (segment,) = trajectory.segments  # each turn extended the one before, on one worker
        assert len(trajectory.turns) == NUM_TURNS
        assert segment.loss_mask.count(1) == 2 * NUM_TURNS  # the fake engine samples two tokens a turn
        markers = re.findall(r"<<(\d+)>>", tokenizer.decode(segment.token_ids))
        assert markers == [str(index)] * NUM_TURNS


def test_a_workers_session_ids_name_it(tiny_model_dir):
    from tito import Tito

    tito = Tito(["http://engine"], tiny_model_dir, worker=(1, 3))
    ids = [tito.new_session().id for _ in range(30)]
    assert {session_owner(session_id, 3) for session_id in ids} == {1}
    assert all(re.fullmatch(r"[0-9a-f]{32}", session_id) for session_id in ids)  # still 128-bit hex
    assert session_owner("not-a-session", 3) is None


@pytest.fixture
def worker_pair(tiny_model_dir, fake_engine):
    """Two workers' apps in this process, each on its own loopback port, over the fake engine on
    loopback too (a real stream, which a client can leave): (url 0, url 1)."""
    from molt.vllm_server import free_port
    from tito import Tito, create_app
    from tito._workers import Workers

    ports = (free_port(), free_port())
    with LiveServer(fake_engine.app) as engine:
        apps = []
        for index in range(2):
            tito = Tito([engine.url], tiny_model_dir, served_model_name="tiny", worker=(index, 2))
            apps.append(create_app(tito, workers=Workers(index, "127.0.0.1", ports)))
        with LiveServer(apps[0], port=ports[0]) as first, LiveServer(apps[1], port=ports[1]) as second:
            yield first.url, second.url


def test_a_turn_sent_to_another_worker_reaches_the_owner(worker_pair, fake_engine, tokenizer):
    here, owner = worker_pair
    session = httpx.post(f"{owner}/sessions").raise_for_status().json()
    assert session_owner(session["id"], 2) == 1 and session["base_url"].startswith(owner)
    elsewhere = openai.OpenAI(base_url=f"{here}/s/{session['id']}/v1", api_key="unused")
    fake_engine.script = [[5, tokenizer.eos_token_id], [6, 7, tokenizer.eos_token_id]]
    messages = [{"role": "user", "content": "copy the word: owl"}]
    first = elsewhere.chat.completions.create(model="tiny", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "more"}]
    chunks = elsewhere.chat.completions.create(model="tiny", messages=messages, stream=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    reply = httpx.get(f"{here}/sessions/{session['id']}/trajectory").raise_for_status()
    (segment,) = msgspec.json.decode(reply.content, type=Trajectory).segments
    assert segment.token_ids == fake_engine.prompts[-1] + [6, 7, tokenizer.eos_token_id]
    assert segment.loss_mask.count(1) == 5
    elsewhere.close()


def test_a_client_that_leaves_a_forwarded_stream_leaves_no_turn(worker_pair, fake_engine, tokenizer):
    here, owner = worker_pair
    session = httpx.post(f"{owner}/sessions").raise_for_status().json()
    elsewhere = openai.OpenAI(base_url=f"{here}/s/{session['id']}/v1", api_key="unused")
    fake_engine.script = [tokenizer.encode("a b c d e f g h i j k l", add_special_tokens=False)]
    fake_engine.token_delay = 0.05
    stream = elsewhere.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "copy"}], stream=True, max_tokens=64
    )
    next(iter(stream))
    stream.close()  # the client leaves the worker that forwards; the owner's request must end too
    time.sleep(1.5)  # past the stream's end, had it gone on
    reply = httpx.get(f"{owner}/sessions/{session['id']}/trajectory").raise_for_status()
    assert msgspec.json.decode(reply.content, type=Trajectory).segments == []
    elsewhere.close()


def test_an_oversized_body_is_refused_alike_by_the_owner_and_by_a_worker_that_forwards(worker_pair):
    here, owner = worker_pair
    session = httpx.post(f"{owner}/sessions").raise_for_status().json()
    body = b" " * (MAX_BODY_BYTES + 1)
    direct, forwarded = (
        httpx.post(f"{url}/s/{session['id']}/v1/chat/completions", content=body) for url in (owner, here)
    )
    assert direct.status_code == forwarded.status_code == 413, forwarded.text
    assert forwarded.json()["error"]["type"] == direct.json()["error"]["type"] == "request_too_large"
