"""GroupPool: retries and failures, strict on-policy, exit without leaks, exhaustion, stats."""

import asyncio
import dataclasses
import itertools
import logging

import pytest

from asyncpool import GroupPool, PoolExhausted, PoolStats


def test_a_rollout_that_raises_is_retried(rollout):
    async def main():
        pool = GroupPool(rollout, ["a"], group_size=2, depth=1, retries=2, retry_delay=0)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.fail("a", 1, RuntimeError("engine hiccup"))
            await rollout.settle()
            rollout.fail("a", 1, RuntimeError("engine hiccup"))
            await rollout.settle()
            rollout.finish("a")
            [group] = await pool.take(1)
        assert [sample.index for sample in group.samples] == [0, 1]
        assert (pool.stats.retried, pool.stats.failed) == (2, 0)
        assert rollout.calls.count(("a", 1)) == 3

    asyncio.run(main())


def test_a_rollout_that_keeps_raising_drops_its_group_and_is_logged_once(rollout, caplog):
    async def main():
        pool = GroupPool(rollout, ["a", "b"], group_size=2, depth=1, retries=1, retry_delay=0)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.fail("a", 0, ValueError("bad tool call"))
            await rollout.settle()
            rollout.fail("a", 0, ValueError("bad tool call"))
            await rollout.settle()
            assert rollout.cancelled == 1  # the failed group's other sample stops using the engine
            assert pool.stats.failed == 1
            assert pool.discarded == [0]
            assert rollout.running_prompts() == ["b"]  # backfilled: the pool carries on
            rollout.finish("b")
            [group] = await pool.take(1)
        assert group.prompt == "b"

    with caplog.at_level(logging.INFO, logger="asyncpool"):
        asyncio.run(main())
    [traceback] = [record for record in caplog.records if record.exc_info]  # the first failure's
    assert "bad tool call" in traceback.exc_text
    [drop] = [record for record in caplog.records if "dropped" in record.getMessage()]
    assert "prompt 0" in drop.getMessage() and drop.levelno == logging.WARNING  # a repeat: one line


def test_an_instant_failure_backs_off_and_its_traceback_is_logged_once(caplog):
    attempts: list[float] = []

    async def broken(prompt, index):
        attempts.append(asyncio.get_running_loop().time())
        raise KeyError("no such tool")

    async def main():
        pool = GroupPool(broken, ["a", "b", "c"], group_size=2, depth=3, retries=2, retry_delay=0.05)
        async with pool:
            with pytest.raises(PoolExhausted):
                await pool.take(1)
        assert (pool.stats.failed, pool.stats.retried) == (3, 12)

    with caplog.at_level(logging.DEBUG, logger="asyncpool"):
        asyncio.run(main())
    # 3 prompts x 2 samples x (1 + 2 retries) at most. A group fails as soon as one sample runs out of
    # retries, so its sibling, on the same back-off schedule, may lose its last attempt (seen once: 17).
    assert 3 * (3 + 2) <= len(attempts) <= 18
    assert attempts[-1] - attempts[0] >= 0.05 + 0.1  # the back-off doubles: 0.05 s, then 0.1 s
    assert len([record for record in caplog.records if record.exc_info]) == 1


def test_keep_that_raises_or_a_malformed_sample_fails_the_group(caplog):
    async def bare(prompt, index):
        return "no versions" if prompt == "bare" else _Sample(0, 0)

    def keep(group):
        if group.prompt == "boom":
            raise KeyError("reward missing")
        return True

    async def main():
        pool = GroupPool(bare, ["bare", "boom", "ok"], group_size=1, depth=1, retries=0, keep=keep)
        async with pool:
            [group] = await pool.take(1)
        assert group.prompt == "ok"
        assert pool.stats.failed == 2
        assert pool.discarded == [0, 1]

    with caplog.at_level(logging.ERROR, logger="asyncpool"):
        asyncio.run(main())
    assert len(caplog.records) == 2


