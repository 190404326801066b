"""Simulated RL loop: asyncpool.GroupPool against synchronous batches, on a virtual clock.

Run: `uv run python bench/asyncpool_sim.py` (deterministic, under a minute, no real sleeping).

Model: one inference engine with a fixed number of slots (an asyncio.Semaphore: a request holds a slot for
its whole duration, the rest queue); rollout durations are lognormal (sigma 1, heavy-tailed); a trainer step
takes a fixed time and bumps the policy version. Both modes drive the real GroupPool:
  (a) synchronous: depth == batch and max_lag=0 (strict on-policy): generate the batch, then train while
      the engine idles;
  (b) pool: depth == 2 x batch and max_lag=1: the engine keeps generating while the trainer trains.
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

SLOTS = 64  # concurrent requests the engine serves
GROUP_SIZE = 8
BATCH = 32  # groups per optimizer step: 256 rollouts, 4 waves of the engine's slots
MEAN_ROLLOUT_S = 30.0
SIGMA = 1.0  # lognormal shape: median 18 s, 1 in 100 rollouts longer than 185 s
TRAIN_S = (60.0, 120.0, 180.0)  # trainer step times; 120 s is the engine's ideal time for one batch
STEPS = 150
# (depth, max_lag, stale): the staleness trade-off at one step time
VARIANT_TRAIN_S, VARIANTS = 120.0, ((32, 1, "drop"), (48, 1, "drop"), (64, 2, "drop"), (64, 1, "keep"))
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


class Engine:
    """SLOTS concurrent requests; records slot-seconds in use, including work cut short at the end."""

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
    slot_s: float  # slot time it used: counted as useful work only if its group reaches the trainer


@dataclass(frozen=True)
class Result:
    steps_per_hour: float
    idle_frac: float  # slot time unused
    useful_frac: float  # slot time spent on samples the trainer received
    dropped_stale_frac: float  # of started groups
    mean_lag: float  # versions between a returned group's oldest token and the trainer
    most_reruns: int  # the most stale reruns of one prompt (what the pool's max_requeues caps)


async def simulate(depth: int, max_lag: int, train_s: float, stale: str) -> Result:
    engine, rng = Engine(SLOTS), random.Random(SEED)
    mu = math.log(MEAN_ROLLOUT_S) - SIGMA**2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    pool: GroupPool[int, Sample]
    starts: collections.Counter[int] = collections.Counter()  # groups started per prompt

    async def rollout(prompt: int, index: int) -> Sample:
        starts[prompt] += index == 0
        duration = rng.lognormvariate(mu, SIGMA)
        async with engine.slot():
            first_token_version = pool.version  # queued requests sample nothing until they get a slot
            await asyncio.sleep(duration)
            return Sample(first_token_version, pool.version, duration)

    pool = GroupPool(
        rollout, itertools.count(), group_size=GROUP_SIZE, depth=depth, max_lag=max_lag, stale=stale
    )
    loop, lags, useful_s = asyncio.get_running_loop(), [], 0.0
    async with pool:
        for step in range(STEPS):
            groups = await pool.take(BATCH)
            lags += [pool.version - group.min_version for group in groups]
            useful_s += sum(sample.slot_s for group in groups for sample in group.samples)
            await asyncio.sleep(train_s)
            pool.version = step + 1
        elapsed, stats = loop.time(), pool.stats
    return Result(
        steps_per_hour=STEPS * 3600 / elapsed,
        idle_frac=max(0.0, 1 - engine.busy_s / (SLOTS * elapsed)),  # max: float rounding at full use
        useful_frac=useful_s / (SLOTS * elapsed),
        dropped_stale_frac=stats.dropped_stale / stats.started,
        mean_lag=sum(lags) / len(lags),
        most_reruns=max(starts.values()) - 1,
    )


def run(depth: int, max_lag: int, train_s: float, stale: str = "drop") -> Result:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(simulate(depth, max_lag, train_s, stale))


def main() -> None:
    print("machine: simulated (virtual-time asyncio loop); engine and trainer are models, not hardware")
    print(
        f"engine {SLOTS} slots; batch {BATCH} groups x {GROUP_SIZE} samples; rollout time lognormal, "
        f"mean {MEAN_ROLLOUT_S:.0f} s, sigma {SIGMA}; {STEPS} steps per run; seed {SEED}"
    )
    print(f"(a) sync: depth {BATCH}, max_lag 0   (b) pool: depth {2 * BATCH}, max_lag 1\n")
    print(
        "| train step | (a) steps/h | (a) idle | (b) steps/h | (b) idle | (b) useful "
        "| (b) stale drops | (b) most reruns | (b) mean lag | (b)/(a) |"
    )
    print("|---:" * 10 + "|")
    for train_s in TRAIN_S:
        sync, pool = run(BATCH, 0, train_s), run(2 * BATCH, 1, train_s)
        cells = [f"{train_s:.0f} s", f"{sync.steps_per_hour:.1f}", f"{sync.idle_frac:.1%}"]
        cells += [f"{pool.steps_per_hour:.1f}", f"{pool.idle_frac:.1%}", f"{pool.useful_frac:.1%}"]
        cells += [f"{pool.dropped_stale_frac:.1%}", str(pool.most_reruns), f"{pool.mean_lag:.2f}"]
        cells += [f"{pool.steps_per_hour / sync.steps_per_hour:.2f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"\nother settings of the pool, train step {VARIANT_TRAIN_S:.0f} s:\n")
    print("| depth | max_lag | stale | steps/h | idle | useful | stale drops | most reruns | mean lag |")
    print("|---:|---:|---|" + "---:|" * 6)
    for depth, max_lag, stale in VARIANTS:
        pool = run(depth, max_lag, VARIANT_TRAIN_S, stale)
        cells = [str(depth), str(max_lag), stale, f"{pool.steps_per_hour:.1f}", f"{pool.idle_frac:.1%}"]
        cells += [f"{pool.useful_frac:.1%}", f"{pool.dropped_stale_frac:.1%}", str(pool.most_reruns)]
        cells += [f"{pool.mean_lag:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
