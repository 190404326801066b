"""How long `molt train` takes to its first step, by stage, against a bare vLLM server start in the same run.

Each round first starts one vLLM server alone (the baseline: the same tiny model and engine flags as a
run's engine, `molt.vllm_server.VLLMServer` to `/health`), then runs `molt train --train.num_steps 1`
(the default recipe, a fresh run directory) and reads step 1's `timing/startup_*` metrics, which count
from the command's own start. The wall time is measured here too, from launching the command to its
exit. Rounds run one after another; the median of each column is printed with the machine's name.

    uv run --no-sync python bench/startup.py [--rounds 3]

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
    with open("/proc/cpuinfo") as info:
        name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    return f"{name}, {os.cpu_count()} cores ({platform.machine()})"


def bare_engine(model_dir: Path, log: Path) -> float:
    """Seconds from starting a vLLM server with a run's engine flags to its first `/health`."""
    from molt._engines import engine_extra_args
    from molt.config import Config
    from molt.vllm_server import VLLMServer

    started = time.monotonic()
    with VLLMServer(model_dir, extra_args=engine_extra_args(Config()), log_path=log):
        return time.monotonic() - started


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
    args = parser.parse_args()
    from molt.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        for index in range(args.rounds):
            engine_s = bare_engine(model_dir, Path(tmp) / f"bare-{index}.log")
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
