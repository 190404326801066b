"""The end-to-end runs share one vLLM server (`molt_engine`, joined with `--vllm.urls`) and one Ray cluster
(`ray_cluster`, joined with `--ray.address`): starting either takes longer than a short run itself. The
runs that must show what a run starts and stops on its own (tests/e2e/test_train_loop.py) start both."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from molt_runs import molt, ray_head, reproducible_run_args

MAX_PADDING_FRAC = 0.05  # the actor packs its rows: at most this share of its token slots is padding


@pytest.fixture(autouse=True)
def packed_runs(tmp_path_factory):
    """After each end-to-end test, every run directory under the session's temporary root logged
    `actor/padding_frac` at or below MAX_PADDING_FRAC on every step (the runs of session fixtures are
    checked after the first test that uses them)."""
    yield
    for metrics in tmp_path_factory.getbasetemp().rglob("metrics.jsonl"):
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        padded = {
            s["step"]: s["actor/padding_frac"]
            for s in steps
            if s.get("actor/padding_frac", 0) > MAX_PADDING_FRAC
        }
        assert not padded, f"{metrics.parent}: actor/padding_frac above {MAX_PADDING_FRAC} at steps {padded}"


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
def ray_cluster(tmp_path_factory):
    """One Ray head for the session's runs (`.address`; run them with `.env`, which holds its token)."""
    with ray_head(tmp_path_factory.mktemp("ray-head") / "ray-head.log") as head:
        yield head


@pytest.fixture(scope="session")
def plain_run(tiny_model_dir, molt_engine, ray_cluster, tmp_path_factory):
    """A 4-step run of the default algorithm under `reproducible_run_args`: the uninterrupted run the
    resume test compares with, and the plain run the optional groups' runs differ from. `.dir` is its run
    directory, `.stderr` its progress output."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    args = reproducible_run_args(tiny_model_dir, molt_engine.url, ray_cluster.address)
    args += ["--train.num_steps", "4", "--logger.run_dir", str(run_dir)]
    result = molt("train", *args, env=ray_cluster.env)
    return SimpleNamespace(dir=run_dir, stderr=result.stderr)


@pytest.fixture(scope="session")
def lora_model_dir(tiny_model_dir, tmp_path_factory):
    """The session's tiny model with its lm_head scaled by 8, on which adapters alone can move the policy
    (tests/e2e/test_lora_train.py says why)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    out = tmp_path_factory.mktemp("tiny-lm-head-x8")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out
