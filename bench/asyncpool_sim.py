"""Simulated RL loop: asyncpool.GroupPool against synchronous batches, on a virtual clock.

Run: `uv run python bench/asyncpool_sim.py` (deterministic, under a minute, no real sleeping).

Model: one inference engine with a fixed number of slots (an asyncio.Semaphore: a request holds a slot for
its whole duration, the rest queue); rollout durations are lognormal (heavy-tailed); a trainer step takes a
fixed time and bumps the policy version, the way molt's loop does (take, train, refit, version). Every mode
drives the real GroupPool:
  sync       depth == batch and max_lag=0 (strict on-policy): generate the batch, then train while the
             engine idles;
  admission  the pool as it is: depth == 2 x batch, max_lag=1, a group started only when it can be
             taken within max_lag, and one overtaken and finished stale anyway kept for the correction
             (stale="keep");
  adm+drop   the same, but stale groups dropped and rerun (stale="drop");
  eager      the pool before admission, for comparison: filled back to depth right after every take, stale
             groups dropped and rerun (`EagerPool` below, the only place that reaches into the pool).
The event loop's clock is virtual: when nothing is ready to run it jumps to the next timer, so simulated
hours pass in seconds of real time and every run is reproducible.

What it leaves out: the engine pause during weight broadcast (add about broadcast_s / step_s to the pool's
idle fraction), prefill/decode interplay inside the engine (a slot is busy or idle), and failures.
"""

import asyncio
import collections
import contextlib
import itertools
import math
import random
import selectors
from collections.abc import AsyncIterator
from dataclasses import dataclass

from asyncpool import GroupPool


@dataclass(frozen=True)
class Shape:
    """A workload: the engine, the batch, the rollouts' time, the trainer's step."""

    slots: int  # concurrent requests the engine serves
    batch: int  # groups per optimizer step
    group_size: int
    mean_rollout_s: float
    sigma: float  # lognormal shape of a rollout's time
    train_s: float
    steps: int = 150


# A GPU-sized batch of heavy-tailed agent episodes: 32 x 8 = 256 rollouts, 4 waves of 64 slots; sigma 1 is
# median 18 s, 1 in 100 longer than 185 s. 120 s is the engine's ideal time for one batch.
HEAVY = Shape(slots=64, batch=32, group_size=8, mean_rollout_s=30.0, sigma=1.0, train_s=120.0)
TRAIN_S = (60.0, 120.0, 180.0)
# molt's CPU default recipe in shape: 16 x 8 short replies at once (the engine batches all 128), generated
# in well under the 2.4 s step, with some jitter.
CPU_DEFAULT = Shape(slots=128, batch=16, group_size=8, mean_rollout_s=0.8, sigma=0.3, train_s=2.4)
# (depth, max_lag, stale) for the admission pool at HEAVY's 120 s step
VARIANTS = ((64, 1, "drop"), (64, 2, "keep"), (96, 2, "keep"), (96, 2, "drop"))
SEED = 0


