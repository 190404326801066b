"""GroupPool: whole groups in completion order, depth, staleness, filtering, partial rollout, pauses."""

import asyncio
import itertools

import pytest

import asyncpool
from asyncpool import GroupPool


def test_public_names_are_pinned():
    assert asyncpool.__all__ == ["Group", "GroupPool", "PoolExhausted", "PoolStats", "PromptStarved"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"group_size": 0, "depth": 1}, "group_size >= 1", id="group_size"),
        pytest.param({"group_size": 1, "depth": 0}, "depth >= 1", id="depth"),
        pytest.param({"group_size": 1, "depth": 1, "max_lag": -1}, "max_lag >= 0", id="max_lag"),
        pytest.param({"group_size": 1, "depth": 1, "retries": -1}, "retries >= 0", id="retries"),
    ],
)
def test_bad_arguments_raise_value_error(rollout, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupPool(rollout, ["a"], **kwargs)


def test_take_returns_whole_groups_in_completion_order(rollout):
    async def main():
        pool = GroupPool(rollout, ["a", "b", "c"], group_size=2, depth=3)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            taking = asyncio.create_task(pool.take(2))
            rollout.finish("c", [1])  # half of c: never returned while its other sample runs
            rollout.finish("b")
            await rollout.settle()
            assert not taking.done()
            rollout.finish("a", [1])
            rollout.finish("a", [0])  # reverse index order: samples still come back in index order
            await rollout.settle()
            groups = await taking
        assert [group.prompt for group in groups] == ["b", "a"]
        assert [group.prompt_index for group in groups] == [1, 0]
        assert [[sample.index for sample in group.samples] for group in groups] == [[0, 1], [0, 1]]

    asyncio.run(main())


def test_depth_counts_running_and_ready_groups_and_the_next_version_backfills(rollout):
    async def main():
        pool = GroupPool(rollout, itertools.count(), group_size=2, depth=3, max_lag=2)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            assert rollout.running_prompts() == [0, 1, 2]  # depth groups x group_size rollouts
            rollout.finish(0)
            await rollout.settle()
            assert rollout.running_prompts() == [1, 2]  # a complete group holds its slot until taken
            assert pool.stats.ready == 1
            assert [group.prompt for group in await pool.take(1)] == [0]
            await rollout.settle()
            assert rollout.running_prompts() == [1, 2]  # admission: a third would be taken 3 versions late
            pool.version = 1
            await rollout.settle()
            assert rollout.running_prompts() == [1, 2, 3]
            assert len(rollout.calls) == 8  # the infinite source is read lazily, one prompt per start

    asyncio.run(main())


def test_stale_group_is_dropped_counted_and_its_prompt_requeued(rollout):
    async def main():
        pool = GroupPool(rollout, ["a", "b"], group_size=2, depth=1, max_lag=1, stale="drop")
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            pool.version = 2  # "a" started at 0: two versions behind when it completes
            rollout.finish("a")
            await rollout.settle()
            assert pool.stats.dropped_stale == 1
            assert rollout.running_prompts() == ["a"]  # requeued ahead of "b", same prompt index
            rollout.finish("a")
            [group] = await pool.take(1)
        assert (group.prompt, group.prompt_index, group.min_version) == ("a", 0, 2)

    asyncio.run(main())


def test_ready_group_that_turns_stale_before_take_is_not_returned(rollout):
    async def main():
        pool = GroupPool(rollout, ["a", "b"], group_size=1, depth=2, max_lag=1, stale="drop")
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.finish("a")
            await rollout.settle()
            assert pool.stats.ready == 1
            pool.version = 1  # one behind: still returnable
            assert pool.stats.ready == 1
            pool.version = 2  # two behind: dropped at once, and its prompt runs again
            await rollout.settle()
            assert (pool.stats.ready, pool.stats.dropped_stale) == (0, 1)
            assert rollout.running_prompts() == ["a", "b"]
            rollout.finish("b")  # b started at 0 too: stale on arrival
            rollout.finish("a")
            await rollout.settle()
            rollout.finish("b")
            groups = await pool.take(2)
        assert [(group.prompt, group.min_version) for group in groups] == [("a", 2), ("b", 2)]
        assert pool.stats.dropped_stale == 2

    asyncio.run(main())


def test_keep_rejections_are_counted_and_backfilled(rollout):
    async def main():
        pool = GroupPool(rollout, "abcd", group_size=1, depth=2, keep=lambda group: group.prompt != "a")
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.finish("a")
            await rollout.settle()
            assert pool.stats.filtered == 1
            assert rollout.running_prompts() == ["b", "c"]  # the rejected group's place went to "c"
            rollout.finish("c")
            rollout.finish("b")
            groups = await pool.take(2)
        assert [group.prompt for group in groups] == ["c", "b"]

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(5))
def test_no_prompt_is_lost_or_duplicated(random_rollout, seed):
    """Random completion order, stale drops, filtering and version jumps: each prompt ends exactly once."""
    rollout = random_rollout(seed)

    async def main():
        keep = lambda group: group.prompt % 7 != 3  # noqa: E731
        pool = GroupPool(rollout, range(60), group_size=3, depth=8, keep=keep, stale="drop")
        rollout.pool = pool
        returned = []
        async with pool:
            for step in itertools.count():
                try:
                    groups = await pool.take(4)
                except asyncpool.PoolExhausted:
                    break
                returned += [group.prompt_index for group in groups]
                assert all(pool.version - group.min_version <= 1 for group in groups)
                pool.version += 1 + step % 3  # jumps of 2 and 3 make in-flight groups stale
            stats = pool.stats
        filtered = [i for i in range(60) if i % 7 == 3]
        assert sorted(returned + filtered) == list(range(60))
        assert sorted(pool.discarded) == filtered
        assert stats.filtered == len(filtered)
        assert stats.dropped_stale > 0

    asyncio.run(main())


def test_version_bump_never_cancels_in_flight_rollouts(rollout):
    async def main():
        pool = GroupPool(rollout, ["a"], group_size=2, depth=1, max_lag=1)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.finish("a", [0])
            await rollout.settle()
            pool.version = 1  # a refit lands while sample 1 is mid-generation
            await rollout.settle()
            assert rollout.running() == [("a", 1)]
            rollout.finish("a", [1])
            [group] = await pool.take(1)
        assert rollout.cancelled == 0
        assert [(s.min_version, s.max_version) for s in group.samples] == [(0, 0), (0, 1)]
        assert (group.min_version, group.max_version) == (0, 1)

    asyncio.run(main())


def test_version_only_grows(rollout):
    pool = GroupPool(rollout, ["a"], group_size=1, depth=1)
    pool.version = 3
    with pytest.raises(ValueError, match="only grows"):
        pool.version = 2


def test_paused_holds_new_starts_until_the_block_ends(rollout):
    async def main():
        pool = GroupPool(rollout, itertools.count(), group_size=1, depth=2)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            with pool.paused():
                groups, _ = await asyncio.gather(pool.take(1), _finish_soon(rollout, 0))
                with pool.paused():  # blocks nest
                    pass
                pool.version = 1
                await rollout.settle()
                assert rollout.running_prompts() == [1]  # the taken group was not backfilled
            await rollout.settle()
            assert rollout.running_prompts() == [1, 2]
            rollout.finish(2)
            await rollout.settle()
            [group] = await pool.take(1)
        assert [g.prompt for g in groups] == [0]
        assert (group.prompt, group.min_version) == (2, 1)  # started after the refit, on the new policy

    asyncio.run(main())


async def _finish_soon(rollout, prompt):
    await rollout.settle()
    rollout.finish(prompt)
