"""Where a run's numbers and words go: `metrics.jsonl` (one object per step), TensorBoard, Weights & Biases
(offline, into the run directory), one console line a step, molt's progress lines, and (`quiet_console`)
the other libraries' output into the run directory; and the start of a run: how long each stage took, and
compiled bytecode for every process a run starts.

`StartupClock` times the stages of a run's launch (`molt._launch.launch`) from its start: the stages
that run side by side (engines, actor ranks, agent hosts load at once) are waited for together
(`wait`), each noted when it is ready. Step 1 logs them as `timing/startup_<stage>` (seconds each stage
took) and `timing/startup_total` (the command to step 1's metrics), and the console prints one line.

`allow_bytecode`: where PYTHONDONTWRITEBYTECODE is set, Python caches no compiled modules, and every
process a run starts (engines, actor ranks, agent hosts) compiles torch, vLLM and transformers from
source: importing the loop and vLLM's server took 24.2 s without a bytecode cache and 11.2 s with one
(2-core CI machine). A run unsets it for itself and what it starts, and says so once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import msgspec

from molt.config import Config

# The terminal's stderr: molt's own lines go here, also while `quiet_console` points fd 2 at a file.
_console: TextIO | None = None
# The libraries of this project: their warnings and errors (a failing agent's first traceback) always
# reach the terminal.
_OWN_LOGGERS = ("molt", "asyncpool", "tito", "refit")


def progress(message: str) -> None:
    """A start-up or shutdown line on stderr, so long waits (engines loading) are visible."""
    print(f"[molt {time.strftime('%H:%M:%S')}] {message}", file=_console or sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_console(log_path: Path, *, verbose: bool) -> Iterator[None]:
    """Within the block, whatever else writes to this process's stderr (warnings, progress bars, other
    libraries' log lines, C++ logs) goes to `log_path`; molt's progress lines and its libraries' warnings
    and errors still reach the terminal. On exit, an error's included, stderr is the terminal again, so a
    traceback shows there. Nested blocks and `verbose` change nothing."""
    global _console
    if verbose or _console is not None:
        yield
        return
    sys.stderr.flush()
    _console = os.fdopen(os.dup(2), "w", buffering=1)
    handler = logging.StreamHandler(_console)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("[%(name)s %(asctime)s] %(levelname)s %(message)s", "%H:%M:%S"))
    for name in _OWN_LOGGERS:
        logging.getLogger(name).addHandler(handler)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 2)
    progress(f"other libraries' output goes to {log_path.parent}/*.log (--logger.verbose shows it here)")
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(_console.fileno(), 2)
        for name in _OWN_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        _console.close()
        _console = None


def redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr into `log_path` (a Ray worker's third-party output: its
    failures still reach the trainer as exceptions)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)


def start_wandb(run_dir: Path, project: str, config: dict):
    """A W&B run of `project` writing under `<run_dir>/wandb`, offline unless WANDB_MODE says otherwise
    (upload it later with `wandb sync <run_dir>/wandb/offline-run-*`)."""
    import wandb

    return wandb.init(
        project=project,
        dir=str(run_dir),
        config=config,
        name=run_dir.name,
        mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]  # wandb checks the value
        settings=wandb.Settings(silent=True, disable_git=True),
    )


class RunLog:
    """Every step's metrics into each sink of `--logger.*`, in the run directory; a W&B run (with
    --logger.wandb_project) gets the resolved config."""

    def __init__(self, config: Config) -> None:
        logger, run_dir = config.logger, Path(config.logger.run_dir)
        self.num_steps = config.train.num_steps
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        self.writer = None
        if logger.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        project = logger.wandb_project
        self.wandb = start_wandb(run_dir, project, msgspec.to_builtins(config)) if project else None

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._record(step, metrics, self._line(step, metrics))

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation logged apart from its step's record (the last one of a run whose dataset ran
        out): `molt plot` merges a step's records."""
        self._record(step, metrics, f"eval after step {step} | pass@1 {metrics['eval/pass@1']:.3f}")

    def _record(self, step: int, metrics: dict[str, float], line: str) -> None:
        """`metrics` into every sink, and `line` on the console."""
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        print(line, flush=True)

    def _line(self, step: int, m: dict[str, float]) -> str:
        return (
            f"step {step}/{self.num_steps} | reward {m['rollout/reward_mean']:.3f}"
            f" | len {m['rollout/response_len_mean']:.1f} | loss {m['train/policy_loss']:+.4f}"
            f" | mismatch_kl {m['train/mismatch_kl']:.1e} | stale {m['train/staleness_mean']:.2f}"
            f" | gen {m['timing/generation']:.1f}s train {m['timing/policy_train']:.1f}s"
            f" refit {m['timing/broadcast']:.1f}s | {m['timing/step_total']:.1f}s/step"
        )

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _process_started() -> float:
    """This process's start on the `time.monotonic` clock (Linux: from /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()
    return time.monotonic() - max(age, 0.0)


class StartupClock:
    """Seconds per start-up stage (insertion order), counted from the command's start. The first stage,
    "driver", runs from the command's start until it is ended (`molt train`: the imports and the checks,
    before Ray starts; the run's notes, its agent module and rows are read while the engines load)."""

    def __init__(self) -> None:
        self.origin = _process_started()
        self.seconds: dict[str, float] = {}
        self.parts: dict[str, dict[str, float]] = {}  # a stage -> where its seconds went, as it reported
        self._begun: dict[str, float] = {"driver": self.origin}

    def begin(self, stage: str) -> None:
        self._begun[stage] = time.monotonic()

    def end(self, stage: str) -> None:
        self.seconds[stage] = time.monotonic() - self._begun.pop(stage)

    def wait(self, stages: dict[str, list]) -> None:
        """Wait for the Ray object refs of every begun stage at once; a stage ends when its last ref is
        ready (its progress line says so). The first ref that failed raises its error."""
        import ray

        pending = {ref: stage for stage, refs in stages.items() for ref in refs}
        for stage in [stage for stage, refs in stages.items() if not refs]:
            self.end(stage)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            stage = pending.pop(done[0])
            ray.get(done[0])  # raises the stage's failure here
            if stage not in pending.values():
                self.end(stage)
                progress(f"{stage} ready ({self.seconds[stage]:.1f} s)")

    def split(self, stage: str, parts: dict[str, float]) -> None:
        """Where an ended stage's seconds went, as the stage's processes reported them (an actor's load and
        warm-up); the rest of the stage is what they did not count (placing, starting, importing)."""
        self.parts[stage] = parts

    def metrics(self) -> dict[str, float]:
        stages = {f"timing/startup_{stage}": s for stage, s in self.seconds.items()}
        for stage, parts in self.parts.items():
            stages |= {f"timing/startup_{stage}_{part}": s for part, s in parts.items()}
        return stages | {"timing/startup_total": time.monotonic() - self.origin}

    def line(self) -> str:
        def described(stage: str, seconds: float) -> str:
            parts = ", ".join(f"{part} {s:.1f} s" for part, s in self.parts.get(stage, {}).items())
            return f"{stage} {seconds:.1f} s" + (f" ({parts})" if parts else "")

        stages = ", ".join(described(stage, s) for stage, s in self.seconds.items())
        return f"step 1 {time.monotonic() - self.origin:.1f} s after the command ({stages})"


def allow_bytecode() -> None:
    """Unset PYTHONDONTWRITEBYTECODE for this process and the processes it starts (module docstring)."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is None:
        return
    sys.dont_write_bytecode = False
    progress(
        "PYTHONDONTWRITEBYTECODE is set: without cached bytecode every process of a run compiles torch, "
        "vLLM and transformers again (start-up about twice as long), so this run and what it starts "
        "write and use the cache"
    )
