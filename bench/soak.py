"""A soak of the default recipe: does any process of a `molt train` run grow in memory, step after step?

`molt train --train.num_steps S+1` (no algorithm flags: the default recipe) runs as a subprocess in its
own session, and steps 1..S are sampled (a sample of the last step would race with the run's shutdown).
After every step (the run appends one line to `metrics.jsonl` per step; it is polled every 0.2 s) the
resident set size (RSS) of every process of the run is read with psutil and summed per part:

  driver                the `molt train` process (the loop, tito, the pool)
  vllm:<name>           the vLLM server (`api_server`) and its children, by title (`EngineCore`)
  ray:<Class>           Ray workers, by the title Ray gives them: `PolicyWorker` (the actor),
                        `AgentHost` (the agent hosts), `EngineActor` (the engine's owner), `IDLE`
  ray-system:<name>     Ray's own processes: gcs_server, raylet, dashboard, log_monitor, autoscaler,
                        DashboardAgent, RuntimeEnvAgent
  other                 anything else of the run

A process belongs to the run if it descends from the driver (psutil's children, recursively: Ray's
daemons are the driver's children, its workers and agents the raylet's, the vLLM server its engine
actor's, though the server runs in a session of its own), or if its environment carries this soak's
random tag (`MOLT_SOAK_TAG`, set for the driver and inherited by what it starts; Ray's two agents do
not show it), which still finds a process whose parent died and that was re-parented to init. RSS
counts shared pages (torch's libraries, say) once per process, so the total overstates the machine's
memory in use; the trend is what is measured.

Each sample is a row `step,seconds,part,num_processes,rss_mib` per part, and one `total` row, of
`<run dir>/rss.csv` (seconds since the command started); the run's own output goes to `train.log` there.
At the end, a least-squares line of total RSS against step is fitted over the second half of the
steps (the first half is warm-up: allocator pools, caches and compiled kernels fill up there), and
the same per part. Verdict: "growth" when the slope is above twice its standard error (from the fit's
residuals; consecutive samples are correlated, so this error is if anything too small and the test
leans towards reporting growth), "no growth trend" otherwise. The size of the slope is printed either
way, in MiB per 100 steps and relative to the mean total RSS of the second half. Usage:

    uv run --no-sync python bench/soak.py [--steps 200] [--run-dir DIR] [-- EXTRA MOLT TRAIN FLAGS]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
from tito_overhead import machine

TAG = "MOLT_SOAK_TAG"
MIB = 1024 * 1024
RAY_AGENTS = ("DashboardAgent", "RuntimeEnvAgent")  # titled like workers, but Ray's own
RAY_DAEMONS = {  # a piece of the command line: the name
    "gcs_server": "gcs_server",
    "raylet/raylet": "raylet",
    "dashboard/dashboard.py": "dashboard",
    "log_monitor.py": "log_monitor",
    "autoscaler/_private/monitor.py": "autoscaler",
}


def run_processes(driver: psutil.Process, tag: str) -> list[psutil.Process]:
    """The run's live processes: the driver, its descendants, and any process carrying the tag."""
    found = {driver.pid: driver}
    with contextlib.suppress(psutil.NoSuchProcess):  # the run just ended
        found.update((child.pid, child) for child in driver.children(recursive=True))
    for process in psutil.process_iter():
        if process.pid in found:
            continue
        try:
            if process.environ().get(TAG) == tag:
                found[process.pid] = process
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # another user's process, or one that just ended
    return list(found.values())


def part_of(process: psutil.Process, driver_pid: int, vllm_pids: set[int]) -> str:
    title = " ".join(process.cmdline())  # a process that set its title (Ray, vLLM) shows it here
    if process.pid == driver_pid:
        return "driver"
    if process.pid in vllm_pids:
        if title.startswith("VLLM::"):
            return "vllm:" + title[len("VLLM::") :].split()[0]
        return "vllm:api_server" if "molt.vllm_server" in title else "vllm:other"
    if title.startswith("ray::"):
        name = title[len("ray::") :].split(".")[0].split()[0]
        return f"ray-system:{name}" if name in RAY_AGENTS else f"ray:{name}"
    daemon = next((name for piece, name in RAY_DAEMONS.items() if piece in title), None)
    return f"ray-system:{daemon}" if daemon else "other"


def sample(driver: psutil.Process, tag: str) -> dict[str, tuple[int, float]]:
    """Per part: (number of processes, RSS in MiB), and the same for "total"."""
    processes = run_processes(driver, tag)
    vllm_pids: set[int] = set()
    for process in processes:
        try:
            if "molt.vllm_server" in " ".join(process.cmdline()):
                vllm_pids |= {process.pid, *(c.pid for c in process.children(recursive=True))}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    parts: dict[str, list[float]] = defaultdict(list)
    for process in processes:
        try:
            parts[part_of(process, driver.pid, vllm_pids)].append(process.memory_info().rss / MIB)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    result = {part: (len(rss), sum(rss)) for part, rss in sorted(parts.items())}
    result["total"] = (sum(n for n, _ in result.values()), sum(r for _, r in result.values()))
    return result


