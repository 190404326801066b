"""Helpers for the refit tests: seeded weight sets, engine requests, and the transformers reference."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

PROMPTS = [
    [5, 17, 33, 60, 2, 41, 41, 9],
    [70, 3, 3, 3, 12, 88, 19, 4, 51, 27, 30],
]


def load_model(model_dir: Path, *, tie: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if tie:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    return model.eval()


def weight_set(tmp_dir: Path, seed: int, *, tie: bool = False, **shape) -> torch.nn.Module:
    """A model of the tiny architecture with fresh seeded weights (a stand-in for a trained policy)."""
    from molt.tiny import build_tiny_model

    return load_model(build_tiny_model(tmp_dir / f"seed{seed}", seed=seed, **shape), tie=tie)


def generate(url: str, token_ids: list[int], max_tokens: int, *, timeout: float = 300) -> dict:
    body = {
        "token_ids": token_ids,
        "sampling_params": {
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    }
    reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=timeout)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return {
        "token_ids": choice["token_ids"],
        "logprobs": [item["logprob"] for item in choice["logprobs"]["content"]],
        "weight_versions": choice["weight_versions"],
    }


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[t] | prefix) under `model` (temperature 1), as the engine reports them."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_logprob_error(url: str, model: torch.nn.Module, *, max_tokens: int = 24, prompts=PROMPTS) -> float:
    """Largest |engine − transformers| logprob over fixed prompts."""
    worst = 0.0
    for prompt in prompts:
        out = generate(url, prompt, max_tokens)
        want = reference_logprobs(model, prompt, out["token_ids"])
        worst = max(worst, float((torch.tensor(out["logprobs"]) - want).abs().max()))
    return worst


def fsdp_refit_rank(rank: int, world_size: int, port: int, model_dir: str, url: str, out: dict) -> None:
    """One FSDP2 trainer rank (gloo, CPU): shard the model, check the gather, refit the engine with one
    byte of bucket 1 corrupted on rank 0's wire (the retry gathers again on every rank)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import refit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = load_model(Path(model_dir))
        reference = {n: p.detach().clone() for n, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = refit.full_params(model)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        for name, full in params:  # every rank gathers; each gets the unsharded values
            assert torch.equal(full, reference[name]), name
        import pytest

        with pytest.MonkeyPatch.context() as monkeypatch:
            if rank == 0:
                CorruptWire(monkeypatch, bucket=1, times=1)
            stats = refit.update_weights([refit.Engine(url)], params, version="fsdp", bucket_bytes=64 << 10)
        out[rank] = None if stats is None else (stats.num_buckets, stats.verify_failed)
    finally:
        dist.destroy_process_group()


class CorruptWire:
    """Test hook on the trainer's end of the wire: flips one byte of bucket `bucket`'s payload after the
    trainer took its checksum, the first `times` times it goes out. `channel`: the channel class whose
    sends it corrupts: `GlooChannel` (the full stream, and a delta stream's patches) or a GPU one
    (`IpcChannel`, `NcclChannel`: the copy it sends lives on the GPU). `hits` counts the corrupted sends.
    Install with `monkeypatch`; the trainer's own bytes stay intact."""

    def __init__(self, monkeypatch, *, bucket: int = 1, times: int = 1, channel=None) -> None:
        from refit._transport import GlooChannel

        kind = channel or GlooChannel
        self.hits, self.kept = 0, []
        send = kind.send

        def corrupt(payload_N: torch.Tensor) -> torch.Tensor:
            self.hits += 1
            copy_N = payload_N.clone()
            copy_N[copy_N.numel() // 2] ^= 0x40
            self.kept.append(copy_N)  # alive until its asynchronous send completes
            return copy_N

        def corrupt_send(channel, index, payload_N, crc):
            if index == bucket and self.hits < times:
                payload_N = corrupt(payload_N)
            return send(channel, index, payload_N, crc)

        monkeypatch.setattr(kind, "send", corrupt_send)
        if kind is not GlooChannel:
            return
        send_all = GlooChannel.send_all

        def corrupt_send_all(channel, payloads):
            table_N3 = payloads[0]  # a delta stream: the table, then the payloads that travel
            travelling = [i for i, (_, num_bytes, _) in enumerate(table_N3.tolist()) if num_bytes]
            if bucket in travelling and self.hits < times:
                payloads = list(payloads)
                at = 1 + travelling.index(bucket)
                payloads[at] = corrupt(payloads[at])
            return send_all(channel, payloads)

        monkeypatch.setattr(GlooChannel, "send_all", corrupt_send_all)


def nudged(model: torch.nn.Module, *, fraction: float, seed: int) -> torch.nn.Module:
    """A copy of `model` with about `fraction` of every parameter's elements moved (a sparse change)."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in out.parameters():
            where = torch.rand(param.shape, generator=gen) < fraction
            param.add_(where * (0.01 + torch.rand(param.shape, generator=gen)))
    return out
