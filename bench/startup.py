"""How long `molt train` takes to its first step, by stage, against a bare vLLM server start in the same run.

Each round first starts one vLLM server alone (the baseline: the same tiny model and engine flags as a
run's engine, `molt.vllm_server.VLLMServer` to `/health`), then runs `molt train --train.num_steps 1`
(the default recipe, a fresh run directory) and reads step 1's `timing/startup_*` metrics, which count
from the command's own start. The wall time is measured here too, from launching the command to its
exit. Rounds run one after another; the median of each column is printed with the machine's name.

    uv run --no-sync python bench/startup.py [--rounds 3]

`--engines` times the engine alone instead, two ways in alternating rounds: as Molt starts it
(`molt.vllm_server`, which imports vLLM's server without starting CUDA, so that on a GPU vLLM forks its
engine core from the server) against vLLM's own server module with its command line's start method
(`spawn`: the core a fresh interpreter that imports vLLM again). It prints each one's median seconds to
`/health`, their ratio, and whether vLLM said it had to spawn (CUDA started in the server); a first start,
not timed, fills vLLM's compile cache for both. On a CPU vLLM's platform spawns both. `--model DIR`
starts that model instead of the seeded tiny one:

    python3 bench/startup.py --engines --model MODEL_DIR --rounds 3     # on a GPU machine

On a shared machine the numbers say as much about the neighbours as about molt: run it on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOLT = str(Path(sys.executable).parent / "molt")


def machine() -> str:
    import torch

    with open("/proc/cpuinfo") as info:
        name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    gpu = f"{torch.cuda.get_device_name(0)}; " if torch.cuda.is_available() else ""
    return f"{gpu}{name}, {os.cpu_count()} cores ({platform.machine()})"


def engine_start(model_dir: Path, log: Path, *, entry: str) -> tuple[float, bool]:
    """Seconds from starting one engine's server (a run's engine flags) to its first `/health`, and
    whether vLLM logged that it had to spawn its core. `entry`: "molt" as Molt's engines start it,
    "vllm" as `python -m vllm.entrypoints.openai.api_server` with its command line's `spawn`."""
    from molt._engines import engine_extra_args
    from molt.config import Config
    from molt.vllm_server import VLLMServer

    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if entry == "vllm" else None
    server = VLLMServer(model_dir, extra_args=engine_extra_args(Config(), model_dir), log_path=log, env=env)
    if entry == "vllm":
        server.args[server.args.index("molt.vllm_server")] = "vllm.entrypoints.openai.api_server"
    started = time.monotonic()
    with server:
        seconds = time.monotonic() - started
    return seconds, "We must use the `spawn` multiprocessing start method" in log.read_text(errors="replace")


def engines(model_dir: Path, rounds: int, tmp: Path) -> None:
    """`--engines`: vLLM's server and Molt's start of it, alternating, `rounds` each, after one start not
    timed: it fills vLLM's compile cache for this model, which both ways then load (otherwise the first
    timed start, vLLM's, would compile and the rest load)."""
    seconds: dict[str, list[float]] = {"vllm": [], "molt": []}
    took, _ = engine_start(model_dir, tmp / "untimed.log", entry="molt")
    print(f"untimed start (vLLM's compile cache filled): /health after {took:.1f} s", flush=True)
    for index in range(rounds):
        for entry in seconds:
            took, forced = engine_start(model_dir, tmp / f"{entry}-{index}.log", entry=entry)
            seconds[entry].append(took)
            print(f"round {index + 1} {entry}: /health after {took:.1f} s; spawn forced {forced}", flush=True)
    vllm, molt = (statistics.median(seconds[entry]) for entry in ("vllm", "molt"))
    print(f"\nmachine: {machine()}; model {model_dir}; {rounds} rounds each, medians:")
    print(f"  vLLM's server (spawned core)   {vllm:6.1f} s")
    print(f"  molt.vllm_server               {molt:6.1f} s   ({vllm / molt:.2f}x as fast)")


def one_run(workdir: Path) -> dict[str, float]:
    run_dir = workdir / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    subprocess.run([MOLT, "train", "--train.num_steps", "1", "--logger.run_dir", str(run_dir)], cwd=workdir,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)  # fmt: skip
    wall = time.monotonic() - started
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    stages = {
        k.removeprefix("timing/startup_"): v for k, v in step.items() if k.startswith("timing/startup_")
    }
    return {**stages, "command_wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", action="store_true", help="the engine's start alone, two ways")
    parser.add_argument("--model", type=Path, help="--engines: this model (the seeded tiny one by default)")
    args = parser.parse_args()
    from molt.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "model")
        if args.engines:
            return engines(model_dir, args.rounds, Path(tmp))
        for index in range(args.rounds):
            engine_s, _ = engine_start(model_dir, Path(tmp) / f"bare-{index}.log", entry="molt")
            run = one_run(Path(tmp) / f"round-{index}")
            rows.append({"bare_engine": engine_s, **run})
            print(
                f"round {index + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in rows[-1].items()), flush=True
            )
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(f"\nmachine: {machine()}; {args.rounds} rounds, medians:")
    for key, value in median.items():
        print(f"  {key:<16} {value:6.1f} s")
    total, bare = median["total"], median["bare_engine"]
    print(f"step 1 after {total:.1f} s = {total / bare:.2f}x a bare vLLM server's start ({bare:.1f} s)")


if __name__ == "__main__":
    main()
