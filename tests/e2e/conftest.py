from __future__ import annotations

from types import SimpleNamespace

import pytest
from molt_runs import molt, reproducible_run_args


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


@pytest.fixture(scope="session")
def plain_run(tiny_model_dir, molt_engine, tmp_path_factory):
    """A 4-step run of the default algorithm under `reproducible_run_args`: the uninterrupted run the
    resume test compares with, and the plain run the optional groups' runs differ from. `.dir` is its run
    directory, `.stderr` its progress output."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    args = reproducible_run_args(tiny_model_dir, molt_engine.url)
    result = molt("train", *args, "--train.num_steps", "4", "--logger.run_dir", str(run_dir))
    return SimpleNamespace(dir=run_dir, stderr=result.stderr)
