"""Admission: the pool starts a group only when it can still be taken within `max_lag`, so what it
generates is trained instead of dropped as stale; and the cost of what was generated but never returned.

The trainer here is molt's loop: `take(n)`, train, then `pool.version += 1`. A group started while the
trainer trains on the batch it took at version v is taken at v + 1 at the earliest, after the groups held
before it; so between a take and the next version at most `max_lag * n` groups may be held, and
`(max_lag + 1) * n` once the version has moved.
"""

import asyncio
import itertools
from dataclasses import dataclass

import pytest

from asyncpool import GroupPool


@dataclass(frozen=True)
class Sample:
    min_version: int
    max_version: int
    num_tokens: int


class FixedRollout:
    """Every call lasts `turns` event-loop turns, so groups complete in the order they start; versions
    stamped at start and end; `num_tokens` is the prompt itself (a stand-in for a reply's length)."""

    def __init__(self, turns: int) -> None:
        self.pool: GroupPool | None = None
        self.turns = turns

    async def __call__(self, prompt: int, index: int) -> Sample:
        started = self.pool.version
        for _ in range(self.turns):
            await asyncio.sleep(0)
        return Sample(started, self.pool.version, num_tokens=prompt)


def test_admission_holds_the_groups_in_play_at_the_bound(rollout):
    # depth 4 = (max_lag + 1) x n for n = 2: before a take four groups run; between the take and the next
    # version only max_lag x n = 2 may be held, as a group started then could be taken two versions late.
    async def main():
        pool = GroupPool(rollout, itertools.count(), group_size=1, depth=4, max_lag=1)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            assert rollout.running_prompts() == [0, 1, 2, 3]
            rollout.finish(0)
            rollout.finish(1)
            assert [group.prompt for group in await pool.take(2)] == [0, 1]
            await rollout.settle()
            assert rollout.running_prompts() == [2, 3]  # nothing starts while the trainer trains
            pool.version = 1
            await rollout.settle()
            assert rollout.running_prompts() == [2, 3, 4, 5]  # the version moved: two more can be taken
            rollout.finish(2)
            rollout.finish(3)
            groups = await pool.take(2)
            await rollout.settle()
            assert rollout.running_prompts() == [4, 5]
            assert [(group.prompt, pool.version - group.min_version) for group in groups] == [(2, 1), (3, 1)]

    asyncio.run(main())


async def _train(pool: GroupPool, *, n: int, steps: int, train_turns: int):
    """molt's loop: take n, train `train_turns` event-loop turns, bump the version. Returns each returned
    group's lag when taken, the most groups the pool held (running or ready) while the trainer trained,
    and the stats before leaving (which cancels what still runs)."""
    lags, most_held = [], 0
    async with pool:
        for _ in range(steps):
            groups = await pool.take(n)
            lags += [pool.version - group.min_version for group in groups]
            for _ in range(train_turns):
                await asyncio.sleep(0)
                most_held = max(most_held, pool.stats.in_flight + pool.stats.ready)
            pool.version += 1
        return lags, most_held, pool.stats


@pytest.mark.parametrize("max_lag", [1, 2])
def test_no_group_goes_stale_when_rollouts_finish_in_start_order(max_lag):
    # Rollouts shorter than a training step and a queue of (max_lag + 1) x n: filling back to depth right
    # after each take, at the old version, sent a third of the groups stale (the CPU default recipe: 693
    # of 2,325 started). With admission none goes stale, and the run is still asynchronous.
    n, rollout = 4, FixedRollout(turns=3)
    pool = GroupPool(
        rollout, itertools.count(), group_size=2, depth=(max_lag + 1) * n, max_lag=max_lag, stale="drop"
    )
    rollout.pool = pool
    lags, most_held, stats = asyncio.run(_train(pool, n=n, steps=30, train_turns=10))
    assert stats.dropped_stale == 0, stats
    assert max(lags) == max_lag  # asynchronous: groups are trained up to max_lag versions late
    assert most_held <= max_lag * n  # the bound between a take and the next version
    assert stats.started == stats.returned + stats.in_flight + stats.ready


