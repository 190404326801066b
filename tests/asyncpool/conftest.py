"""Fake rollouts for the asyncpool tests.

A fake stands in for the engine because the pool's contract is about ordering and accounting, not about
tokens: `ScriptedRollout` waits until the test finishes each call by hand (exact completion order, no
sleeps); `RandomRollout` finishes after a seeded random number of event-loop turns; `HeavyTailRollout`
after a lognormal number (a long-episode agent against a trainer that bumps the version every few
turns). Each stamps the pool's version when a call starts and when it ends, the way an engine stamps
tokens across a refit.
"""

import asyncio
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class FakeSample:
    prompt: Any
    index: int
    min_version: int
    max_version: int


class ScriptedRollout:
    """`await rollout(prompt, index)` blocks until the test calls `finish` or `fail` for it."""

    def __init__(self) -> None:
        self.pool: Any = None  # set by the test; read for version stamps
        self.calls: list[tuple[Any, int]] = []
        self.cancelled = 0
        self._waiting: dict[tuple[Any, int], asyncio.Future[BaseException | None]] = {}

    async def __call__(self, prompt: Any, index: int) -> FakeSample:
        self.calls.append((prompt, index))
        started = self.pool.version
        future = asyncio.get_running_loop().create_future()
        self._waiting[(prompt, index)] = future
        try:
            error = await future
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            del self._waiting[(prompt, index)]
        if error is not None:
            raise error
        return FakeSample(prompt, index, started, self.pool.version)

    def running(self) -> list[tuple[Any, int]]:
        return sorted(self._waiting)

    def running_prompts(self) -> list[Any]:
        return sorted({prompt for prompt, _ in self._waiting})

    def finish(self, prompt: Any, indices: list[int] | None = None) -> None:
        keys = [(prompt, i) for i in indices] if indices is not None else self._keys_of(prompt)
        for key in keys:
            self._waiting[key].set_result(None)

    def fail(self, prompt: Any, index: int, error: BaseException) -> None:
        self._waiting[(prompt, index)].set_result(error)

    def _keys_of(self, prompt: Any) -> list[tuple[Any, int]]:
        keys = [key for key in self._waiting if key[0] == prompt]
        assert keys, f"no rollout of {prompt!r} is running"
        return keys

    async def settle(self) -> None:
        """Let every task that can run, run (enough turns for a result to reach `take`)."""
        for _ in range(20):
            await asyncio.sleep(0)


class RandomRollout:
    """Finishes after a seeded random number of event-loop turns; records (prompt, index, start, end)."""

    def __init__(self, seed: int, max_turns: int = 30) -> None:
        self.pool: Any = None
        self.rng = random.Random(seed)
        self.max_turns = max_turns
        self.started: list[tuple[Any, int, int]] = []

    async def __call__(self, prompt: Any, index: int) -> FakeSample:
        started = self.pool.version
        self.started.append((prompt, index, started))
        for _ in range(self.rng.randrange(self.max_turns)):
            await asyncio.sleep(0)
        return FakeSample(prompt, index, started, self.pool.version)


class HeavyTailRollout:
    """A call lasts round(lognormal) event-loop turns, median `median_turns` (x `long_factor` for every
    `long_every`-th prompt: a long-episode agent), log-std `sigma`; versions stamped at start and end.
    `starts` counts the groups started per prompt (reruns after stale drops included)."""

    def __init__(self, seed, *, median_turns, sigma, long_every=0, long_factor=1.0):
        self.pool: Any = None
        self.rng = random.Random(seed)
        self.median_turns, self.sigma = median_turns, sigma
        self.long_every, self.long_factor = long_every, long_factor
        self.starts: Counter = Counter()

    def is_long(self, prompt):
        return bool(self.long_every) and prompt % self.long_every == 0

    async def __call__(self, prompt, index):
        self.starts[prompt] += index == 0
        median = self.median_turns * (self.long_factor if self.is_long(prompt) else 1.0)
        started = self.pool.version
        for _ in range(round(self.rng.lognormvariate(math.log(median), self.sigma))):
            await asyncio.sleep(0)
        return FakeSample(prompt, index, started, self.pool.version)


@pytest.fixture
def rollout() -> ScriptedRollout:
    return ScriptedRollout()


@pytest.fixture
def random_rollout() -> type[RandomRollout]:
    return RandomRollout


@pytest.fixture
def heavy_tail_rollout() -> type[HeavyTailRollout]:
    return HeavyTailRollout
