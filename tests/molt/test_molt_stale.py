"""Stale groups in a molt run: the flags, the per-step stale metrics, and the stop that names a prompt.

The pool is the real `asyncpool.GroupPool`; its rollout is a stand-in that returns at once with tokens
older than the trainer (what a long-episode agent's groups look like when they finish), and tito is a
stand-in holding only the engines' liveness that `take` watches: no engine is needed for either.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from asyncpool import GroupPool, PoolStats
from molt._flags import resolve
from molt._metrics import pool_metrics, sampled_tokens
from molt._restarts import EngineRestarts
from molt.config import ConfigError
from molt.loop import take


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        pytest.param(["--rollout.max_stale_requeues", "0"], ["--rollout.max_stale_requeues"], id="cap"),
        pytest.param(
            ["--rollout.max_stale_requeues", "3"],
            ["--rollout.max_stale_requeues 3", "--rollout.stale keep", "--rollout.stale drop"],
            id="cap-without-drops",
        ),
        pytest.param(
            ["--rollout.stale", "keep", "--algo.correction.mode", "none"],
            ["--algo.correction.mode none needs on-policy rollouts"],
            id="keep-without-correction",
        ),
    ],
)
def test_stale_flags_are_refused_naming_them(args, flags):
    with pytest.raises(ConfigError) as error:
        resolve(args)
    assert all(flag in str(error.value) for flag in flags), str(error.value)


def test_stale_keep_is_the_default_and_the_cap_resolves():
    assert resolve([]).rollout.stale == "keep"  # admission makes stale groups rare: train them corrected
    rollout = resolve(["--rollout.stale", "drop", "--rollout.max_stale_requeues", "3"]).rollout
    assert (rollout.stale, rollout.max_stale_requeues) == ("drop", 3)
    on_policy = resolve(["--algo.correction.mode", "none", "--train.force_on_policy"])  # nothing goes stale
    assert on_policy.rollout.stale == "keep"


def test_pool_metrics_log_the_counters_the_steps_stale_rate_and_the_wasted_share():
    before = PoolStats(in_flight=4, started=10, returned=4, dropped_stale=2, spent=600, wasted=200)
    now = PoolStats(
        in_flight=6,
        started=22,
        returned=8,
        dropped_stale=5,
        filtered=1,
        failed=1,
        ready=1,
        spent=1600,
        wasted=400,
    )
    metrics = pool_metrics(now, before)
    # this step 4 returned, 3 dropped as stale, 1 filtered, 1 failed: 3 of the 9 groups that left
    assert metrics["pool/dropped_stale_rate"] == pytest.approx(3 / 9)
    assert (metrics["pool/dropped_stale"], metrics["pool/filtered"], metrics["pool/kept_stale"]) == (5, 1, 0)
    assert pool_metrics(now, now)["pool/dropped_stale_rate"] == 0.0  # nothing left the pool: no rate
    assert metrics["pool/wasted_frac"] == pytest.approx(400 / 1600)  # since the run began, in tokens
    assert pool_metrics(PoolStats(), PoolStats())["pool/wasted_frac"] == 0.0  # nothing generated yet


def test_the_pools_cost_is_the_tokens_the_engine_sampled():
    rollout = SimpleNamespace(sampled=[5, 6, 7])
    assert sampled_tokens(rollout) == 3


@dataclass(frozen=True)
class _Sample:
    min_version: int
    max_version: int


class _LateRollout:
    """Every sample's oldest token is two versions behind the pool's (set `pool` before entering)."""

    pool: GroupPool | None = None

    async def __call__(self, prompt, index) -> _Sample:
        await asyncio.sleep(0)
        return _Sample(self.pool.version - 2, self.pool.version)


def test_a_prompt_past_the_stale_cap_stops_the_run_naming_it_and_the_flags():
    async def main():
        rows = [{"id": "long-episode-7", "messages": []}, {"id": "b", "messages": []}]
        rollout = _LateRollout()
        pool = GroupPool(rollout, rows, group_size=2, depth=1, max_lag=1, max_requeues=2, stale="drop")
        rollout.pool = pool
        pool.version = 5
        tito = SimpleNamespace(router=SimpleNamespace(engines=[SimpleNamespace(alive=True)]))
        async with pool:
            with pytest.raises(RuntimeError) as error:
                await take(pool, 1, tito, EngineRestarts(tito.router, [], None, max_restarts=0))
        return str(error.value)

    message = asyncio.run(main())
    assert "'long-episode-7'" in message and "dropped as stale 3 times" in message
    for flag in ("--rollout.max_lag", "--rollout.max_stale_requeues", "--rollout.stale keep"):
        assert flag in message
    assert "3 stale drops during this take" in message
