"""What asynchrony buys: one recipe trained synchronously and asynchronously, runs interleaved.

The agent (`bench/async_gain_agent.py`) is a ChatAgent on the openai SDK: two chat turns with a tool
call between them that takes a lognormal time (sigma 1, mean `--tool-mean-s`, seeded; the default 1 s is
about what a turn takes the SDK on the 2-core CPU in the sync run). `--task` picks the recipe it plays:
`copy_word` (the default recipe, on molt's tiny model by default) or `additions` (the SmolLM2 recipe's
questions and scoring, asked again after the tool). The script runs `molt train` per mode (`--modes`,
default `sync,async`) as subprocesses, one after the other, with the same flags but:

  sync    `--train.force_on_policy`: one step of groups in flight, max lag 0, no partial rollout; the
          engine generates a batch, waits for its slowest tool call, then waits for training and refit
  async   molt's defaults: 2 x prompts per step groups in flight, max lag 1, partial rollout
  async-lag2  the defaults with `--rollout.max_lag 2` (`--modes sync,async,async-lag2`): the pool
          admits a group only when it can be trained within max lag, so with max lag 1 the engine gets
          one step of groups while the actor trains; max lag 2 lets it run further ahead

`--runs N` runs every mode N times, interleaved (sync 1, async 1, sync 2, ...); run k is seeded `--seed`
+ k - 1 (`--train.seed`, `--data.seed` and the tool delays' seed), so run k of each mode draws the same
rows and delays. With `--out FILE.json` every run appends a record (mode, run, seed, settings, machine,
date, the sampler's figures below, and per step: seconds from launch to the step's line, which molt
prints right after the step's metrics.jsonl line, `timing/step_total`, reward, reply tokens and the
step's whole metrics line), written after each run, so a run cut short keeps the earlier ones; the runs
already in the file count (the next run of a mode continues their numbers), so one command can run a
subset (`--modes sync --runs 1`) and the next one the rest. `--report` only reads `--out` and prints the
tables (`--threshold` may re-set the threshold there).

Figures, per run from steps 2..N (step 1 carries the start-up; the run's shutdown is outside every
figure), and in the tables mean ± s.d. over a mode's runs:

  s/step          the mean `timing/step_total` of steps 2..N (metrics.jsonl; a step's clock runs from
                  waiting for its groups to after its log line, so their sum is those steps' wall time);
                  steps/hour is 3600 / s/step
  reply tokens/s  the replies trained over steps 2..N (`rollout/response_len_mean` x samples a step,
                  both turns of an episode) per second of those steps: per GPU-second on one GPU
  generated tok/s the tokens the engine generated for every group that left the pool over those steps,
                  trained or not (`pool/spent` at step N less at step 1), per second of them
  engine idle     the share of samples of the engines' Prometheus `/metrics` (every `--sample-s`, from
                  the moment step 1 is logged to the moment step N is) at which an engine had no
                  request running (`vllm:num_requests_running` == 0), averaged over engines
  no-token        the share of sampling intervals in which an engine's `vllm:generation_tokens_total` did
                  not grow: idle as above, or paused for a refit with requests kept
  start-up        seconds from launch to step 1's line
  time to reward  seconds from launch to the end of the first step at which the mean reward of the last
                  5 steps reaches `--threshold` (task default: 0.2 copy_word, 0.4 additions, the TRL
                  comparison's rows 0 and 1), and that step; `reached` counts the runs that got there
  final reward    the mean reward of the samples trained on over the last K steps (`--last`)
  staleness, dropped stale, wasted   the mean `train/staleness_mean`, `pool/dropped_stale` at step N,
                  `pool/wasted_frac` at step N (the share of generated tokens never trained)
  run cores       CPU seconds of the run's processes (`molt train` and every descendant: Ray, the
                  engine, the actor, the agent host) per wall second over the sampled window, and the
                  machine's busy cores (every process, other users' included): whether the CPU, not
                  the engine, is what a step waits for

and the stages (medians of `timing/*`) and the agents' own turn and tool times, which say where a gap
comes from. Each mode's ratio to sync is sync's mean s/step over its own (the target: async >= 1.8x),
and beside it the mean ± s.d. of the ratios of run k's pairs (same seed). Flags after `--` go to every
run (a recipe's `--config`, larger batches and replies on a GPU; flags override the TOML's values).

    uv run python bench/async_gain.py                        # CPU, the tiny model, 20 steps each
    uv run python bench/async_gain.py --modes sync,async,async-lag2 --steps 30 -- --rollout.max_new_tokens 8
    uv run python bench/async_gain.py --task additions --runs 2 --steps 4 --last 2 --out /tmp/ag.json
    uv run python bench/async_gain.py --report --out /tmp/ag.json

Row 3 of the GPU comparison (SmolLM2-135M-Instruct on the additions recipe with its sizes, 4 prompts x 8,
replies up to 16 tokens a turn, lr 5e-6, 40 steps, float32 master weights and bf16 compute as the TRL
comparison's row 1, whose script converts the model; evaluation off: its samples go through the slow
tool too and would sit in the steps compared), three runs of each mode:

    python3 bench/peer_trl_gpu.py --prepare-only --rows 1     # /tmp/peer-trl-gpu/models/smollm2
    python3 bench/async_gain.py --task additions --model /tmp/peer-trl-gpu/models/smollm2 --runs 3 \
      --steps 40 --out bench/results/async_gain_gpu.json -- \
      --config packages/molt/src/molt/recipes/smollm2.toml --model.dtype float32 \
      --actor.compute_dtype bfloat16 --eval.every 0 --logger.tensorboard false
    python3 bench/async_gain.py --report --out bench/results/async_gain_gpu.json

Guessed from row 1's molt run on the H200 (start-up 129 s, 0.8 s a step without the tool) and the tool's
tail (a sync step waits for the slowest of 32 calls, about 4.6 s at the median): a sync run holds the GPU
about 6 minutes, an async one about 4, so the three pairs about 30. To keep each command under ten
minutes, run one mode's run a command (`--modes sync --runs 1`, then `--modes async --runs 1`, ...: the
numbers continue from the JSON), or `--steps 20` and one pair a command (`--runs 1`, about 7-8 minutes).
"""