def test_strict_on_policy_never_mixes_versions(random_rollout):
    """max_lag=0 and depth == n: each step's groups start after the previous refit and finish before
    the next one, so every token of every batch carries the version the batch is trained at."""
    rollout = random_rollout(seed=0)

    async def main():
        pool = GroupPool(rollout, itertools.count(), group_size=4, depth=3, max_lag=0)
        rollout.pool = pool
        async with pool:
            for step in range(6):
                groups = await pool.take(3)
                assert {(s.min_version, s.max_version) for g in groups for s in g.samples} == {(step, step)}
                started = len(rollout.started)
                for _ in range(100):  # the trainer trains: nothing may start at the old version
                    await asyncio.sleep(0)
                assert len(rollout.started) == started == 12 * (step + 1)
                pool.version = step + 1
        assert all(version == index // 12 for index, (_, _, version) in enumerate(rollout.started))

    asyncio.run(main())


def test_strict_take_again_without_a_refit_starts_new_groups(random_rollout):
    rollout = random_rollout(seed=1)

    async def main():
        pool = GroupPool(rollout, itertools.count(), group_size=2, depth=2, max_lag=0)
        rollout.pool = pool
        async with pool:
            first = await pool.take(2)
            second = await pool.take(2)  # e.g. gradient accumulation: the hold must not deadlock
        assert sorted(g.prompt for g in first + second) == [0, 1, 2, 3]
        assert {g.max_version for g in first + second} == {0}

    asyncio.run(main())


def test_leaving_the_context_cancels_in_flight_rollouts_without_leaking_tasks(rollout):
    async def main():
        pool = GroupPool(rollout, itertools.count(), group_size=3, depth=4)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.finish(0)
            await pool.take(1)
            await rollout.settle()
            assert len(rollout.running()) == 9  # 3 groups: admission holds the 4th (n=1, max_lag=1)
        assert rollout.cancelled == 9
        assert asyncio.all_tasks() == {asyncio.current_task()}
        with pytest.raises(RuntimeError, match="open pool"):
            await pool.take(1)
        with pytest.raises(RuntimeError, match="only once"):
            await pool.__aenter__()

    asyncio.run(main())


def test_an_exhausted_source_returns_the_last_groups_then_raises(rollout):
    async def main():
        pool = GroupPool(rollout, ["a", "b", "c"], group_size=1, depth=2)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.finish("a")
            rollout.finish("b")
            assert [g.prompt for g in await pool.take(2)] == ["a", "b"]
            await rollout.settle()
            rollout.finish("c")
            assert [g.prompt for g in await pool.take(2)] == ["c"]  # short: the source is used up
            with pytest.raises(PoolExhausted):
                await pool.take(2)
            with pytest.raises(PoolExhausted):
                await pool.take(1)

    asyncio.run(main())


def test_a_prompt_source_that_raises_ends_the_pool_with_its_error_as_cause(random_rollout, caplog):
    def prompts():
        yield "a"
        raise OSError("dataset shard missing")

    rollout = random_rollout(seed=2)

    async def main():
        async with GroupPool(rollout, prompts(), group_size=1, depth=2) as pool:
            rollout.pool = pool
            assert [g.prompt for g in await pool.take(2)] == ["a"]
            with pytest.raises(PoolExhausted) as raised:
                await pool.take(2)
        assert isinstance(raised.value.__cause__, OSError)

    with caplog.at_level(logging.ERROR, logger="asyncpool"):
        asyncio.run(main())
    assert "prompt source raised" in caplog.records[0].getMessage()


def test_take_asks_for_at_most_depth_groups(rollout):
    async def main():
        async with GroupPool(rollout, ["a"], group_size=1, depth=2) as pool:
            with pytest.raises(ValueError, match="depth"):
                await pool.take(3)

    asyncio.run(main())


def test_stats_account_for_every_group_and_the_trainers_wait(rollout):
    async def main():
        keep = lambda group: group.prompt != "b"  # noqa: E731
        pool = GroupPool(rollout, "abcdefg", group_size=1, depth=3, retries=0, keep=keep, stale="drop")
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            rollout.fail("a", 0, RuntimeError("x"))  # failed
            rollout.finish("b")  # filtered
            rollout.finish("c")
            await rollout.settle()
            pool.version = 1
            rollout.finish("d")
            await rollout.settle()
            assert [g.prompt for g in await pool.take(2)] == ["c", "d"]
            pool.version = 2
            rollout.finish("e")  # started at version 0: stale, so it runs again
            await rollout.settle()
            rollout.finish("f")
            taking = asyncio.create_task(pool.take(2))
            await asyncio.sleep(0)  # the take starts waiting before the clock below starts
            await asyncio.sleep(0.02)  # the trainer waits: this is what take_wait_s reports
            rollout.finish("g")
            assert [g.prompt for g in await taking] == ["f", "g"]
            stats = pool.stats
        expected = PoolStats(in_flight=1, started=8, returned=4, dropped_stale=1, filtered=1, failed=1)
        expected.spent, expected.wasted = 6, 2  # a sample costs 1: 4 returned, e dropped, b filtered
        assert stats == dataclasses.replace(expected, take_wait_s=stats.take_wait_s)
        assert stats.take_wait_s >= 0.019
        ended = stats.returned + stats.dropped_stale + stats.filtered + stats.failed
        assert stats.started == stats.in_flight + stats.ready + ended
        assert stats.metrics()["pool/dropped_stale"] == 1
        assert list(stats.metrics()) == [f"pool/{field.name}" for field in dataclasses.fields(PoolStats)]

    asyncio.run(main())


class _Sample:
    def __init__(self, min_version, max_version):
        self.min_version, self.max_version = min_version, max_version
