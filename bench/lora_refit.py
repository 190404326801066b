"""LoRA against full training, in one run: the actor's memory and the refit's bytes and seconds.

Actor: one policy rank (`molt._actor.PolicyWorker`, gloo, in a process of its own per setting) takes
`--steps` optimizer steps on 8 x 128 tokens, trained whole and with `--rank` adapters on every projection;
it reports the bytes of the trainable parameters (their gradients, freed after each step, take as many),
AdamW's state, the process's peak RSS, and the median step time.
Refit: a real vLLM CPU server per setting, refitted `--rounds` times from a LoRA-wrapped copy of the
model (AutoModel's LinearLoRA, fresh adapter values each round): the full refit sends the merged weights
(`refit.full_params`, what a LoRA run sent before adapter-only sync) into a plain engine, the adapter
refit the adapters alone (`refit.adapter_params`) into an engine serving one LoRA adapter, which swaps it
in place. Both engines run one after the other in the same run. Prints medians and LoRA's ratio.

    uv run --no-sync python bench/lora_refit.py --hidden 1024 --layers 8 --rank 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from tito_overhead import machine

import refit


def _actor(model_dir: str, rank: int, steps: int, out) -> None:
    """One policy rank trains `steps` steps; puts its byte counts, peak RSS and step time on `out`."""
    from molt._actor import PolicyWorker
    from molt._batch import collate
    from molt.config import Actor, Config, LoRA
    from molt.vllm_server import free_port

    config = msgspec.structs.replace(Config(), actor=Actor(lora=LoRA(rank=rank, alpha=2.0 * rank)))
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), model_dir, config)
    generator = torch.Generator().manual_seed(0)
    rows = [
        (torch.randint(5, 100, (128,), generator=generator).tolist(), [0] * 32 + [1] * 96, [-4.0] * 128, adv)
        for adv in (1.0, -1.0) * 4
    ]
    batch = collate(rows, pad_id=0)
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        worker.train_step(batch)
        seconds.append(time.perf_counter() - began)
    trainable = [p for p in worker.model.parameters() if p.requires_grad]
    state = [t for s in worker.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    out.put({
        "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state if t.dim()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(seconds[1:] or seconds),
    })  # fmt: skip
    torch.distributed.destroy_process_group()


def actor_memory(model_dir: Path, rank: int, steps: int) -> dict:
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_actor, args=(str(model_dir), rank, steps, out))
    process.start()
    result = out.get(timeout=1800)
    process.join()
    return result


def _trainer(model_dir: Path, rank: int) -> torch.nn.Module:
    from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules
    from transformers import AutoModelForCausalLM

    from molt._sharding import peft_config
    from molt.config import LoRA

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert apply_lora_to_linear_modules(model, peft_config(LoRA(rank=rank, alpha=2.0 * rank)))
    return model


@torch.no_grad()
def _new_adapters(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.01)


def refits(model_dir: Path, rank: int, rounds: int, *, lora: bool, work: Path) -> dict[str, float]:
    """Median seconds (whole refit, and the engine's own load or swap) and bytes sent per refit."""
    from molt._engines import lora_flags
    from molt._sharding import adapter_config
    from molt.config import LoRA
    from molt.vllm_server import VLLMServer

    adapter = adapter_config(LoRA(rank=rank, alpha=2.0 * rank))
    flags = refit.engine_flags() + (lora_flags(adapter, work / "adapter") if lora else [])
    model = _trainer(model_dir, rank)
    rows: dict[str, list[float]] = {}
    log = work / f"server-{'lora' if lora else 'full'}.log"
    with VLLMServer(model_dir, extra_args=flags, log_path=log) as server:
        engine = refit.Engine(server.url)
        for round_ in range(rounds + 1):  # the first one connects: not counted
            _new_adapters(model, round_)
            params = (refit.adapter_params if lora else refit.full_params)(model)
            began = time.perf_counter()
            stats = refit.update_weights([engine], params, version=round_, lora=adapter if lora else None)
            seconds = time.perf_counter() - began
            worker = engine.worker_timings()[0]  # reload (full) or adapter build and swap (LoRA)
            engine_s = worker["start_s"] + worker["recv_s"] + worker["finish_s"]
            if round_:
                for key, value in (("refit_s", seconds), ("engine_s", engine_s), ("bytes", stats.bytes_sent)):
                    rows.setdefault(key, []).append(value)
        engine.close()
    return {key: statistics.median(values) for key, values in rows.items()}


def main() -> None:
    from molt.tiny import build_tiny_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    model_dir = build_tiny_model(work / "model", hidden_size=args.hidden, num_layers=args.layers)
    actor = {
        name: actor_memory(model_dir, rank, args.steps) for name, rank in (("full", 0), ("lora", args.rank))
    }
    wire = {name: refits(model_dir, args.rank, args.rounds, lora=name == "lora", work=work) for name in actor}

    print(f"machine: {machine()}")
    print(
        f"model: tiny Qwen3 hidden={args.hidden} layers={args.layers} fp32; LoRA rank {args.rank} on all 7 "
        f"projections; actor medians of {args.steps} steps (8 x 128 tokens), refit medians of {args.rounds}"
    )
    print(f"{'':<34} {'full':>12} {'lora':>12} {'lora/full':>10}")
    rows = [
        ("actor: trainable params (MiB)", actor, "trainable_bytes", 2**20),
        ("actor: AdamW state (MiB)", actor, "optimizer_bytes", 2**20),
        ("actor: peak RSS (MiB)", actor, "peak_rss_bytes", 2**20),
        ("actor: step (s)", actor, "step_s", 1),
        ("refit: bytes sent (MiB)", wire, "bytes", 2**20),
        ("refit: pause..resume (s)", wire, "refit_s", 1),
        ("refit: engine receive+load (s)", wire, "engine_s", 1),
    ]  # fmt: skip
    for label, table, key, unit in rows:
        full, lora = table["full"][key] / unit, table["lora"][key] / unit
        print(f"{label:<34} {full:>12.3f} {lora:>12.3f} {lora / full if full else float('nan'):>10.4f}")


if __name__ == "__main__":
    main()
