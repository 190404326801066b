"""The step's rollout and pool metrics (`rollout/*`, `train/staleness_mean`, `pool/*`), from what the
step took, and the evaluation's (`eval/*`, `evaluate`). The training metrics come from the actor
(`molt._objective.step_loss`); `tests/e2e/test_train_loop.py` names those every step logs.

Evaluation (`--eval.*`): pass@k on held-out rows with the current weights, through the same rollouts.
Evaluation samples go through the same `RolloutRunner` as training (the same agent, tito capture and
sampling settings), so a score means what the reward means in training; they are never trained on. A
sample that fails (the agent raised or timed out) counts as not passing and is counted in
`eval/failed`. The rows are read once, at start (`molt._data.eval_rows`).
"""

from __future__ import annotations

import asyncio

import torch

from asyncpool import PoolStats
from molt._rollout import Rollout, RolloutRunner
from molt.config import Config
from rlestimators import pass_at_k


def rollout_metrics(rollouts: list[Rollout], group_size: int) -> dict[str, float]:
    """`rollout/*`: the reward's mean and spread within groups, lengths, truncation, segments per
    rollout, and the mean of each number the agents returned in their `info`."""
    rewards_GS = torch.tensor([r.reward for r in rollouts], dtype=torch.float64).view(-1, group_size)
    infos: dict[str, list[float]] = {}
    for rollout in rollouts:
        for key, value in rollout.info.items():
            infos.setdefault(f"rollout/{key}", []).append(float(value))
    return {
        "rollout/reward_mean": rewards_GS.mean().item(),
        # 0 in groups of one
        "rollout/reward_std_in_group": rewards_GS.std(dim=1, unbiased=False).mean().item(),
        "rollout/response_len_mean": sum(len(r.sampled) for r in rollouts) / len(rollouts),
        "rollout/truncated_frac": sum(r.truncated for r in rollouts) / len(rollouts),
        "rollout/segments_mean": sum(len(r.segments) for r in rollouts) / len(rollouts),  # >1: compaction
        **{key: sum(values) / len(values) for key, values in infos.items()},
    }


def staleness_mean(rollouts: list[Rollout], trainer_version: int) -> float:
    """Mean over trained tokens of how many versions behind the trainer the weights that sampled them were."""
    lags = [trainer_version - v for rollout in rollouts for v in rollout.trained_versions]
    return sum(lags) / len(lags)


def sampled_tokens(rollout: Rollout) -> int:
    """The pool's `cost` of a rollout: the tokens the engines generated for it (so `pool/spent` and
    `pool/wasted` count generated tokens)."""
    return len(rollout.sampled)


def pool_metrics(now: PoolStats, before: PoolStats) -> dict[str, float]:
    """The pool's counters (`pool/<name>`, cumulative), `pool/dropped_stale_rate`: of the groups that
    left the pool since `before` (the last step's log: returned, dropped as stale, filtered or failed),
    the share dropped as stale, 0 when none left; and `pool/wasted_frac`: of the tokens generated for
    every group that has left the pool since the run began, the share never trained (groups dropped as
    stale or filtered out; `pool/wasted` / `pool/spent`, with `sampled_tokens` as the pool's cost). Not
    counted: groups still running or waiting to be taken, and the samples of groups that failed (their
    rollouts returned nothing to measure)."""

    def ended(stats: PoolStats) -> int:
        return stats.returned + stats.dropped_stale + stats.filtered + stats.failed

    num_ended = ended(now) - ended(before)
    dropped = now.dropped_stale - before.dropped_stale
    return {
        **{name: float(value) for name, value in now.metrics().items()},
        "pool/dropped_stale_rate": dropped / num_ended if num_ended else 0.0,
        "pool/wasted_frac": now.wasted / now.spent if now.spent else 0.0,
    }


async def evaluate(runner: RolloutRunner, rows: list[dict], config: Config) -> dict[str, float]:
    """pass@1 and pass@k (unbiased, from n samples per row) and the mean reward, as eval/* metrics."""
    n, k = config.eval.n, config.eval.k
    samples = [runner(row, i) for row in rows for i in range(n)]
    results = await asyncio.gather(*samples, return_exceptions=True)
    passed_PN = torch.tensor(
        [isinstance(r, Rollout) and r.reward >= config.eval.pass_reward for r in results]
    ).view(len(rows), n)
    rewards = [r.reward for r in results if isinstance(r, Rollout)]  # finite: `RolloutRunner` refuses others
    correct_P = passed_PN.sum(dim=1)
    return {
        "eval/pass@1": pass_at_k(n, correct_P, 1).mean().item(),
        "eval/pass@k": pass_at_k(n, correct_P, k).mean().item(),
        f"eval/pass@{k}": pass_at_k(n, correct_P, k).mean().item(),
        "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "eval/failed": float(sum(not isinstance(r, Rollout) for r in results)),
    }
