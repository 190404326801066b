"""Evaluation (`--eval.*`): pass@k on held-out rows with the current weights, through the same rollouts.

Evaluation samples go through the same `RolloutRunner` as training (the same agent, tito capture and
sampling settings), so a score means what the reward means in training; they are never trained on. A
sample that fails (the agent raised or timed out) counts as not passing and is counted in
`eval/failed`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path

import torch

from molt._rollout import Rollout, RolloutRunner
from molt.config import Config
from rlestimators import pass_at_k

__all__ = ["eval_rows", "evaluate"]

EVAL_SEED_OFFSET = 7_919  # a generated dataset's evaluation rows come from another seed


def eval_rows(config: Config, agent_module) -> list[dict]:
    """The first `--eval.num_prompts` evaluation rows (see `--eval.path`)."""
    count = config.eval.num_prompts
    if config.eval.path:
        lines = Path(config.eval.path).read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()][:count]
        key = config.data.messages_key
        if not rows or any(key not in row for row in rows):
            raise ValueError(f"--eval.path {config.eval.path}: every row needs a {key!r} field (and rows)")
        return [{**row, "messages": row[key]} for row in rows]
    source = getattr(agent_module, "eval_dataset", None)
    if source is not None:
        return list(itertools.islice(source(config.data.seed), count))
    if hasattr(agent_module, "dataset"):
        return list(itertools.islice(agent_module.dataset(config.data.seed + EVAL_SEED_OFFSET), count))
    raise ValueError(
        f"--eval.every needs evaluation rows: pass --eval.path, or export eval_dataset(seed) from "
        f"--agent.module {config.agent.module}"
    )


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
