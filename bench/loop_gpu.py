"""The whole loop on one GPU (engine and actor sharing it) with Molt's defaults: padded vs packed actor.

Builds a random-initialised model of Qwen3-1.7B's sizes (28 layers, hidden 2048, 16/8 heads of 128,
intermediate 6144, tied embeddings, vocabulary 151,936) with the tiny ChatML tokenizer (ids past the
tokenizer's own are sampled too and decode to nothing; rewards mean nothing here, the cost of a step is
what is measured), in bf16, and runs `molt train` on it for `--steps` steps once per workload and mode:

  workloads (`--workloads`)
  equal    the default recipe (one turn) with replies of up to `--context` - 64 tokens, which random
           weights almost always fill: rows of about `--context` tokens (`--vllm.max_model_len`)
  agentic  bench/agentic_batch.py's ChatAgent: episodes of 1-12 turns, lognormal reply and tool-output
           lengths, about 3.2k tokens a row and at most `--agentic-context` (its `--vllm.max_model_len`).
           Each reply's length is set per request (`max_tokens`; a random policy fills it), each tool
           output is a user turn of random tokens; `--agent.timeout 600`, since an episode waits on the
           engine up to 12 times. (An Env cannot set a reply's length; a ChatAgent can, through tito.)
  modes (`--modes`)
  packed   Molt's defaults: no actor flag at all (packed rows, a token budget sized from free memory,
           `--actor.compile auto`)
  padded   `--actor.pack false`: rows padded to their micro-batch's longest, grouped by length

Every run also gets `--model.dtype bfloat16` (the model as stored; `actor/mfu` is logged for bf16),
`--actor.lr 1e-6`, `--logger.tensorboard false`, `--train.rollout_dump_dir` (the trained rows' tokens,
read back for the batch's size) and the flags after `--`. From steps 2..N it prints the medians of:

- step s: `timing/step_total`;
- engine tokens/s: the engines' own generation rate, the growth of vLLM's Prometheus counter
  `vllm:generation_tokens_total` (summed over engines; `engine_sample` of bench/async_gain.py) between the
  moments two consecutive step lines are printed, over that wall time (a step's wall time). The engines'
  URLs come from the run's `engines ready at URL, ...` line. Beside it, wait s: `timing/generation`, the
  trainer's wait for its groups, which is near 0 when the pool hides generation (so no rate is taken
  over it);
- actor: `timing/policy_train`; tokens/s, the step's rows (prompts and tool outputs included, from the
  dump) over it; MFU, their model FLOPs (6 x parameters + causal attention per token, as
  bench/actor_gpu.py counts them: one forward and one backward; plus a forward, a third of that, where the
  run's `--train.mini_batches` > 1 takes the old logprobs in a pass of their own, as the default 2 does)
  over a bf16 8192^3 matmul measured here; and as the run logged them
  (metrics.jsonl): `actor/tokens_per_s`, `actor/padding_frac`, `actor/mfu` (datasheet peak);
- peak GPU memory of the actor's and of the engine's processes (nvidia-smi, summed per kind, every 0.5 s);
- the groups dropped as stale over the run (`pool/dropped_stale`: long episodes past `--rollout.max_lag`
  are rerun, which costs generation), and in the JSON (`--out`) the refit's seconds by phase;
- compiling steps: the timed steps in which the actor still compiled a graph (`actor/compiles` > 0; their
  actor seconds hold the compile).

Then, per workload, packed over padded. Each run's console goes to `<root>/<workload>-<mode>.log`.

    python bench/loop_gpu.py --workloads agentic --steps 5      # padded and packed, ~8 minutes
    python bench/loop_gpu.py --steps 6                          # both workloads, ~16 minutes

Runs where `molt train` runs with CUDA vLLM (the GPU machine, see README's GPU section).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from async_gain import engine_sample

AGENT = Path(__file__).with_name("agentic_batch.py")
MODES = {"packed": [], "padded": ["--actor.pack", "false"]}
ENGINES_READY = re.compile(r"engines ready at (\S+(?:, \S+)*);")
STEP_LINE = re.compile(r"^step \d+/\d+ \|")
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


def row_flops(n: int) -> float:
    """Model FLOPs of one forward and backward over a row of n tokens: 6 x the matmul parameters per
    token plus causal attention, 6 x layers x n x (heads x head dim) per token (bench/actor_gpu.py)."""
    shape = QWEN3_1_7B
    h, i = shape["hidden_size"], shape["intermediate_size"]
    layers, v = shape["num_hidden_layers"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + v * h  # tied: the LM head is the embedding
    return n * (6 * params + 6 * layers * n * q)


class MemoryWatch(threading.Thread):
    """Peak GPU memory (MiB) of the engine's and the actor's processes, each kind summed, from nvidia-smi
    every 0.5 s (a process is told by its command line: vLLM's, or Ray's `PolicyWorker`)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while shutil.which("nvidia-smi") and not self.stop.wait(0.5):
            used: dict[str, int] = {}
            for line in subprocess.run(query, capture_output=True, text=True).stdout.splitlines():
                pid, mib = (part.strip() for part in line.split(","))
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().lower()
                except OSError:
                    continue
                kind = "engine" if b"vllm" in command else "actor" if b"policyworker" in command else "other"
                used[kind] = used.get(kind, 0) + int(mib)
            for kind, mib in used.items():
                self.peak[kind] = max(self.peak.get(kind, 0), mib)


