from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine
from tito_helpers import LiveServer

from tito import Tito, create_app


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def fake_engine(tokenizer):
    return FakeEngine(eos_id=tokenizer.eos_token_id)


@pytest.fixture
def fake_tito(tiny_model_dir, fake_engine, tmp_path):
    """tito over the fake engine, both spoken to in-process through ASGI transports."""
    return Tito(
        ["http://engine"],
        tiny_model_dir,
        served_model_name="tiny",
        dump=tmp_path / "dump.jsonl",
        engine_transport=httpx.ASGITransport(app=fake_engine.app),
    )


@pytest.fixture
def client(fake_tito):
    """An httpx client on tito's app; `client.base_url` is what an SDK's http_client should use."""
    transport = httpx.ASGITransport(app=create_app(fake_tito))
    return httpx.AsyncClient(transport=transport, base_url="http://tito")


@pytest.fixture(scope="session")
def real_tito(tiny_model_dir, vllm_server, tmp_path_factory):
    """tito on loopback in front of the session's real vLLM CPU server: (Tito, base URL)."""
    tito = Tito(
        [vllm_server.url],
        tiny_model_dir,
        served_model_name="tiny",
        dump=tmp_path_factory.mktemp("tito") / "dump.jsonl",
    )
    with LiveServer(create_app(tito)) as server:
        yield tito, server.url


@pytest.fixture(scope="session")
def vl_tito(tiny_vl_model_dir, vl_vllm_server, tmp_path_factory):
    """tito on loopback in front of the session's vision-language vLLM server: (Tito, base URL). The server
    runs a molt engine's flags, refit's middleware among them: tito speaks to it as molt's does, every
    reply streamed from the compact route (images as vLLM's features there too)."""
    dump = tmp_path_factory.mktemp("tito-vl") / "dump.jsonl"
    flags = {"stream_replies": True, "compact_stream": True}
    tito = Tito([vl_vllm_server.url], tiny_vl_model_dir, served_model_name="tiny-vl", dump=dump, **flags)
    with LiveServer(create_app(tito)) as server:
        yield tito, server.url