@pytest.mark.parametrize(("max_lag", "depth"), [(0, 8), (1, 12)])
def test_a_batch_known_up_front_bounds_the_first_fill_by_max_lag(max_lag, depth):
    # A queue deeper than (max_lag + 1) x n: before the first take the pool does not know n, and filling to
    # depth then started groups only a take max_lag + 1 or more versions later could return (max_lag 0:
    # step 2 trained groups of version 0 at version 1). Given `batch`, the first fill is bounded as the rest.
    n, rollout = 4, FixedRollout(turns=3)
    pool = GroupPool(rollout, itertools.count(), group_size=2, depth=depth, max_lag=max_lag, batch=n)
    rollout.pool = pool
    lags, _, stats = asyncio.run(_train(pool, n=n, steps=10, train_turns=10))
    assert max(lags) == max_lag and stats.kept_stale == 0, (lags, stats)


@pytest.mark.parametrize(
    ("median_turns", "sigma", "most_dropped"),
    [
        pytest.param(10, 0.5, 0.05, id="jitter"),  # measured 0.012; filling to depth: 0.331
        pytest.param(10, 1.0, 0.2, id="heavy-tail"),  # measured 0.137; filling to depth: 0.330
    ],
)
def test_dropped_to_started_ratio_with_lognormal_rollouts(
    heavy_tail_rollout, median_turns, sigma, most_dropped
):
    # Against a 20-turn training step a group can still be overtaken by later ones and finish stale (a
    # group of 4 samples outlasts a step 29% of the time with jitter, 67% with the heavy
    # tail), but admission starts no group that could only be taken late; filling to depth dropped a
    # third of the groups either way. With stale="keep" (the default) the late ones train, corrected.
    rollout = heavy_tail_rollout(0, median_turns=median_turns, sigma=sigma)
    pool = GroupPool(rollout, itertools.count(), group_size=4, depth=8, max_lag=1, stale="drop")
    rollout.pool = pool
    *_, stats = asyncio.run(_train(pool, n=4, steps=200, train_turns=20))
    assert stats.dropped_stale / stats.started <= most_dropped, stats
    assert stats.wasted / stats.spent <= most_dropped, stats


def test_the_cost_of_groups_never_returned_is_counted_as_wasted():
    # cost = tokens: the groups dropped as stale or filtered out are wasted; the returned ones are spent.
    async def main():
        rollout = FixedRollout(turns=1)
        pool = GroupPool(
            rollout,
            [10, 20, 30, 40],
            group_size=2,
            depth=4,
            max_lag=0,
            keep=lambda group: group.prompt != 20,
            cost=lambda sample: sample.num_tokens,
            stale="drop",
        )
        rollout.pool = pool
        async with pool:
            groups = await pool.take(1)  # 10 returned, 20 filtered; 30 and 40 wait at version 0
            await asyncio.sleep(0)
            pool.version = 1  # 30 and 40 turn stale and run again
            groups += await pool.take(2)
            return [group.prompt for group in groups], pool.stats

    returned, stats = asyncio.run(main())
    assert returned == [10, 30, 40]
    assert (stats.filtered, stats.dropped_stale) == (1, 2)
    assert stats.spent == 2 * (10 + 20 + 30 + 40 + 30 + 40)  # group_size 2: both samples of each group
    assert stats.wasted == 2 * (20 + 30 + 40)


def test_without_a_cost_each_sample_counts_one(rollout):
    async def main():
        pool = GroupPool(rollout, ["a", "b"], group_size=3, depth=2, max_lag=0, stale="drop")
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.finish("a")
            await pool.take(1)
            pool.version = 1
            rollout.finish("b")  # started at version 0: stale
            await rollout.settle()
            return pool.stats

    stats = asyncio.run(main())
    assert (stats.spent, stats.wasted) == (6, 3)
