"""Adapter-only refit into a real vLLM CPU server serving one LoRA adapter: the trainer sends its LoRA
adapters alone (`refit.adapter_params`), the engine swaps them in place of the one it serves, and every
token keeps the adapter version that sampled it, also for a request in flight across the refit."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from refit_helpers import PROMPTS, load_model, reference_logprobs

import refit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
TOL = 1e-4  # fp32 engine vs fp32 transformers


def _trainer(model_dir, lora):
    """The tiny policy with AutoModel's LoRA layers on every projection, as `molt._sharding` wraps it."""
    from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules

    from molt._sharding import peft_config

    model = load_model(model_dir)
    assert apply_lora_to_linear_modules(model, peft_config(lora))
    return model.eval()


@torch.no_grad()
def _train(model, seed: int) -> None:
    """Stand-in for training: fresh seeded values in every adapter (B starts at 0: give it some)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def _generate(url: str, prompt: list[int], max_tokens: int, model: str = "policy") -> dict:
    sampling = {"max_tokens": max_tokens, "temperature": 1.0, "seed": 0, "ignore_eos": True, "logprobs": 0}
    body = {"token_ids": prompt, "sampling_params": sampling, "model": model}
    reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=300)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    logprobs = torch.tensor([item["logprob"] for item in choice["logprobs"]["content"]])
    return {"token_ids": choice["token_ids"], "logprobs": logprobs, "versions": choice["weight_versions"]}


def _error(out: dict, model, prompt: list[int], part: slice = slice(None)) -> float:
    want = reference_logprobs(model, prompt, out["token_ids"])
    return (out["logprobs"][part] - want[part]).abs().max().item()


@pytest.fixture(scope="module")
def lora_server(refit_servers, tiny_model_dir, tmp_path_factory):
    from molt._engines import lora_flags
    from molt._sharding import adapter_config
    from molt.config import LoRA
    from molt.vllm_server import VLLMServer

    refit_servers.stop()  # one vLLM server at a time on this machine
    lora = LoRA(rank=4, alpha=8.0)
    folder = tmp_path_factory.mktemp("lora-engine")
    flags = refit.engine_flags() + lora_flags(adapter_config(lora), folder / "adapter")
    with VLLMServer(tiny_model_dir, extra_args=flags, log_path=folder / "server.log") as server:
        yield server, lora


def test_adapter_refits_serve_the_trainers_adapter_and_version_every_token(lora_server, tiny_model_dir):
    from molt._sharding import adapter_config

    server, lora = lora_server
    engine = refit.Engine(server.url)
    trainer = _trainer(tiny_model_dir, lora)
    base = load_model(tiny_model_dir)
    assert _error(_generate(server.url, PROMPTS[0], 8), base, PROMPTS[0]) < TOL  # no tensors yet: the base

    _train(trainer, seed=1)
    stats = refit.update_weights(
        [engine], refit.adapter_params(trainer), version=1, lora=adapter_config(lora), bucket_bytes=16 << 10
    )
    assert stats.num_buckets > 1  # the adapter's buckets each verified and gathered before the swap
    assert stats.bytes_sent == sum(p.numel() * 4 for n, p in trainer.named_parameters() if ".lora_" in n)
    for prompt in PROMPTS:
        out = _generate(server.url, prompt, 8)
        assert out["versions"] == [{"version": "1", "start": 0, "end": 8}]
        assert _error(out, trainer, prompt) < TOL
    assert _error(_generate(server.url, PROMPTS[0], 8, model=str(tiny_model_dir)), base, PROMPTS[0]) < TOL

    # A request in flight across the next refit: its tokens before the swap come from adapter 1, after
    # it from adapter 2, and each carries that version.
    old = {name: param.clone() for name, param in trainer.state_dict().items()}
    result = {}
    request = threading.Thread(target=lambda: result.update(_generate(server.url, PROMPTS[1], 1500)))
    request.start()
    time.sleep(2.0)  # let it sample a few hundred tokens first
    _train(trainer, seed=2)
    refit.update_weights([engine], refit.adapter_params(trainer), version=2, lora=adapter_config(lora))
    request.join(timeout=300)
    spans = result["versions"]
    assert [span["version"] for span in spans] == ["1", "2"], spans
    switch = spans[1]["start"]
    assert 0 < switch < 1500 and spans[1]["end"] == 1500
    assert _error(result, trainer, PROMPTS[1], slice(switch, None)) < TOL
    trainer.load_state_dict(old)
    assert _error(result, trainer, PROMPTS[1], slice(0, switch)) < TOL
    engine.close()


def test_full_weights_into_a_lora_engine_are_refused_and_the_adapter_stays(lora_server, tiny_model_dir):
    server, _ = lora_server
    engine = refit.Engine(server.url)
    before = _generate(server.url, PROMPTS[0], 8)
    with pytest.raises(refit.RefitError, match="takes adapter refits only"):
        refit.update_weights([engine], refit.full_params(load_model(tiny_model_dir)), version="full")
    engine.resume()  # the trainer keeps a failed engine paused; nothing was touched
    after = _generate(server.url, PROMPTS[0], 8)
    assert after["token_ids"] == before["token_ids"] and after["versions"] == before["versions"]
    engine.close()
