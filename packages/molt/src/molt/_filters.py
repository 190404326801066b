"""The groups a run's pool rejects: `DynamicFilter` (--algo.dynamic_filter), the pool's `keep`."""

from __future__ import annotations

import collections

import torch

from molt.config import Config
from rlestimators import dynamic_filter

__all__ = ["DynamicFilter"]


class DynamicFilter:
    """--algo.dynamic_filter (DAPO's dynamic sampling, Yu et al. 2025): the pool's `keep`. A group whose
    rewards are all equal has every advantage 0, so no gradient: it is rejected and the pool backfills it.
    Each rejection is counted by prompt (its row, shown) and the reward all its samples had, so that
    `molt.loop.take`, which stops the run past `max_groups` rejections in one take, can name them."""

    def __init__(self, max_groups: int) -> None:
        self.max_groups = max_groups
        self.all_equal: collections.Counter[tuple[str, float]] = collections.Counter()

    @classmethod
    def of(cls, config: Config) -> DynamicFilter | None:
        """--algo.dynamic_filter's filter, stopping a take past --algo.dynamic_filter_max_batches x
        --rollout.prompts_per_step rejections; None when it is off."""
        algo = config.algo
        if not algo.dynamic_filter:
            return None
        return cls(algo.dynamic_filter_max_batches * config.rollout.prompts_per_step)

    def __call__(self, group) -> bool:
        rewards_S = torch.tensor([sample.reward for sample in group.samples])
        if bool(dynamic_filter(rewards_S, torch.zeros_like(rewards_S, dtype=torch.int64)).all()):
            return True
        shown = repr(group.prompt) if len(repr(group.prompt)) <= 120 else repr(group.prompt)[:117] + "..."
        self.all_equal[shown, rewards_S[0].item()] += 1
        return False

    def most_rejected(self, limit: int = 5) -> str:
        """The prompts rejected most often, with their count and reward, e.g. `{...} (40 x, reward 0)`."""
        shown = [f"{prompt} ({count} x, reward {reward:g})" for (prompt, reward), count in
                 self.all_equal.most_common(limit)]  # fmt: skip
        more = len(self.all_equal) - len(shown)
        return "; ".join(shown) + (f"; and {more} other prompts" if more > 0 else "")
