"""Fake rollouts for the asyncpool tests.

A fake stands in for the engine because the pool's contract is about ordering and accounting, not about
tokens: `ScriptedRollout` waits until the test finishes each call by hand (exact completion order, no
sleeps); `RandomRollout` finishes after a seeded random number of event-loop turns. Both stamp the
pool's version when a call starts and when it ends, the way an engine stamps tokens across a refit.
"""

import asyncio
import random
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


@pytest.fixture
def rollout() -> ScriptedRollout:
    return ScriptedRollout()


@pytest.fixture
def random_rollout() -> type[RandomRollout]:
    return RandomRollout