def fit(steps: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares slope of `values` against `steps`, and its standard error."""
    n, mean_x, mean_y = len(steps), statistics.fmean(steps), statistics.fmean(values)
    sxx = sum((x - mean_x) ** 2 for x in steps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values, strict=True)) / sxx
    residuals = [y - mean_y - slope * (x - mean_x) for x, y in zip(steps, values, strict=True)]
    stderr = (sum(r * r for r in residuals) / (n - 2) / sxx) ** 0.5 if n > 2 else float("inf")
    return slope, stderr


def soak(args, run_dir: Path, tag: str) -> list[dict]:
    """Start the run, sample after every step until it exits; the samples."""
    molt = Path(sys.executable).with_name("molt")
    # One step more than sampled: the last step's sample would race with the run's shutdown (a sample
    # taken while the engine exits reads as a fall).
    steps = str(args.steps + 1)
    command = [str(molt), "train", "--train.num_steps", steps, "--logger.run_dir", str(run_dir)]
    command += args.extra
    print(f"command: {' '.join(command)}", flush=True)
    metrics = run_dir / "metrics.jsonl"
    log = (run_dir / "train.log").open("wb")
    began = time.monotonic()
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, TAG: tag}, start_new_session=True
    )
    driver = psutil.Process(process.pid)
    samples, seen = [], 0
    try:
        while process.poll() is None:
            time.sleep(0.2)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            complete = [line for line in lines[seen:] if line.endswith("}")]
            if not complete:
                continue
            seen += len(complete)
            step = json.loads(complete[-1])["step"]  # steps that ended between two polls share a sample
            if step > args.steps:
                continue
            samples.append({"step": step, "seconds": time.monotonic() - began, "parts": sample(driver, tag)})
            if step == 1 or step % args.print_every == 0:
                print(f"step {step}: {grouped(samples[-1]['parts'])}", flush=True)
    except KeyboardInterrupt:
        os.kill(process.pid, signal.SIGINT)  # molt's own shutdown stops Ray and the engines
        process.wait()
        raise
    log.close()
    if process.returncode != 0:
        sys.exit(f"molt train exited with {process.returncode}; its output is in {log.name}")
    return samples


def grouped(parts: dict[str, tuple[int, float]]) -> str:
    """One sample in a line: the total and each group of parts (driver, vllm, ray, ray-system, other)."""
    groups: dict[str, float] = defaultdict(float)
    for part, (_, rss) in parts.items():
        if part != "total":
            groups[part.split(":")[0]] += rss
    return (
        f"total {parts['total'][1]:.0f} MiB ("
        + ", ".join(f"{g} {rss:.0f}" for g, rss in groups.items())
        + ")"
    )


def report(samples: list[dict], run_dir: Path, args) -> None:
    with (run_dir / "rss.csv").open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["step", "seconds", "part", "num_processes", "rss_mib"])
        for entry in samples:
            for part, (count, rss) in entry["parts"].items():
                writer.writerow([entry["step"], f"{entry['seconds']:.1f}", part, count, f"{rss:.1f}"])
    steps = [entry["step"] for entry in samples]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_seconds = [m["timing/step_total"] for m in metrics[1:]]
    print(
        f"\nsteps {steps[-1]}, samples {len(samples)}, {statistics.fmean(step_seconds):.1f} s per step after "
        f"the first, {samples[-1]['seconds'] / 60:.1f} min in all; samples in {run_dir / 'rss.csv'}"
    )
    half = [entry for entry in samples if entry["step"] > steps[-1] / 2]
    if len(half) < 3:
        sys.exit("too few steps in the second half to fit a slope; run more steps")
    half_steps = [entry["step"] for entry in half]
    parts = sorted({part for entry in half for part in entry["parts"]}, key=lambda p: (p == "total", p))
    print(f"second half (steps {half_steps[0]}-{half_steps[-1]}, {len(half)} samples), RSS in MiB:")
    print(
        f"  {'part':<28}{'procs':>6}{'first':>8}{'last':>8}{'mean':>8}{'slope /100 steps':>18}{'± 2 SE':>9}"
    )
    for part in parts:
        rows = [(entry["step"], entry["parts"][part]) for entry in half if part in entry["parts"]]
        if len(rows) < 3:
            continue
        values = [rss for _, (_, rss) in rows]
        mean, (slope, stderr) = statistics.fmean(values), fit([step for step, _ in rows], values)
        print(
            f"  {part:<28}{rows[-1][1][0]:>6}{values[0]:>8.0f}{values[-1]:>8.0f}{mean:>8.0f}"
            f"{100 * slope:>+18.1f}{200 * stderr:>9.1f}"
        )
    totals = [entry["parts"]["total"][1] for entry in half]
    slope, stderr = fit(half_steps, totals)
    percent = 100 * (100 * slope) / statistics.fmean(totals)  # growth per 100 steps, % of the mean
    growth = slope > 2 * stderr
    verdict = "growth" if growth else "no growth trend"
    print(
        f"total RSS slope over the second half: {100 * slope:+.1f} MiB per 100 steps "
        f"(± {200 * stderr:.1f} at 2 standard errors), {percent:+.2f}% of the mean per 100 steps\n"
        f"verdict: {verdict} ({'above' if growth else 'within'} twice the slope's standard error)"
    )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--steps", type=int, default=200, help="--train.num_steps of the run")
    parser.add_argument("--run-dir", type=Path, help="the run's directory (default runs/soak-<UTC time>)")
    parser.add_argument("--print-every", type=int, default=10, help="print a sample every N steps")
    parser.add_argument("extra", nargs="*", help="more `molt train` flags, after --")
    args = parser.parse_args()
    run_dir = args.run_dir or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S", time.gmtime())
    if run_dir.exists():
        sys.exit(f"{run_dir} exists; choose another --run-dir")
    run_dir.mkdir(parents=True)
    print(f"machine: {machine()}; {psutil.virtual_memory().total / 2**30:.1f} GiB memory")
    samples = soak(args, run_dir, secrets.token_hex(8))
    report(samples, run_dir, args)


if __name__ == "__main__":
    main()
