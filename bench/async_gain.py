"""What asynchrony buys: one recipe trained synchronously and asynchronously, in one run of this script.

The agent (`bench/async_gain_agent.py`) is a ChatAgent on the openai SDK: two chat turns with a tool
call between them that takes a lognormal time (sigma 1, mean `--tool-mean-s`, seeded; the default 1 s is
about what a turn takes the SDK on the 2-core CPU in the sync run). The script runs `molt train` once per
mode (`--modes`, default `sync,async`) as subprocesses, one after the other, with the same flags but:

  sync    `--train.force_on_policy`: one step of groups in flight, max lag 0, no partial rollout; the
          engine generates a batch, waits for its slowest tool call, then waits for training and refit
  async   molt's defaults: 2 x prompts per step groups in flight, max lag 1, partial rollout
  async-lag2  the defaults with `--rollout.max_lag 2` (`--modes sync,async,async-lag2`): the pool
          admits a group only when it can be trained within max lag, so with max lag 1 the engine gets
          one step of groups while the actor trains; max lag 2 lets it run further ahead

and reports for each, from steps 2..N (step 1 carries the start-up; the run's start-up and shutdown are
outside every figure):

  steps/hour      3600 x (N - 1) / the sum of `timing/step_total` over steps 2..N (metrics.jsonl;
                  a step's clock runs from waiting for its groups to after its log line, so the sum is
                  the wall time of those steps)
  engine idle     the share of samples of the engines' Prometheus `/metrics` (every `--sample-s`, from
                  the moment step 1 is logged to the moment step N is) at which an engine had no
                  request running (`vllm:num_requests_running` == 0), averaged over engines
  no-token        the share of sampling intervals in which an engine's `vllm:generation_tokens_total` did
                  not grow: idle as above, or paused for a refit with requests kept
  final reward    the mean reward of the samples trained on over the last K steps
  run cores       CPU seconds of the run's processes (`molt train` and every descendant: Ray, the
                  engine, the actor, the agent host) per wall second over the same window, and the
                  machine's busy cores (every process, other users' included): whether the CPU, not
                  the engine, is what a step waits for

It prints the ratio of each mode's steps per hour to sync's, and the stages (medians of `timing/*`), the
staleness, the groups dropped as stale, the share of generated tokens never trained (`pool/wasted_frac`
at step N) and the agents' own turn and tool times beside them, which say where a gap comes from. Flags
after `--` go to every run (larger batches and replies on a GPU).

    uv run python bench/async_gain.py                        # CPU, the tiny model, 20 steps each
    uv run python bench/async_gain.py --modes sync,async,async-lag2 --steps 30 -- --rollout.max_new_tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from tito_overhead import machine

AGENT = Path(__file__).with_name("async_gain_agent.py")
STAGES = ("step_total", "generation", "policy_train", "broadcast")
MODES = {"sync": ["--train.force_on_policy"], "async": [], "async-lag2": ["--rollout.max_lag", "2"]}
_GAUGE = re.compile(r"^(vllm:num_requests_running|vllm:generation_tokens_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


@dataclass
class Run:
    """One mode's figures (module docstring)."""

    steps_per_hour: float
    engine_idle: float
    no_token: float
    run_cores: float
    machine_cores: float
    final_reward: float
    stages: dict[str, float]
    notes: dict[str, float]


def engine_sample(url: str) -> tuple[float, float]:
    """(requests running, generation tokens so far) from one engine's Prometheus text."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {"vllm:num_requests_running": 0.0, "vllm:generation_tokens_total": 0.0}
    for line in text.splitlines():
        if match := _GAUGE.match(line):
            values[match[1]] += float(match[2])  # summed over label sets (one per engine core)
    return values["vllm:num_requests_running"], values["vllm:generation_tokens_total"]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) so far of a process and all its living descendants."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, every process)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class Sampler(threading.Thread):
    """Polls every engine's /metrics and the run's metrics.jsonl; keeps (time, per-engine samples), and
    the time, the run's CPU seconds and the machine's busy seconds when each step's line appeared."""

    def __init__(self, urls: list[str], metrics_path: Path, every_s: float, pid: int) -> None:
        super().__init__(daemon=True)
        self.urls, self.metrics_path, self.every_s, self.pid = urls, metrics_path, every_s, pid
        self.samples: list[tuple[float, list[tuple[float, float]]]] = []
        self.step_times: list[float] = []
        self.step_cpu: list[tuple[float, float]] = []  # (run's CPU s, machine's busy s) at each step line
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            now = time.monotonic()
            try:
                self.samples.append((now, [engine_sample(url) for url in self.urls]))
            except OSError:  # the run is shutting down its engines
                break
            if self.metrics_path.exists():
                new = self.metrics_path.read_text().count("\n") - len(self.step_times)
                if new:
                    self.step_times += [now] * new
                    self.step_cpu += [(tree_cpu_s(self.pid), machine_busy_s())] * new

    def idle(self) -> tuple[float, float]:
        """(engine idle, no-token) shares between the first and the last logged step (module docstring)."""
        began, ended = self.step_times[0], self.step_times[-1]
        window = [engines for t, engines in self.samples if began <= t <= ended]
        assert len(window) >= 2, "too few samples: lower --sample-s or raise --steps"
        num = len(self.urls)
        idle = statistics.mean(sum(running == 0 for running, _ in engines) / num for engines in window)
        no_token = statistics.mean(
            sum(after[1] <= before[1] for before, after in zip(earlier, later, strict=True)) / num
            for earlier, later in zip(window[:-1], window[1:], strict=True)
        )
        return idle, no_token

    def cores(self) -> tuple[float, float]:
        """(the run's, the machine's) busy cores between the first and the last logged step."""
        wall = self.step_times[-1] - self.step_times[0]
        (run_0, machine_0), (run_1, machine_1) = self.step_cpu[0], self.step_cpu[-1]
        return (run_1 - run_0) / wall, (machine_1 - machine_0) / wall


