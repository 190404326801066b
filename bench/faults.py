"""Faults a run must survive, on this machine with the real parts (vLLM CPU engines, Ray, gloo).

    uv run --no-sync python bench/faults.py engine-kill   # one of two attached engines dies mid-run
    uv run --no-sync python bench/faults.py engine-restart  # the run's own engine dies; molt restarts it
    uv run --no-sync python bench/faults.py run-kill      # the whole run dies; --resume continues it

engine-kill: two vLLM servers serve one run (attached with `--vllm.urls`; replies of up to 48 tokens, so
that requests are in flight on both). Once step `--kill-after` is logged, one server's whole process
group gets SIGKILL. The run must still log every step: the rollouts
that engine was serving fail (`agent/engine_unavailable`), their groups are retried on the other engine,
and the next refit drops the dead one (`engines/alive` 2 -> 1).

engine-restart: a run starts its own engine (molt can restart only engines it started); once step
`--kill-after` is logged, the engine's server gets SIGKILL. molt restarts it, refits it with the current
weights and the run goes on. Time to recover = from the kill to the first step logged with the engine
back (`engines/restarts` 1, `engines/alive` 1); the engine's own start-up, from its log's first to last
line before it answered, is printed beside it.

run-kill: a run with its own engine and `--ckpt.every C` is killed with SIGKILL to its whole process
session once step `--kill-after` is logged; `molt train --resume` then continues from the newest
checkpoint. Steps lost = steps logged before the kill - the checkpoint's step (at most C - 1 when the kill
comes right after a step). Processes of the killed run still alive 10 s after the kill are counted.
Prints one line per figure and exits non-zero when the run did not survive.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

_SCRIPT = Path(sys.executable).parent / "molt"  # the console script, as a user runs it, where installed
MOLT = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "molt"]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return f"{cpu}, {os.cpu_count()} cores"


def steps_logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int) -> None:
    while not any(s["step"] >= step for s in steps_logged(run_dir)):
        if process.poll() is not None:
            raise SystemExit(f"the run exited ({process.returncode}) before step {step}; see {run_dir}")
        time.sleep(0.2)


def start_run(args: list[str], log: Path) -> subprocess.Popen:
    """`molt ARGS` in its own session (so that one signal reaches every process it starts)."""
    out = log.open("w")
    return subprocess.Popen([*MOLT, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def engine_kill(work: Path, model_dir: Path, opts) -> bool:
    from molt._engines import engine_extra_args
    from molt.config import Config
    from molt.vllm_server import VLLMServer

    flags = engine_extra_args(Config())
    run_dir = work / "engine-kill"
    with (
        VLLMServer(model_dir, extra_args=flags, log_path=work / "engine-a.log") as keep,
        VLLMServer(model_dir, extra_args=flags, log_path=work / "engine-b.log") as victim,
    ):
        run = start_run([
            "train", "--model.path", str(model_dir), "--vllm.urls", f"{keep.url},{victim.url}",
            "--logger.run_dir", str(run_dir), "--train.num_steps", str(opts.steps),
            "--rollout.prompts_per_step", "4", "--rollout.group_size", "4", "--ray.num_cpus", "2",
            "--rollout.max_new_tokens", "48", "--logger.tensorboard", "false",
        ], work / "engine-kill.log")  # fmt: skip
        wait_for_step(run, run_dir, opts.kill_after)
        os.killpg(victim.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = run.wait()
        print(f"engine-kill: engine {victim.url} killed after step {opts.kill_after}; run exit code {code}")
    steps = steps_logged(run_dir)
    last = steps[-1] if steps else {}
    after_kill = time.monotonic() - killed_at
    print(f"  steps logged: {len(steps)} of {opts.steps}; {after_kill:.0f} s from the kill to the end")
    print(f"  engines/alive per step: {[int(s.get('engines/alive', -1)) for s in steps]}")
    lost = last.get("agent/engine_unavailable")
    print(f"  rollouts lost to the dead engine (agent/engine_unavailable): {lost}")
    print(f"  single rollouts retried (pool/retried): {last.get('pool/retried')}")
    print(f"  groups dropped after failing every retry (pool/failed): {last.get('pool/failed')}")
    print(f"  reward_mean per step: {[round(s['rollout/reward_mean'], 3) for s in steps]}")
    return code == 0 and len(steps) == opts.steps and last.get("engines/alive") == 1.0


def engine_pid(marker: str) -> int:
    """The vLLM server whose command line holds `marker` (the run's own model directory)."""
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if entry.name.isdigit() and marker in args and "molt.vllm_server" in args:
            return int(entry.name)
    raise SystemExit(f"no vLLM server of {marker} is running")


def engine_restart(work: Path, model_dir: Path, opts) -> bool:
    own_model = shutil.copytree(model_dir, work / "restart-model")  # marks this run's engine
    run_dir = work / "engine-restart"
    run = start_run([
        "train", "--model.path", str(own_model), "--logger.run_dir", str(run_dir),
        "--train.num_steps", str(opts.steps), "--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
        "--ray.num_cpus", "2", "--rollout.max_new_tokens", "48", "--logger.tensorboard", "false",
    ], work / "engine-restart.log")  # fmt: skip
    wait_for_step(run, run_dir, opts.kill_after)
    os.kill(engine_pid(str(own_model)), signal.SIGKILL)
    killed_at = time.monotonic()
    recovered_s = None
    while run.poll() is None and recovered_s is None:
        if any(
            s.get("engines/restarts") == 1.0 and s.get("engines/alive") == 1.0 for s in steps_logged(run_dir)
        ):
            recovered_s = time.monotonic() - killed_at
        time.sleep(0.1)
    code = run.wait()
    steps = steps_logged(run_dir)
    last = steps[-1] if steps else {}
    print(f"engine-restart: the run's engine killed after step {opts.kill_after}; run exit code {code}")
    if recovered_s is not None:
        print(f"  time to recover (kill -> a step logged with the engine back): {recovered_s:.1f} s")
    log = run_dir / "engine-0.restart-1.log"
    if log.is_file():
        print(f"  of which the engine's own start: {log_span_s(log):.1f} s (its log's first to last line)")
    print(f"  steps logged: {len(steps)} of {opts.steps}; engines/restarts {last.get('engines/restarts')}")
    lost = last.get("agent/engine_unavailable")
    print(f"  rollouts that hit the dead engine (agent/engine_unavailable): {lost}")
    print(f"  groups dropped after failing every retry (pool/failed): {last.get('pool/failed')}")
    return code == 0 and len(steps) == opts.steps and recovered_s is not None


def log_span_s(log: Path) -> float:
    """Seconds between the first and the last timestamped line of a vLLM log (`MM-DD HH:MM:SS`)."""
    import re

    stamps = re.findall(r" \d\d-\d\d (\d\d):(\d\d):(\d\d) ", log.read_text(errors="replace"))
    seconds = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in stamps]
    return (seconds[-1] - seconds[0]) if seconds else float("nan")