from __future__ import annotations

import argparse
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
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import psutil
from peer_trl_gpu import STEP_LINE, code_digest, machine_line, wait_gpu_idle
from peer_trl_report import mean_sd, plot, reached

from molt._flags import parse

AGENT = Path(__file__).with_name("async_gain_agent.py")
STAGES = ("step_total", "generation", "policy_train", "broadcast")
MODES = {"sync": ["--train.force_on_policy"], "async": [], "async-lag2": ["--rollout.max_lag", "2"]}
THRESHOLDS = {"copy_word": 0.2, "additions": 0.4}  # the TRL comparison's rows 0 and 1
TARGET = 1.8  # the issue's: async at least 1.8x sync's steps per hour
_GAUGE = re.compile(r"^(vllm:num_requests_running|vllm:generation_tokens_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


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


def molt_command(mode: str, seed: int, args: argparse.Namespace, run: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "molt", "train",
        "--agent.module", str(AGENT),
        "--train.num_steps", str(args.steps),
        "--train.seed", str(seed), "--data.seed", str(seed),
        "--logger.run_dir", str(run),
        *(["--model.path", args.model] if args.model else []),
        *MODES[mode], *extra,
    ]  # fmt: skip


def run_mode(mode: str, run: int, seed: int, args: argparse.Namespace, work: Path, extra: list[str]) -> dict:
    """One `molt train` run of a mode: its record (module docstring), figures not yet included."""
    run_dir, log_path = work / f"{mode}-{run}", work / f"{mode}-{run}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = molt_command(mode, seed, args, run_dir, extra)
    config = parse(command[4:])  # the run's resolved sizes (a --config TOML's included)
    env = {
        **os.environ,
        "ASYNC_GAIN_TASK": args.task,
        "ASYNC_GAIN_TOOL": f"{args.tool_mean_s},{args.tool_sigma},{seed}",
    }
    print(f"{mode} {run} (seed {seed}): molt {' '.join(command[3:])}  (load average {load()})", flush=True)
    sampler, ends = None, []
    with log_path.open("w") as log:
        launched = time.time()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if STEP_LINE.match(line):
                ends.append(time.time() - launched)
                print(f"  {mode} {run} {line.rstrip()}", flush=True)
            if sampler is None and (ready := re.search(r"engines ready at (\S+(?:, \S+)*);", line)):
                urls = [url.rstrip("/") for url in ready[1].split(", ")]
                sampler = Sampler(urls, run_dir / "metrics.jsonl", args.sample_s, proc.pid)
                sampler.start()
        if sampler is not None:
            sampler.stopping.set()
            sampler.join()
    if proc.wait() or sampler is None:
        raise RuntimeError(f"molt train ({mode} {run}) exited with {proc.returncode}; the end of its log:\n"
                           f"{log_path.read_text()[-3000:]}")  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    idle, no_token = sampler.idle()
    run_cores, machine_cores = sampler.cores()
    settings = dict(
        task=args.task, model=args.model, steps=args.steps, last=args.last, tool_mean_s=args.tool_mean_s,
        tool_sigma=args.tool_sigma, threshold=args.threshold, samples=samples, extra=extra,
        prompts_per_step=config.rollout.prompts_per_step, group_size=config.rollout.group_size,
        max_new_tokens=config.rollout.max_new_tokens,
    )  # fmt: skip
    steps = [
        dict(step=m["step"], t=t, step_total=m["timing/step_total"], reward=m["rollout/reward_mean"],
             reply_tokens=m["rollout/response_len_mean"] * samples, log=m)
        for m, t in zip(rows, ends, strict=True)
    ]  # fmt: skip
    return dict(
        mode=mode, run=run, seed=seed, when=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=machine_line(args.cuda), code=code_digest(), settings=settings, command=command[3:],
        wall_s=time.time() - launched, engine_idle=idle, no_token=no_token, run_cores=run_cores,
        machine_cores=machine_cores, steps=steps,
    )  # fmt: skip


def figures(record: dict, threshold: float | None = None) -> dict:
    """One run's figures (module docstring); `threshold` instead of the run's own, if given."""
    steps, last = record["steps"], record["settings"]["last"]
    threshold = record["settings"]["threshold"] if threshold is None else threshold
    logs, later = [s["log"] for s in steps], steps[1:]
    busy = sum(s["step_total"] for s in later)
    reward = [s["reward"] for s in steps]
    evals = [log["eval/pass@1"] for log in logs if "eval/pass@1" in log]
    return dict(
        startup_s=steps[0]["t"],
        step_s=busy / len(later),
        steps_per_hour=3600 * len(later) / busy,
        reply_tokens_per_s=sum(s["reply_tokens"] for s in later) / busy,
        generated_tokens_per_s=(logs[-1]["pool/spent"] - logs[0]["pool/spent"]) / busy,
        engine_idle=record["engine_idle"],
        no_token=record["no_token"],
        run_cores=record["run_cores"],
        machine_cores=record["machine_cores"],
        reached=reached(steps, threshold),
        final_reward=statistics.mean(reward[-last:]),
        final_eval=evals[-1] if evals else None,
        staleness=statistics.mean(log["train/staleness_mean"] for log in logs[1:]),
        dropped_stale=logs[-1]["pool/dropped_stale"],
        wasted=logs[-1]["pool/wasted_frac"],
        **{name: statistics.median(log[f"timing/{name}"] for log in logs[1:]) for name in STAGES[1:]},
        turn_s=statistics.median(log["rollout/turn_s"] for log in logs[1:]),
        tool_s=statistics.mean(log["rollout/tool_s"] for log in logs[1:]),
    )


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def plot_runs(records: list[dict], path: str, threshold: float | None = None) -> None:
    """Every run's reward against seconds since launch and against step, a colour a mode, the threshold
    dotted (`peer_trl_report.plot`'s panels)."""
    s = records[-1]["settings"]
    name = f"{s['task']} + a lognormal {s['tool_mean_s']:g} s tool"
    threshold = s["threshold"] if threshold is None else threshold
    settings = {"threshold": threshold, "name": name}
    plot([{"row": 3, "trainer": r["mode"], "steps": r["steps"], "settings": settings} for r in records], path)


def report(records: list[dict], threshold: float | None = None) -> None:
    """The tables over `records`, a mode a line (mean ± s.d. over its runs), and each mode against sync."""
    s = records[-1]["settings"]
    threshold = s["threshold"] if threshold is None else threshold
    differing = {json.dumps({**r["settings"], "threshold": None}, sort_keys=True) for r in records}
    print(f"\n{s['task']}, {s['steps']} steps of {s['prompts_per_step']} prompts x {s['group_size']}, "
          f"replies up to {s['max_new_tokens']} tokens a turn, tool lognormal mean {s['tool_mean_s']} s "
          f"sigma {s['tool_sigma']}, model {s['model'] or 'tiny'}, flags {' '.join(s['extra']) or '-'}; "
          f"{records[-1]['machine']}")  # fmt: skip
    if len(differing) > 1:
        print(f"note: the records' settings differ ({len(differing)} kinds); above: the last run's")
    if len(codes := {r.get("code", "unrecorded") for r in records}) > 1:  # peer_trl_gpu.code_digest
        print(f"note: the runs ran {len(codes)} versions of the workspace's code: {sorted(codes)}")
    modes = list(dict.fromkeys(r["mode"] for r in records))
    runs = {mode: [(r, figures(r, threshold)) for r in records if r["mode"] == mode] for mode in modes}
    n, k = s["steps"], s["last"]
    print(f"| mode | runs | start-up s | s/step (2..{n}) | steps/hour | reply tokens/s | "
          f"generated tokens/s | engine idle | time to {threshold} s | steps to it | reached | "
          f"final reward (last {k}) | staleness | dropped stale | wasted |")  # fmt: skip
    print("| --- |" + " ---: |" * 14)
    for mode, done in runs.items():
        f = [figure for _, figure in done]
        hits = [x["reached"] for x in f if x["reached"]]
        cells = [
            str(len(f)),
            mean_sd([x["startup_s"] for x in f], ".0f"),
            mean_sd([x["step_s"] for x in f], ".2f"),
            mean_sd([x["steps_per_hour"] for x in f], ".0f"),
            mean_sd([x["reply_tokens_per_s"] for x in f], ",.0f"),
            mean_sd([x["generated_tokens_per_s"] for x in f], ",.0f"),
            mean_sd([x["engine_idle"] for x in f], ".2f"),
            mean_sd([t for t, _ in hits], ".0f"),
            mean_sd([step for _, step in hits], ".1f"),
            f"{len(hits)}/{len(f)}",
            mean_sd([x["final_reward"] for x in f], ".3f"),
            mean_sd([x["staleness"] for x in f], ".2f"),
            mean_sd([x["dropped_stale"] for x in f], ".0f"),
            mean_sd([x["wasted"] for x in f], ".3f"),
        ]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print("\n| mode | no-token | run cores | machine cores | generation s | policy_train s | broadcast s | "
          "turn s | tool s | final eval pass@1 |")  # fmt: skip
    print("| --- |" + " ---: |" * 9)
    for mode, done in runs.items():
        f = [figure for _, figure in done]
        names = ("no_token", "run_cores", "machine_cores", *STAGES[1:], "turn_s", "tool_s")
        cells = [mean_sd([x[name] for x in f], ".2f") for name in names]
        cells.append(mean_sd([x["final_eval"] for x in f if x["final_eval"] is not None], ".3f"))
        print(f"| {mode} | " + " | ".join(cells) + " |")
    if "sync" not in runs:
        return
    sync = {r["run"]: x["step_s"] for r, x in runs["sync"]}
    for mode in [mode for mode in runs if mode != "sync"]:
        ratio = statistics.mean(sync.values()) / statistics.mean(x["step_s"] for _, x in runs[mode])
        pairs = [sync[r["run"]] / x["step_s"] for r, x in runs[mode] if r["run"] in sync]
        verdict = "met" if ratio >= TARGET else "not met"
        print(f"{mode} / sync (sync's mean s/step over {mode}'s): {ratio:.2f}x, target {TARGET}x {verdict}; "
              f"per-run ratios (same seed), n = {len(pairs)}: {mean_sd(pairs, '.2f')}")  # fmt: skip


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--task", default="copy_word", choices=sorted(THRESHOLDS), help="the agent's recipe")
    parser.add_argument("--model", default="", help="--model.path of every run; empty = the tiny model")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (>= 3)")
    parser.add_argument("--last", type=int, default=5, help="K: the final reward is over the last K steps")
    parser.add_argument("--threshold", type=float, help="the reward whose time is reported (task's own)")
    parser.add_argument("--tool-mean-s", type=float, default=1.0, help="mean seconds of a tool call")
    parser.add_argument("--tool-sigma", type=float, default=1.0, help="sigma of the tool time's log")
    parser.add_argument("--seed", type=int, default=0, help="run k: train, data and tool seed + k - 1")
    parser.add_argument("--sample-s", type=float, default=0.1, help="seconds between /metrics samples")
    parser.add_argument("--modes", default="sync,async", help="which runs, in order (comma separated)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each mode, interleaved")
    parser.add_argument("--out", default="", help="the JSON runs append to; empty = none kept")
    parser.add_argument("--report", action="store_true", help="only read --out and print the tables")
    parser.add_argument("--plot", default="", help="also draw reward over wall-clock and steps into this PNG")
    parser.add_argument("--work-dir", default="", help="where the runs go; empty = a temporary directory")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]  # after `--`: flags of every run
    out = Path(args.out) if args.out else None
    data = json.loads(out.read_text()) if out and out.is_file() else {"records": []}
    if args.report:
        if not data["records"]:
            raise SystemExit(f"--report: no runs in {args.out or '(no --out given)'}")
        report(data["records"], args.threshold)
        return plot_runs(data["records"], args.plot, args.threshold) if args.plot else None
    if args.steps < 3 or not 1 <= args.last <= args.steps or args.runs < 1:
        raise ValueError("--steps must be >= 3, --last must lie in 1..--steps and --runs be >= 1")
    modes = args.modes.split(",")
    if unknown := set(modes) - MODES.keys():
        raise ValueError(f"--modes: unknown {sorted(unknown)}; choose from {sorted(MODES)}")
    args.threshold = THRESHOLDS[args.task] if args.threshold is None else args.threshold
    args.cuda = shutil.which("nvidia-smi") is not None  # the machine line names the GPU; runs wait for it
    records = []
    with tempfile.TemporaryDirectory(prefix="async-gain-") as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        print("machine:", machine_line(args.cuda), flush=True)
        for _ in range(args.runs):
            for mode in modes:
                run = 1 + sum(r["mode"] == mode for r in data["records"])
                record = run_mode(mode, run, args.seed + run - 1, args, work, extra)
                records.append(record)
                data["records"].append(record)
                if out:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(data, indent=1))
                if args.cuda:  # the last run's engine and actor are gone before the next starts
                    wait_gpu_idle()
        print("machine after:", machine_line(args.cuda))
    report(data["records"] if out else records)
    if args.plot:
        plot_runs(data["records"] if out else records, args.plot, args.threshold)


if __name__ == "__main__":
    main()