def train(name: str, flags: list[str], root: Path, env: dict) -> tuple[Path, list, dict[str, int]]:
    """One `molt train` run: its directory, (time, engines' generation tokens) when each step line was
    printed, and the peak GPU memory by process kind."""
    run_dir, log_path = root / name, root / f"{name}.log"
    command = [sys.executable, "-m", "molt", "train", "--logger.run_dir", str(run_dir),
               "--train.rollout_dump_dir", str(run_dir / "rollouts"), *flags]  # fmt: skip
    print(f"{name}: molt {' '.join(command[3:])}", flush=True)
    watch, urls, at_steps = MemoryWatch(), [], []
    watch.start()
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[molt") or STEP_LINE.match(line):  # its progress, as it comes
                print(f"  {name}: {line.rstrip()}", flush=True)
            if ready := ENGINES_READY.search(line):
                urls = [url.rstrip("/") for url in ready[1].split(", ")]
            elif urls and STEP_LINE.match(line):  # printed right after the step's metrics.jsonl line
                with contextlib.suppress(OSError):  # a missed sample: the next rate spans two steps
                    at_steps.append((time.monotonic(), sum(engine_sample(url)[1] for url in urls)))
    watch.stop.set()
    if proc.wait():
        sys.exit(f"molt train ({name}) failed; the end of {log_path}:\n{log_path.read_text()[-5000:]}")
    if not urls:
        print(f"{name}: no `engines ready at` line in {log_path}: no engine rate", flush=True)
    return run_dir, at_steps, watch.peak


def summarise(run_dir: Path, at_steps: list, peak_mib: dict[str, int], peak_tflops: float) -> dict:
    """The medians over steps 2..N of the module docstring's figures."""
    from molt import read_rollouts

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows: dict[int, list[int]] = {}  # each step's row lengths (a rollout's segments are its rows)
    for record in read_rollouts(run_dir / "rollouts"):
        rows.setdefault(record.step, []).extend(len(segment.token_ids) for segment in record.segments)
    timed = steps[1:] or steps

    def med(key: str) -> float | None:
        values = [step[key] for step in timed if key in step]
        return statistics.median(values) if values else None

    engine_rates = [  # the engines' generation tokens over the wall time between two step lines
        (tokens - tokens_before) / (t - t_before)
        for (t_before, tokens_before), (t, tokens) in zip(at_steps, at_steps[1:], strict=False)
        if t > t_before
    ]
    tokens = [sum(rows[step["step"]]) for step in timed]
    config = tomllib.loads((run_dir / "config.toml").read_text())  # the run's resolved flags
    passes = 4 / 3 if config["train"]["mini_batches"] > 1 else 1.0  # an old-logprob forward besides
    flops = [passes * sum(row_flops(n) for n in rows[step["step"]]) for step in timed]
    actor_s = [step["timing/policy_train"] for step in timed]
    peak_flops = peak_tflops * 1e12
    refit = {k.removeprefix("timing/refit_"): med(k) for k in timed[0] if k.startswith("timing/refit_")}
    return {
        "step_s": med("timing/step_total"),
        "engine_tokens_per_s": statistics.median(engine_rates) if engine_rates else None,
        "wait_s": med("timing/generation"),
        "rows": statistics.median(len(rows[step["step"]]) for step in timed),
        "row_tokens_mean": statistics.mean(n for step in timed for n in rows[step["step"]]),
        "row_tokens_max": max(n for step in timed for n in rows[step["step"]]),
        "policy_train_s": statistics.median(actor_s),
        "actor_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, actor_s, strict=True)),
        "actor_mfu": statistics.median(f / s for f, s in zip(flops, actor_s, strict=True)) / peak_flops,
        "logged_tokens_per_s": med("actor/tokens_per_s"),
        "logged_padding_frac": med("actor/padding_frac"),
        "logged_mfu": med("actor/mfu"),
        "actor_peak_gib": peak_mib.get("actor", 0) / 1024,
        "engine_peak_gib": peak_mib.get("engine", 0) / 1024,
        "dropped_stale": timed[-1].get("pool/dropped_stale"),
        "compiling_steps": sum(step.get("actor/compiles", 0) > 0 for step in timed),
        "turns": med("rollout/turns"),
        "refit_s": refit,
    }


def print_table(reports: dict[str, dict], machine: str) -> None:
    print(f"\n{machine}")
    print(
        "| run | step s | engine tokens/s | wait s | rows | row tokens | actor s | actor tokens/s | MFU "
        "| logged tokens/s | logged padding | logged MFU | actor GiB | engine GiB | dropped stale "
        "| compiling steps |"
    )
    print("| --- |" + " ---: |" * 15)

    def cell(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for name, r in reports.items():
        cells = [cell(r["step_s"], ".2f"), cell(r["engine_tokens_per_s"], ",.0f"), cell(r["wait_s"], ".2f"),
                 cell(r["rows"], ".0f"), f"{r['row_tokens_mean']:,.0f} (max {r['row_tokens_max']:,})",
                 cell(r["policy_train_s"], ".2f"), cell(r["actor_tokens_per_s"], ",.0f"),
                 cell(r["actor_mfu"], ".1%"), cell(r["logged_tokens_per_s"], ",.0f"),
                 cell(r["logged_padding_frac"], ".1%"), cell(r["logged_mfu"], ".1%"),
                 cell(r["actor_peak_gib"], ".1f"), cell(r["engine_peak_gib"], ".1f"),
                 cell(r["dropped_stale"], ".0f"), cell(r["compiling_steps"], "d")]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")
    for workload in dict.fromkeys(name.split("-")[0] for name in reports):
        packed, padded = reports.get(f"{workload}-packed"), reports.get(f"{workload}-padded")
        if packed and padded:
            speed = packed["actor_tokens_per_s"] / padded["actor_tokens_per_s"]
            print(f"{workload}: packed / padded: steps {padded['step_s'] / packed['step_s']:.2f}x as fast, "
                  f"actor tokens/s {speed:.2f}x")  # fmt: skip


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--workloads", default="equal,agentic", help="comma-separated: equal, agentic")
    parser.add_argument("--modes", default="padded,packed", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--context", type=int, default=4096, help="equal: the rows' length and context")
    parser.add_argument("--agentic-context", type=int, default=16384, help="agentic: the episodes' context")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (the first untimed)")
    parser.add_argument("--prompts", type=int, default=4, help="--rollout.prompts_per_step")
    parser.add_argument("--group", type=int, default=4, help="--rollout.group_size")
    parser.add_argument("--seed", type=int, default=0, help="--train.seed and the agentic turns' seed")
    parser.add_argument("--out", default="", help="also write the reports and every step's metrics here")
    parser.add_argument("--work-dir", default="", help="the runs' directories and logs (default: a new temp)")
    parser.add_argument("extra", nargs="*", help="more molt train flags (after --), for every run")
    args = parser.parse_args()
    import torch

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="loop-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(root, max(args.context, args.agentic_context))
    peak_tflops = matmul_tflops()
    torch.cuda.empty_cache()
    gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    machine = f"{gpus}, torch {torch.__version__}, bf16 matmul {peak_tflops:.0f} TFLOP/s"
    common = ["--model.path", str(model_dir), "--model.dtype", "bfloat16", "--actor.lr", "1e-6",
              "--train.num_steps", str(args.steps), "--train.seed", str(args.seed),
              "--rollout.prompts_per_step", str(args.prompts), "--rollout.group_size", str(args.group),
              "--logger.tensorboard", "false"]  # fmt: skip
    workloads = {
        "equal": [
            "--vllm.max_model_len",
            str(args.context),
            "--rollout.max_new_tokens",
            str(args.context - 64),
        ],
        "agentic": [
            "--agent.module",
            str(AGENT),
            "--agent.timeout",
            "600",
            "--vllm.max_model_len",
            str(args.agentic_context),
            "--rollout.max_new_tokens",
            str(args.agentic_context - 64),
        ],
    }
    env = {**os.environ, "AGENTIC_BATCH": f"{args.agentic_context},{args.seed}"}
    reports, steps = {}, {}
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            name = f"{workload}-{mode}"
            flags = [*common, *workloads[workload], *MODES[mode], *args.extra]
            run_dir, at_steps, peak_mib = train(name, flags, root, env)
            reports[name] = summarise(run_dir, at_steps, peak_mib, peak_tflops)
            steps[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            print(json.dumps({name: reports[name]}), flush=True)
    print_table(reports, machine)
    if args.out:
        everything = {"machine": machine, "reports": reports, "steps": steps}
        Path(args.out).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
