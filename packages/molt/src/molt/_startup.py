"""The start of a run: how long each stage took, and compiled bytecode for every process a run starts.

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

import os
import sys
import time

from molt._log import progress

__all__ = ["StartupClock", "allow_bytecode"]


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
    """Seconds per start-up stage (insertion order), counted from the command's start."""

    def __init__(self) -> None:
        self.origin = _process_started()
        self.seconds: dict[str, float] = {}
        self._begun: dict[str, float] = {}

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

    def metrics(self) -> dict[str, float]:
        stages = {f"timing/startup_{stage}": s for stage, s in self.seconds.items()}
        return stages | {"timing/startup_total": time.monotonic() - self.origin}

    def line(self) -> str:
        stages = ", ".join(f"{stage} {s:.1f} s" for stage, s in self.seconds.items())
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
