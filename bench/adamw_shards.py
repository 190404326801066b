"""One AdamW step of the actor's sharded parameters: torch's fused AdamW given the DTensors, against
`molt._sharding.ShardAdamW`, the same kernel given their local shards (what the actor steps).

Builds a randomly initialised Qwen3 from its sizes (nothing downloaded; `--model small`, SmolLM2-135M's
sizes as row 1 of bench/peer_trl_gpu.py; `small-host`, its parameters at a tiny width; `dense`,
Qwen3-1.7B's), shards it with FSDP2 (`fully_shard` per decoder layer, then the root) over a world of one
rank, so every parameter is a DTensor as in the actor, gives each a random gradient and times
`optimizer.step()` (median of `--steps` after two untimed ones, the device synchronised around each),
both optimizers over the same parameters in turn. A step of little arithmetic is host time: the table
names the machine, and `x torch` is torch's median over ShardAdamW's, from the same run. Both leave the
same parameters (checked after the timed steps, bit for bit, on copies started alike).

    uv run python bench/adamw_shards.py --model small-host --device cpu
    python bench/adamw_shards.py --model dense --device cuda     # on a GPU machine, molt on PYTHONPATH
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from molt._sharding import ShardAdamW

MODELS = {  # Qwen3 sizes; tied embeddings as the two checkpoints
    "small": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152),
    # small's 30 layers and parameter list with little arithmetic: the host time alone, where a CPU's compute
    # would hide it
    "small-host": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512),
    "dense": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936),
}  # fmt: skip


def sharded_model(name: str, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with device:
        model = Qwen3ForCausalLM(Qwen3Config(**MODELS[name], tie_word_embeddings=True))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def timed_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> list[float]:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    seconds = []
    for _ in range(steps + 2):
        synchronize()
        began = time.perf_counter()
        optimizer.step()
        synchronize()
        seconds.append(time.perf_counter() - began)
    return seconds[2:]  # the first makes the moments


def machine(device: torch.device) -> str:
    cpus = f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    return f"{torch.cuda.get_device_name()}, {cpus}" if device.type == "cuda" else cpus


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        medians, models = {}, {}
        optimizers = {"torch AdamW (DTensors)": torch.optim.AdamW, "ShardAdamW": ShardAdamW}
        for label, optimizer_class in optimizers.items():
            model = sharded_model(args.model, device)
            params = [p for p in model.parameters() if p.requires_grad]
            gen = torch.Generator(device).manual_seed(1)
            for p in params:
                p.grad = DTensor.from_local(
                    torch.randn(p.to_local().shape, generator=gen, device=device), p.device_mesh, p.placements
                )
            optimizer = optimizer_class(params, lr=1e-5, weight_decay=0.01, fused=True)
            medians[label] = statistics.median(timed_steps(optimizer, args.steps, device))
            models[label] = (len(params), [p.full_tensor().cpu() for p in params])
            del model, params, optimizer  # the next one's room on the device
        (count, expected), (_, got) = models.values()
        same = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        where = f"{machine(device)}, torch {torch.__version__}"
        print(f"{args.model}: {count} sharded parameters, one rank; {where}")
        print("| optimizer | step ms (median) | x torch |\n| --- | ---: | ---: |")
        baseline = medians["torch AdamW (DTensors)"]
        for label, seconds in medians.items():
            print(f"| {label} | {1e3 * seconds:.2f} | {baseline / seconds:.2f} |")
        print(f"the same parameters after the steps: {same}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
