from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def molt_engine(tiny_model_dir, tmp_path_factory):
    """One vLLM server started with the flags `molt train` gives its own engines, for runs that attach
    to it with `--vllm.urls` (each run pushes its initial weights first)."""
    from molt._engines import engine_extra_args
    from molt.config import Config
    from molt.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("molt-engine") / "server.log"
    with VLLMServer(tiny_model_dir, extra_args=engine_extra_args(Config()), log_path=log) as server:
        yield server
