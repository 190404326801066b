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
    """`-n 2` (the default options): two workers, each running its tests in file order, one the `molt
    train` runs of tests/e2e, the other everything else. A run leaves one of the two cores mostly idle;
    this way both are used, and each session fixture starts once, in the worker that needs it (the
    vision-language engine in both). Measured on the 2-core machine: 1,216 s (serial: 2,230 s); moving
    the two e2e runs that start engines of their own to the other worker made it 1,305 s."""
    from xdist.scheduler import LoadScopeScheduling

    class TwoStreams(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "e2e" if nodeid.startswith("tests/e2e/") else "units"

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
