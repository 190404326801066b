"""The whole loop on one GPU (engine and actor sharing it): a Qwen3-1.7B-shaped model, step breakdown.

Builds a random-initialised model of Qwen3-1.7B's sizes (28 layers, hidden 2048, 16/8 heads of 128,
intermediate 6144, tied embeddings, vocabulary 151,936) with the tiny ChatML tokenizer (ids past the
tokenizer's own are sampled too and decode to nothing; the copy-word reward then stays near 0, which
changes nothing about the cost of a step), in bf16, and runs `molt train` on it for `--steps` steps at a
context of `--context` tokens: replies of up to context - 64 tokens, which random weights almost always
fill. For each step after the first it reads the run's metrics and prints the medians of:

- generation tokens/s: tokens sampled for the step's groups over `timing/generation`;
- actor tokens/s and MFU: the batch's tokens (prompts included) over `timing/policy_train`, with model
  FLOPs 6 x parameters + causal attention per token (as bench/actor_gpu.py counts them; the logprob
  recomputation forward before the step counts 2 x parameters more), over a bf16 8192^3 matmul measured
  in the same run;
- the refit's seconds by phase (pause, transfer, finish, reset_prefix_cache, resume) over CUDA IPC;
- peak GPU memory of the engine and of the actor processes (nvidia-smi, sampled every second).

    python bench/loop_gpu.py --context 4096 --steps 6

Runs where `molt train` runs with CUDA vLLM (the GPU machine, see README's GPU section).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def build_model(out: Path, context: int) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from molt.tiny import build_tiny_model

    tiny = build_tiny_model(out / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Qwen3Config(**QWEN3_1_7B, max_position_embeddings=max(context, 4096), dtype="bfloat16", **ids)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    return out / "model"


def matmul_tflops() -> float:
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


class MemoryWatch(threading.Thread):
    """Peak used GPU memory per process name (MiB), from nvidia-smi every second."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            for line in subprocess.run(query, capture_output=True, text=True).stdout.splitlines():
                pid, used = (part.strip() for part in line.split(","))
                try:
                    name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3]
                except OSError:
                    continue
                kind = "engine" if b"vllm" in b" ".join(name).lower() else "actor/other"
                self.peak[f"{kind} pid {pid}"] = max(self.peak.get(f"{kind} pid {pid}", 0), int(used))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--out", default="")
    parser.add_argument("extra", nargs="*", help="more molt train flags")
    args = parser.parse_args()
    import torch

    root = Path(tempfile.mkdtemp(prefix="loop-gpu-"))
    model_dir = build_model(root, args.context)
    peak_tflops = matmul_tflops()
    torch.cuda.empty_cache()
    run_dir = root / "run"
    flags = [
        "--model.path", str(model_dir), "--model.dtype", "bfloat16", "--logger.run_dir", str(run_dir),
        "--train.num_steps", str(args.steps), "--vllm.max_model_len", str(args.context),
        "--rollout.max_new_tokens", str(args.context - 64), "--rollout.prompts_per_step", str(args.prompts),
        "--rollout.group_size", str(args.group), "--actor.activation_checkpointing",
        "--actor.micro_batch_size", "1", "--actor.lr", "1e-6", "--logger.tensorboard", "false", *args.extra,
    ]  # fmt: skip
    watch = MemoryWatch()
    watch.start()
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "molt", "train", *flags], capture_output=True, text=True)
    wall = time.monotonic() - began
    watch.stop.set()
    if result.returncode:
        sys.exit(f"molt train failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = steps[1:] or steps
    params = _param_count(QWEN3_1_7B)
    rows = args.prompts * args.group

    def med(key: str) -> float:
        return statistics.median(step[key] for step in timed if key in step)

    gen_tokens = [rows * s["rollout/response_len_mean"] for s in timed]
    batch_tokens = [rows * (s["rollout/response_len_mean"] + 32) for s in timed]  # prompts ~30 tokens
    # 2P forward + 4P backward + 2P for the old logprobs' forward; causal attention at half the context.
    flops_per_token = 8 * params + 6 * QWEN3_1_7B["num_hidden_layers"] * args.context / 2 * 16 * 128
    actor_s = [s["timing/policy_train"] for s in timed]
    gen_rate = [t / s["timing/generation"] for t, s in zip(gen_tokens, timed, strict=True)]
    actor_rate = [t / s for t, s in zip(batch_tokens, actor_s, strict=True)]
    phases = [k for k in timed[0] if k.startswith("timing/refit_")]
    refit = {k.removeprefix("timing/refit_"): round(med(k), 4) for k in phases}
    report = {
        "machine": torch.cuda.get_device_name(), "context": args.context, "steps": args.steps,
        "wall_s": round(wall, 1), "bf16_matmul_tflops": round(peak_tflops, 1),
        "generation_tokens_per_s": statistics.median(gen_rate),
        "actor_tokens_per_s": statistics.median(actor_rate),
        "actor_mfu": statistics.median(actor_rate) * flops_per_token / (peak_tflops * 1e12),
        "step_s": med("timing/step_total"), "generation_s": med("timing/generation"),
        "policy_train_s": med("timing/policy_train"), "response_len_mean": med("rollout/response_len_mean"),
        "mismatch_kl": med("train/mismatch_kl"), "refit_s": refit, "peak_memory_mib": watch.peak,
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"report": report, "steps": steps}, indent=2))


def _param_count(shape: dict) -> int:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    n, v = shape["num_hidden_layers"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return n * per_layer + v * h  # tied embeddings: the LM head is the embedding


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
