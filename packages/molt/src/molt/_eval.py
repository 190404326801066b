"""Evaluation (`--eval.*`): pass@k on held-out rows with the current weights, through the same rollouts.

Evaluation samples go through the same `RolloutRunner` as training (the same agent, tito capture and
sampling settings), so a score means what the reward means in training; they are never trained on. A
sample that fails (the agent raised or timed out) counts as not passing and is counted in
`eval/failed`. The rows are read once, at start (`molt._data.eval_rows`).
"""

from __future__ import annotations

import asyncio
import math

import torch

from molt._rollout import Rollout, RolloutRunner
from molt.config import Config
from rlestimators import pass_at_k

__all__ = ["evaluate"]


async def evaluate(runner: RolloutRunner, rows: list[dict], config: Config) -> dict[str, float]:
    """pass@1 and pass@k (unbiased, from n samples per row) and the mean reward, as eval/* metrics."""
    n, k = config.eval.n, config.eval.k
    samples = [runner(row, i) for row in rows for i in range(n)]
    results = await asyncio.gather(*samples, return_exceptions=True)
    passed_PN = torch.tensor(
        [isinstance(r, Rollout) and r.reward >= config.eval.pass_reward for r in results]
    ).view(len(rows), n)
    rewards = [r.reward for r in results if isinstance(r, Rollout) and math.isfinite(r.reward)]
    correct_P = passed_PN.sum(dim=1)
    return {
        "eval/pass@1": pass_at_k(n, correct_P, 1).mean().item(),
        "eval/pass@k": pass_at_k(n, correct_P, k).mean().item(),
        f"eval/pass@{k}": pass_at_k(n, correct_P, k).mean().item(),
        "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "eval/failed": float(sum(not isinstance(r, Rollout) for r in results)),
    }