def session_processes(session_id: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def run_kill(work: Path, model_dir: Path, opts) -> bool:
    run_dir = work / "run-kill"
    common = ["--train.num_steps", str(opts.steps), "--logger.tensorboard", "false", "--ray.num_cpus", "2"]
    run = start_run([
        "train", "--model.path", str(model_dir), "--logger.run_dir", str(run_dir),
        "--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
        "--ckpt.every", str(opts.ckpt_every), *common,
    ], work / "run-kill.log")  # fmt: skip
    wait_for_step(run, run_dir, opts.kill_after)
    logged = max(s["step"] for s in steps_logged(run_dir))
    before = len(session_processes(run.pid))
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    time.sleep(10)
    left = session_processes(run.pid)
    pointer = run_dir / "checkpoints" / "latest"
    saved = int(pointer.read_text().strip().removeprefix("step_")) if pointer.is_file() else 0
    print(f"run-kill: killed after step {logged} ({before} processes in its session)")
    print(f"  newest checkpoint: step {saved}")
    print(f"  processes of the killed run still alive 10 s later: {len(left)} {[p.name() for p in left]}")
    for process in left:  # do not let them disturb the resumed run
        process.kill()
    started = time.monotonic()
    resumed = subprocess.run(
        [*MOLT, "train", "--resume", str(run_dir), *common], capture_output=True, text=True
    )
    redone = [s["step"] for s in steps_logged(run_dir)][logged:]
    took = time.monotonic() - started
    print(f"  resumed run: exit code {resumed.returncode} in {took:.0f} s; logged steps {redone}")
    print(
        f"  steps lost (trained again after the resume): {logged - saved}  (--ckpt.every {opts.ckpt_every})"
    )
    if resumed.returncode != 0:
        print(resumed.stderr[-3000:])
    return resumed.returncode == 0 and redone == list(range(saved + 1, opts.steps + 1)) and not left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fault", choices=["engine-kill", "engine-restart", "run-kill"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=3, help="kill once this step is logged")
    parser.add_argument("--ckpt-every", type=int, default=2)
    opts = parser.parse_args()
    print(f"machine: {machine()}")
    from molt.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="molt-faults-"))
    model_dir = build_tiny_model(work / "model", seed=0)
    fault = {"engine-kill": engine_kill, "engine-restart": engine_restart, "run-kill": run_kill}[opts.fault]
    survived = fault(work, model_dir, opts)
    if survived:
        shutil.rmtree(work)
    print(f"{opts.fault}: {'survived' if survived else f'FAILED (logs kept in {work})'}")
    sys.exit(0 if survived else 1)


if __name__ == "__main__":
    main()
