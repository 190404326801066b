"""Refit into a real CUDA vLLM engine on the trainer's own GPU, through vLLM's CUDA IPC weight transfer
(`refit.IPC_BACKEND`), and the prefix cache across a refit. GPU machine only: the IPC backend is CUDA's."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

import refit

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
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
    assert _error(url, start) < TOL
    hits = _prefix_cache_hits(url)
    _sample(url, LONG_PROMPT)
    assert _prefix_cache_hits(url) > hits, "the long prompt should be served from the prefix cache"
    for seed in (11, 12):
        model = _weights(tmp_path, seed)
        assert _error(url, model) > 5 * TOL  # the engine still serves other weights
        stats = refit.update_weights([engine], refit.full_params(model), version=seed, bucket_bytes=64 << 10)
        assert stats.num_buckets > 1 and set(stats.seconds) >= {"pause", "transfer", "finish", "resume"}
        # LONG_PROMPT was cached under the old weights: it must be recomputed, not served from stale KV.
        assert _error(url, model) < TOL
        assert not engine.is_paused()
    engine.close()