def run_mode(mode: str, args: argparse.Namespace, work: Path, extra: list[str]) -> Run:
    run_dir = work / mode
    command = [
        sys.executable, "-m", "molt", "train",
        "--agent.module", str(AGENT),
        "--train.num_steps", str(args.steps),
        "--train.seed", str(args.seed),
        "--logger.run_dir", str(run_dir),
        *(["--model.path", args.model] if args.model else []),
        *MODES[mode], *extra,
    ]  # fmt: skip
    env = {**os.environ, "ASYNC_GAIN_TOOL": f"{args.tool_mean_s},{args.tool_sigma},{args.seed}"}
    print(f"{mode}: molt {' '.join(command[3:])}  (load average {load()})", flush=True)
    sampler = None
    with (work / f"{mode}.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if sampler is None and (ready := re.search(r"engines ready at (\S+(?:, \S+)*);", line)):
                urls = [url.rstrip("/") for url in ready[1].split(", ")]
                sampler = Sampler(urls, run_dir / "metrics.jsonl", args.sample_s, proc.pid)
                sampler.start()
        if sampler is not None:
            sampler.stopping.set()
            sampler.join()
    if proc.wait() or sampler is None:
        tail = (work / f"{mode}.log").read_text()[-3000:]
        raise RuntimeError(f"molt train ({mode}) exited with {proc.returncode}; the end of its log:\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]
    idle, no_token = sampler.idle()
    run_cores, machine_cores = sampler.cores()

    def median(key: str) -> float:
        return statistics.median(row[key] for row in later)

    return Run(
        steps_per_hour=3600 * len(later) / sum(row["timing/step_total"] for row in later),
        engine_idle=idle,
        no_token=no_token,
        run_cores=run_cores,
        machine_cores=machine_cores,
        final_reward=statistics.mean(row["rollout/reward_mean"] for row in rows[-args.last :]),
        stages={name: median(f"timing/{name}") for name in STAGES},
        notes={
            "staleness_mean": statistics.mean(row["train/staleness_mean"] for row in later),
            "dropped_stale": rows[-1]["pool/dropped_stale"],
            "wasted_frac": rows[-1]["pool/wasted_frac"],
            "turn_s": median("rollout/turn_s"),
            "tool_s": statistics.mean(row["rollout/tool_s"] for row in later),
        },
    )


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def report(runs: dict[str, Run], args: argparse.Namespace) -> None:
    n, k = args.steps, args.last
    print(f"\n{n} steps, tool lognormal mean {args.tool_mean_s} s sigma {args.tool_sigma}, seed {args.seed}")
    print(
        f"| mode | steps/hour (2..{n}) | engine idle | no-token | run cores | machine cores | "
        f"final reward (last {k}) | s/step | "
        "generation | policy_train | broadcast | staleness | dropped stale | wasted | turn s | tool s |"
    )
    print("| --- |" + " ---: |" * 15)
    for mode, r in runs.items():
        cells = [f"{r.steps_per_hour:.0f}", f"{r.engine_idle:.2f}", f"{r.no_token:.2f}"]
        cells += [f"{r.run_cores:.2f}", f"{r.machine_cores:.2f}", f"{r.final_reward:.3f}"]
        cells += [f"{r.stages[name]:.2f}" for name in STAGES]
        notes = ("staleness_mean", "dropped_stale", "wasted_frac", "turn_s", "tool_s")
        cells += [f"{r.notes[name]:.2f}" for name in notes]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    for mode in [mode for mode in runs if mode != "sync" and "sync" in runs]:
        print(f"{mode} / sync steps per hour: {runs[mode].steps_per_hour / runs['sync'].steps_per_hour:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="--model.path of every run; empty = the tiny model")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (>= 3)")
    parser.add_argument("--last", type=int, default=5, help="K: the final reward is over the last K steps")
    parser.add_argument("--tool-mean-s", type=float, default=1.0, help="mean seconds of a tool call")
    parser.add_argument("--tool-sigma", type=float, default=1.0, help="sigma of the tool time's log")
    parser.add_argument("--seed", type=int, default=0, help="--train.seed and the tool delays' seed")
    parser.add_argument("--sample-s", type=float, default=0.1, help="seconds between /metrics samples")
    parser.add_argument("--modes", default="sync,async", help="which runs, in order (comma separated)")
    parser.add_argument("--work-dir", default="", help="where the runs go; empty = a temporary directory")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]  # after `--`: flags of both runs
    if args.steps < 3 or not 1 <= args.last <= args.steps:
        raise ValueError("--steps must be >= 3 and --last must lie in 1..--steps")
    modes = args.modes.split(",")
    if unknown := set(modes) - MODES.keys():
        raise ValueError(f"--modes: unknown {sorted(unknown)}; choose from {sorted(MODES)}")
    with tempfile.TemporaryDirectory(prefix="async-gain-") as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        print("machine:", machine(), flush=True)
        runs = {mode: run_mode(mode, args, work, extra) for mode in modes}
        print("machine after:", machine())
        report(runs, args)


if __name__ == "__main__":
    main()