class _VirtualClock(selectors.DefaultSelector):
    """A selector that never waits: asked to block for `timeout` seconds, it moves the clock instead."""

    now = 0.0

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise RuntimeError("the simulation deadlocked: nothing is ready and no timer is set")
        self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio's own loop (BaseEventLoop._run_once asks the selector to wait until the next timer) on a
    clock that jumps: asyncio.sleep(3600) returns at once, one simulated hour later."""

    def __init__(self) -> None:
        self._clock = _VirtualClock()
        super().__init__(selector=self._clock)

    def time(self) -> float:
        return self._clock.now


class EagerPool(GroupPool):
    """The pool before admission: it starts a group whenever fewer than `depth` are held, so right after a
    take it refills at the old version, and half of what it holds is taken two versions late."""

    def _admits(self) -> bool:
        return len(self._running) + len(self._ready) < self.depth


class Engine:
    """`slots` concurrent requests; records slot-seconds in use, including work cut short at the end."""

    def __init__(self, slots: int) -> None:
        self._slots = asyncio.Semaphore(slots)
        self.busy_s = 0.0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        async with self._slots:
            began = asyncio.get_running_loop().time()
            try:
                yield
            finally:
                self.busy_s += asyncio.get_running_loop().time() - began


@dataclass(frozen=True)
class Sample:
    min_version: int
    max_version: int
    slot_s: float  # slot time it used: the pool's cost, so stats.wasted is slot time never trained


@dataclass(frozen=True)
class Result:
    steps_per_hour: float
    idle_frac: float  # slot time unused
    wasted_frac: float  # of the slot time of groups that left the pool, the share never returned
    stale_frac: float  # groups dropped as stale (of started), or returned stale (of returned) with "keep"
    mean_lag: float  # versions between a returned group's oldest token and the trainer
    most_reruns: int  # the most stale reruns of one prompt (what the pool's max_requeues caps)


MODES = {  # name: (pool class, depth in batches, max_lag, stale)
    "sync": (GroupPool, 1, 0, "keep"),
    "admission": (GroupPool, 2, 1, "keep"),
    "adm+drop": (GroupPool, 2, 1, "drop"),
    "eager": (EagerPool, 2, 1, "drop"),
}


async def simulate(shape: Shape, pool_class: type[GroupPool], depth: int, max_lag: int, stale: str) -> Result:
    engine, rng = Engine(shape.slots), random.Random(SEED)
    mu = math.log(shape.mean_rollout_s) - shape.sigma**2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    pool: GroupPool[int, Sample]
    starts: collections.Counter[int] = collections.Counter()  # groups started per prompt

    async def rollout(prompt: int, index: int) -> Sample:
        starts[prompt] += index == 0
        duration = rng.lognormvariate(mu, shape.sigma)
        async with engine.slot():
            first_token_version = pool.version  # queued requests sample nothing until they get a slot
            await asyncio.sleep(duration)
            return Sample(first_token_version, pool.version, duration)

    pool = pool_class(
        rollout,
        itertools.count(),
        group_size=shape.group_size,
        depth=depth,
        max_lag=max_lag,
        stale=stale,
        cost=lambda sample: sample.slot_s,
    )
    loop, lags = asyncio.get_running_loop(), []
    async with pool:
        for step in range(shape.steps):
            groups = await pool.take(shape.batch)
            lags += [pool.version - group.min_version for group in groups]
            await asyncio.sleep(shape.train_s)
            pool.version = step + 1
        elapsed, stats = loop.time(), pool.stats
    stale_frac = stats.dropped_stale / stats.started if stale == "drop" else stats.kept_stale / stats.returned
    return Result(
        steps_per_hour=shape.steps * 3600 / elapsed,
        idle_frac=max(0.0, 1 - engine.busy_s / (shape.slots * elapsed)),  # max: float rounding at full use
        wasted_frac=stats.wasted / stats.spent,
        stale_frac=stale_frac,
        mean_lag=sum(lags) / len(lags),
        most_reruns=max(starts.values()) - 1,
    )


def run(shape: Shape, mode: str) -> Result:
    pool_class, batches, max_lag, stale = MODES[mode]
    return run_pool(shape, pool_class, batches * shape.batch, max_lag, stale)


def run_pool(shape: Shape, pool_class: type[GroupPool], depth: int, max_lag: int, stale: str) -> Result:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(simulate(shape, pool_class, depth, max_lag, stale))


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _cells(result: Result) -> list[str]:
    return [
        f"{result.steps_per_hour:.1f}",
        f"{result.idle_frac:.1%}",
        f"{result.wasted_frac:.1%}",
        f"{result.stale_frac:.1%}",
        str(result.most_reruns),
        f"{result.mean_lag:.2f}",
    ]


def table(shape: Shape, train_s: tuple[float, ...]) -> None:
    print(
        f"engine {shape.slots} slots; batch {shape.batch} groups x {shape.group_size} samples; rollout time "
        f"lognormal, mean {shape.mean_rollout_s:g} s, sigma {shape.sigma}; {shape.steps} steps per run\n"
    )
    print("| train step | mode | steps/h | idle | waste | stale | most reruns | mean lag | vs sync |")
    print("|---:|---|" + "---:|" * 7)
    for step_s in train_s:
        sized = Shape(**{**shape.__dict__, "train_s": step_s})
        sync = run(sized, "sync")
        for mode in MODES:
            result = sync if mode == "sync" else run(sized, mode)
            speedup = result.steps_per_hour / sync.steps_per_hour
            print(_row([f"{step_s:g} s", mode, *_cells(result), f"{speedup:.2f}"]))


def main() -> None:
    print("machine: simulated (virtual-time asyncio loop); engine and trainer are models, not hardware")
    print(f"seed {SEED}; waste = slot time of groups dropped (never trained) / slot time of groups that left")
    print("the pool; stale = groups dropped as stale / started (drop), or trained stale / trained (keep)\n")
    table(HEAVY, TRAIN_S)
    print(f"\nother settings of the admission pool, train step {HEAVY.train_s:g} s:\n")
    print("| depth | max_lag | stale | steps/h | idle | waste | stale | most reruns | mean lag |")
    print("|---:|---:|---|" + "---:|" * 6)
    for depth, max_lag, stale in VARIANTS:
        result = run_pool(HEAVY, GroupPool, depth, max_lag, stale)
        print(_row([str(depth), str(max_lag), stale, *_cells(result)]))
    print("\nthe CPU default recipe's shape (replies shorter than a step):\n")
    table(CPU_DEFAULT, (CPU_DEFAULT.train_s,))


if __name__ == "__main__":
    main()
