"""Fixtures for the refit tests: tiny models, one refit-ready vLLM CPU server at a time, a fake engine.

`refit_servers` hands out real vLLM servers started with refit's engine flags. It keeps at most one
alive (this machine has two cores): asking for another model stops the current server first, so the
tests of one model run together and the tied model's tests come last (file order).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

HERE = Path(__file__).parent


class ServerPool:
    """At most one live vLLM server; `serve(model_dir)` returns the one serving `model_dir`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.current = None
        self.model_dir: Path | None = None

    def serve(self, model_dir: Path):
        import refit
        from molt.vllm_server import VLLMServer

        if self.model_dir != model_dir or self.current.process.poll() is not None:
            self.stop()
            log = self.log_dir / f"{model_dir.name}-{time.monotonic_ns()}.log"
            self.current = VLLMServer(model_dir, extra_args=refit.engine_flags(), log_path=log).start()
            self.model_dir = model_dir
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
        self.current, self.model_dir = None, None


@pytest.fixture(scope="session")
def refit_servers(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("refit-vllm"))
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    """The tiny Qwen3, rebuilt with tied input/output embeddings (molt.tiny builds untied ones)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt.tiny import build_tiny_model

    untied = build_tiny_model(tmp_path_factory.mktemp("untied-src"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    out = tmp_path_factory.mktemp("tied-model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(untied).save_pretrained(out)
    return out


class FakeEngine:
    """A stand-in engine process (tests/refit/fake_engine.py): the RL endpoints and the refit_gloo
    receive path over a plain state dict, no vLLM. Used only where a second real server cannot run
    here (one server at a time on this machine) and where the test needs an engine to die on cue."""

    def __init__(self, model_dir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "fake_engine.py"), str(model_dir), str(port)], start_new_session=True
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.kill()
        raise TimeoutError("fake engine did not start")

    def state(self) -> dict:
        return httpx.get(f"{self.url}/state", timeout=10).json()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def pipe():
    """(trainer channel, engine group) of one two-rank gloo group over loopback, both ends in this process."""
    from refit._transport import GlooChannel, host_store, join_gloo_group

    store = host_store("127.0.0.1", 30)
    box = {}
    engine = threading.Thread(
        target=lambda: box.update(group=join_gloo_group("127.0.0.1", store.port, 1, 2, 30))
    )
    engine.start()
    trainer = join_gloo_group("127.0.0.1", store.port, 0, 2, 30, store=store)
    engine.join()
    yield GlooChannel(trainer), box["group"]


@pytest.fixture
def fake_engine_factory():
    from molt.vllm_server import free_port

    engines: list[FakeEngine] = []

    def start(model_dir: Path) -> FakeEngine:
        engines.append(FakeEngine(model_dir, free_port()))
        return engines[-1]

    yield start
    for engine in engines:
        engine.kill()
