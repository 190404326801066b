"""Shared, expensive fixtures: one tiny model and one vLLM CPU server per test session."""

from __future__ import annotations

import os
import sys

import pytest

# Where PYTHONDONTWRITEBYTECODE is set (container images often set it) nothing caches compiled modules,
# and every process this suite starts (vLLM servers, Ray workers, `molt train`) compiles torch, vLLM and
# transformers from source again: importing molt's loop and vLLM's server took 24 s instead of 11 s.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray workers run in this environment, not in a fresh `uv run` copy (see molt._cli).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin, nothing calls it
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (the default options): two workers, each running its tests in file order. One runs the
    `molt train` runs of tests/e2e on the session's engine (`molt_engine`); the other everything else,
    with the two e2e runs that start engines of their own, which evens the two out (one run's durations:
    1,171 s of tests/e2e against 723 s of the rest; those two took 226 s). A run leaves one of the two
    cores mostly idle; this way both are used, and the session's engines start once, in the worker that
    needs them (the vision-language one in both)."""
    from xdist.scheduler import LoadScopeScheduling

    own_engines = ("tests/e2e/test_engine_restarts.py", "tests/e2e/test_lora_train.py")

    class TwoStreams(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            e2e = nodeid.startswith("tests/e2e/") and not nodeid.startswith(own_engines)
            return "e2e" if e2e else "units"

    return TwoStreams(config, log)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The seeded tiny Qwen3 model and its ChatML tokenizer, built once per session."""
    from molt.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """One real vLLM (CPU build) server for the whole session, serving the tiny model."""
    from molt.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VLLMServer(tiny_model_dir, log_path=log) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_vl_model_dir(tmp_path_factory):
    """The seeded tiny Qwen2-VL model and its processor, built once per session."""
    from molt.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl-model"))


@pytest.fixture(scope="session")
def vl_vllm_server(tiny_vl_model_dir, tmp_path_factory):
    """One real vLLM (CPU build) server for the whole session, serving the tiny vision-language model
    with the flags a molt engine gets (`molt._engines.engine_extra_args`)."""
    from molt._engines import engine_extra_args
    from molt.config import Config
    from molt.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vl-vllm") / "server.log"
    with VLLMServer(tiny_vl_model_dir, extra_args=engine_extra_args(Config()), log_path=log) as server:
        yield server
