"""Refit into a real CUDA vLLM engine on the trainer's own GPU, through refit's CUDA IPC weight transfer
(`refit.IPC_BACKEND`, vLLM's IPC engine plus a check of every bucket), the prefix cache across a refit,
and the check: a bucket corrupted on its way is refused, rolled back and sent again. The same check over
NCCL (`refit.NCCL_BACKEND`) into an engine on a second GPU, skipped with one (NCCL refuses two ranks on
one device). GPU machine only: both backends are CUDA's."""

from __future__ import annotations

import os
import re

import httpx
import pytest
import torch
from refit_helpers import CorruptWire

import refit
from refit._transport import IpcChannel, NcclChannel

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
TOL = 0.1  # bf16 engine vs bf16 transformers on a random tiny model; weight sets differ by far more
LONG_PROMPT = [(7 * i) % 90 + 5 for i in range(300)]  # several KV blocks, so the prefix cache can hit
PROMPTS = [[5, 17, 33, 60, 2, 41, 41, 9], [70, 3, 3, 3, 12, 88, 19, 4, 51, 27, 30], LONG_PROMPT]


@pytest.fixture(scope="module")
def ipc_engine(tiny_model_dir, tmp_path_factory):
    from molt.vllm_server import VLLMServer

    args = [*refit.engine_flags(refit.IPC_BACKEND), "--dtype", "bfloat16", "--gpu-memory-utilization", "0.2",
            "--enforce-eager"]  # fmt: skip
    log = tmp_path_factory.mktemp("ipc-vllm") / "server.log"
    env = refit.engine_env(refit.IPC_BACKEND)
    with VLLMServer(tiny_model_dir, extra_args=args, log_path=log, on_cpu=False, env=env) as server:
        yield server


def _sample(url: str, prompt: list[int], max_tokens: int = 16) -> tuple[list[int], torch.Tensor]:
    params = {"max_tokens": max_tokens, "temperature": 1.0, "seed": 0, "ignore_eos": True, "logprobs": 0}
    reply = httpx.post(f"{url}/inference/v1/generate", json={"token_ids": prompt, "sampling_params": params},
                       timeout=120)  # fmt: skip
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return choice["token_ids"], torch.tensor([item["logprob"] for item in choice["logprobs"]["content"]])


@torch.no_grad()
def _error(url: str, model: torch.nn.Module) -> float:
    """Largest |engine - transformers| logprob of the engine's own samples over PROMPTS."""
    worst = 0.0
    for prompt in PROMPTS:
        completion, engine_T = _sample(url, prompt)
        logits = model(torch.tensor([prompt + completion], device="cuda")).logits[0, len(prompt) - 1 : -1]
        sampled_T1 = torch.tensor(completion, device="cuda")[:, None]
        want_T = torch.log_softmax(logits.float(), -1).gather(-1, sampled_T1)[:, 0].cpu()
        worst = max(worst, float((engine_T - want_T).abs().max()))
    return worst


def _prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))


def _weights(tmp_path, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from molt.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / f"seed{seed}", seed=seed)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


def test_ipc_refit_serves_the_trainers_weights_and_no_stale_prefix_kv(ipc_engine, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    url, engine = ipc_engine.url, refit.Engine(ipc_engine.url, backend=refit.IPC_BACKEND)
    try:
        start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
        assert _error(url, start) < TOL
        hits = _prefix_cache_hits(url)
        _sample(url, LONG_PROMPT)
        assert _prefix_cache_hits(url) > hits, "the long prompt should be served from the prefix cache"
        for seed in (11, 12):
            model = _weights(tmp_path, seed)
            assert _error(url, model) > 5 * TOL  # the engine still serves other weights
            params = refit.full_params(model)
            stats = refit.update_weights([engine], params, version=seed, bucket_bytes=64 << 10)
            assert stats.num_buckets > 1 and set(stats.seconds) >= {"pause", "transfer", "finish", "resume"}
            # where the engine spent it, over all the buckets, also in its log
            timings = engine.worker_timings()[0]
            assert set(timings) == {"start_s", "open_s", "verify_s", "load_s", "finish_s"}
            assert timings["load_s"] > 0 and all(v >= 0 for v in timings.values())
            # LONG_PROMPT was cached under the old weights: it must be recomputed, not served from stale KV.
            assert _error(url, model) < TOL
            assert not engine.is_paused()
        log = ipc_engine.log_path.read_text()
        assert log.count("refit_ipc: start_s") >= 2
        # a dense unquantized model: each bucket copied into the served tensors, no layerwise reload
        assert "refit_ipc: loads in place" in log
    finally:  # a failed check must not leave its connection open for the next test to meet
        engine.close()


@pytest.fixture(scope="module")
def nccl_engine(tiny_model_dir, tmp_path_factory):
    """An engine on the second GPU this process sees; the trainer stays on the first."""
    if torch.cuda.device_count() < 2:
        pytest.skip("the NCCL refit needs a second GPU for the engine (NCCL refuses two ranks on one)")
    from molt.vllm_server import VLLMServer

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    second = visible.split(",")[1] if visible else "1"
    args = [*refit.engine_flags(refit.NCCL_BACKEND), "--dtype", "bfloat16", "--gpu-memory-utilization", "0.2",
            "--enforce-eager"]  # fmt: skip
    log = tmp_path_factory.mktemp("nccl-vllm") / "server.log"
    env = {**refit.engine_env(refit.NCCL_BACKEND), "CUDA_VISIBLE_DEVICES": second}
    with VLLMServer(tiny_model_dir, extra_args=args, log_path=log, on_cpu=False, env=env) as server:
        yield server


def _a_corrupted_bucket_is_refused_and_sent_again(server, backend, channel, tmp_path, monkeypatch) -> None:
    url, engine = server.url, refit.Engine(server.url, backend=backend)
    clean = _weights(tmp_path, 21)
    stats = refit.update_weights([engine], refit.full_params(clean), version=21, bucket_bytes=64 << 10)
    assert stats.verify_failed == () and stats.num_buckets > 1
    report = engine.verify_report()[0]  # the engine took a checksum of every bucket, and each matched
    assert report["failed"] is None and report["checked"] == len(report["checksums"]) == stats.num_buckets
    assert _error(url, clean) < TOL

    wire = CorruptWire(monkeypatch, bucket=1, times=1, channel=channel)  # after the trainer's checksum
    model = _weights(tmp_path, 22)
    assert _error(url, model) > 5 * TOL
    stats = refit.update_weights([engine], refit.full_params(model), version=22, bucket_bytes=64 << 10)
    assert wire.hits == 1 and stats.verify_failed == (url,)
    assert {"retry_start", "retry_transfer"} <= set(stats.seconds)
    assert engine.verify_report()[0]["failed"] is None  # the retry's buckets all passed
    assert _error(url, model) < TOL  # and it loaded the trainer's weights
    assert not engine.is_paused() and engine.weight_version() == "22"
    engine.close()


def test_ipc_refit_refuses_a_bucket_corrupted_on_its_way_and_a_full_refit_recovers(
    ipc_engine, tmp_path, monkeypatch
):
    _a_corrupted_bucket_is_refused_and_sent_again(
        ipc_engine, refit.IPC_BACKEND, IpcChannel, tmp_path, monkeypatch
    )


def test_nccl_refit_refuses_a_bucket_corrupted_on_its_way_and_a_full_refit_recovers(
    nccl_engine, tmp_path, monkeypatch
):
    _a_corrupted_bucket_is_refused_and_sent_again(
        nccl_engine, refit.NCCL_BACKEND, NcclChannel, tmp_path, monkeypatch
    )
