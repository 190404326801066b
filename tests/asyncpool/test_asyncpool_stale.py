"""Stale groups cannot starve a run: the per-prompt requeue cap, `stale="keep"`, and heavy-tailed agents.

`HeavyTailRollout` (conftest) stands in for a long-episode agent: each call lasts a lognormal number of
event-loop turns, and a trainer loop advances the version every few turns, so slow groups arrive stale the
way they do against a real trainer.
"""

import asyncio
import pickle

import pytest

from asyncpool import GroupPool, PoolExhausted, PromptStarved


def test_a_prompt_dropped_stale_past_the_cap_raises_from_take_naming_it(rollout):
    async def main():
        pool = GroupPool(
            rollout, ["slow", "other", "fresh"], group_size=1, depth=2, max_requeues=2, stale="drop"
        )
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            for _ in range(2):  # both prompts twice: the cap counts per prompt, not in total
                pool.version += 2
                rollout.finish("slow")
                rollout.finish("other")
                await rollout.settle()
            assert pool.stats.dropped_stale == 4
            rollout.finish("other")  # two drops, then fresh: returned, never starved
            assert [group.prompt for group in await pool.take(1)] == ["other"]
            pool.version += 2
            rollout.finish("slow")  # its third stale drop: more than max_requeues=2
            await rollout.settle()
            with pytest.raises(
                PromptStarved, match=r"prompt 0 \('slow'\) was dropped as stale 3 times"
            ) as err:
                await pool.take(1)
            assert (err.value.prompt, err.value.prompt_index, err.value.drops) == ("slow", 0, 3)
            assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)
            assert rollout.running_prompts() == ["fresh"]  # "slow" is not run again; the pool goes on
            assert pool.discarded == [0]
            stats = pool.stats
        assert stats.dropped_stale == 5
        ended = stats.returned + stats.dropped_stale + stats.filtered + stats.failed
        assert stats.started == stats.in_flight + stats.ready + ended

    asyncio.run(main())


def test_a_prompt_starved_while_take_waits_ends_that_take(rollout):
    async def main():
        pool = GroupPool(rollout, ["slow", "b"], group_size=1, depth=2, max_requeues=1, stale="drop")
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            pool.version += 2
            rollout.finish("slow")
            await rollout.settle()
            taking = asyncio.create_task(pool.take(1))
            await rollout.settle()
            pool.version += 2
            rollout.finish("slow")
            await rollout.settle()
            with pytest.raises(PromptStarved, match="'slow'"):
                await taking

    asyncio.run(main())


@pytest.mark.parametrize("kwargs", [{}, {"stale": "keep"}], ids=["default", "keep"])
def test_stale_keep_returns_stale_groups_and_counts_them(rollout, kwargs):
    async def main():
        pool = GroupPool(rollout, ["a", "b"], group_size=2, depth=2, max_lag=1, **kwargs)
        rollout.pool = pool
        async with pool:
            await rollout.settle()
            pool.version = 3  # "a" and "b" started at 0: three versions behind
            rollout.finish("a")
            await rollout.settle()
            [group] = await pool.take(1)
            stats = pool.stats
        assert (group.prompt, group.min_version, group.max_version) == ("a", 0, 3)
        assert (stats.dropped_stale, stats.kept_stale, stats.returned) == (0, 1, 1)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"max_requeues": 0}, "max_requeues >= 1", id="max_requeues"),
        pytest.param({"stale": "skip"}, "stale='drop' or stale='keep'", id="stale"),
    ],
)
def test_bad_stale_arguments_raise_value_error(rollout, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupPool(rollout, ["a"], group_size=1, depth=1, **kwargs)


async def _train(pool, *, batch, train_turns):
    """A trainer: take a batch, train for a few turns, bump the version; until the prompts run out.
    Returns the prompts returned, how many versions behind the trainer each was when returned, the
    prompts starved (each from a `PromptStarved`) and the stats."""
    returned, lags, starved = [], [], []
    async with pool:
        while True:
            try:
                groups = await pool.take(batch)
            except PromptStarved as err:
                assert f"prompt {err.prompt_index} ({err.prompt!r})" in str(err)  # it names the prompt
                starved.append(err.prompt)
                continue
            except PoolExhausted:
                return returned, lags, starved, pool.stats
            returned += [group.prompt for group in groups]
            lags += [pool.version - group.min_version for group in groups]
            for _ in range(train_turns):
                await asyncio.sleep(0)
            pool.version += 1


def _run(rollout, num_prompts, stale="drop", **pool_kwargs):
    pool = GroupPool(
        rollout, range(num_prompts), group_size=4, depth=8, max_lag=1, stale=stale, **pool_kwargs
    )
    rollout.pool = pool
    return asyncio.run(_train(pool, batch=4, train_turns=20))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("long_factor", [1.0, 6.0], ids=["same-tail", "long-agent"])
def test_heavy_tailed_rollouts_are_not_dropped_forever(heavy_tail_rollout, seed, long_factor):
    # Lognormal latency (sigma 1) for every prompt; with long-agent, every 4th prompt is also 6x slower,
    # so its groups often finish several versions behind. Under the default cap each prompt comes back.
    rollout = heavy_tail_rollout(seed, median_turns=10, sigma=1.0, long_every=4, long_factor=long_factor)
    returned, lags, starved, stats = _run(rollout, 200)
    assert starved == []
    assert sorted(returned) == list(range(200))  # each prompt returned once, none lost
    assert stats.dropped_stale > 0 and max(rollout.starts.values()) >= 3  # rerun after stale drops
    assert max(lags) <= 1


@pytest.mark.parametrize("seed", range(3))
def test_a_long_episode_agent_past_the_cap_is_named_never_lost(heavy_tail_rollout, seed):
    rollout = heavy_tail_rollout(seed, median_turns=10, sigma=1.0, long_every=4, long_factor=6.0)
    returned, lags, starved, stats = _run(rollout, 200, max_requeues=2)
    assert starved, "the test must drive a long prompt past the cap"
    assert all(rollout.is_long(prompt) for prompt in starved)  # only the long agent starves
    assert all(rollout.starts[prompt] == 3 for prompt in starved)  # run once, rerun max_requeues times
    assert sorted(returned + starved) == list(range(200))  # none lost, none twice
    assert max(lags) <= 1


@pytest.mark.parametrize("seed", range(3))
def test_stale_keep_drops_nothing_from_a_long_episode_agent(heavy_tail_rollout, seed):
    rollout = heavy_tail_rollout(seed, median_turns=10, sigma=1.0, long_every=4, long_factor=6.0)
    returned, lags, starved, stats = _run(rollout, 200, stale="keep")
    assert (starved, stats.dropped_stale) == ([], 0)
    assert sorted(returned) == list(range(200))
    assert max(rollout.starts.values()) == 1  # nothing was rerun
    assert stats.kept_stale == sum(lag > 1 for lag in lags) > 0  # stale groups were returned, and counted
