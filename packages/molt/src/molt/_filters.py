"""The group filters of `--algo.filters`: `FILTERS` maps each name to a plain function `(group) -> bool`,
True to keep the finished group; `GroupFilters` composes those a run names into the pool's `keep`.

A filter sees a whole group (its `prompt` and `samples`, the rollouts) and keeps or drops all of it: dropping
single samples would change the baseline the others are measured against. A dropped group is replaced by
a new one (asyncpool's backfill), and its tokens are counted as wasted (`pool/wasted_frac`). Staleness is
judged before any filter: a stale group is run again, never filtered. The first paragraph of a filter's
docstring is what a run stopped by too many drops says of it (`GroupFilters.most_dropped`).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Sequence

import torch

from molt.config import Config
from rlestimators import dynamic_filter


def all_equal_rewards(group) -> bool:
    """Drops a group whose rewards are all equal: under a group baseline every advantage is 0, so it adds no
    gradient (DAPO's dynamic sampling, Yu et al. 2025, §3.2). Many such groups mean the reward does not
    separate the samples: check the reward function, let samples differ (--rollout.temperature,
    --rollout.group_size) or pick prompts of another difficulty.

    A group of one sample is all-equal. The same rule as `rlestimators.dynamic_filter`, which it calls."""
    rewards_S = torch.tensor([sample.reward for sample in group.samples], dtype=torch.float64)
    return bool(dynamic_filter(rewards_S, torch.zeros_like(rewards_S, dtype=torch.int64)).all())


def truncated(group) -> bool:
    """Drops a group with a sample whose last reply was cut at the token limit (the engine's finish reason
    `length`; rollout/truncated_frac counts them): its reward scores an answer that never ended. Many
    mean the budget is short: raise --rollout.max_new_tokens (and --vllm.max_model_len).

    DAPO's overlong filtering (Yu et al. 2025, §3.4) masks the loss of such samples alone; here the whole
    group goes, so no truncated sample sits in a baseline either."""
    return not any(sample.truncated for sample in group.samples)


# --algo.filters' names (`molt._config_algo.FilterName`, a test checks the two agree) -> the filter.
FILTERS = {"all_equal_rewards": all_equal_rewards, "truncated": truncated}


class GroupFilters:
    """--algo.filters as the pool's `keep`: a group is kept when every named filter keeps it, tried in the
    order named; the first that drops it is charged with it. Counts, by filter: `num_dropped` over the run
    (the `pool/filtered/<name>` metrics), and `dropped` by prompt (shown) and rewards over one take, so
    that `molt.loop.take`, which stops the run past `max_groups` drops in one take, can name them."""

    def __init__(self, names: Sequence[str], max_groups: int) -> None:
        self.names, self.max_groups = list(names), max_groups
        self.num_dropped = collections.Counter(dict.fromkeys(self.names, 0))
        self.dropped: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    @classmethod
    def of(cls, config: Config) -> GroupFilters | None:
        """--algo.filters, stopping a take past --algo.filter_max_batches x --rollout.prompts_per_step
        drops; None when no filter is named."""
        algo = config.algo
        if not algo.filters:
            return None
        return cls(algo.filters, algo.filter_max_batches * config.rollout.prompts_per_step)

    def __call__(self, group) -> bool:
        for name in self.names:
            if not FILTERS[name](group):
                self.num_dropped[name] += 1
                self.dropped[name][_shown(group.prompt), _rewards(group)] += 1
                return False
        return True

    def metrics(self) -> dict[str, float]:
        """`pool/filtered/<name>`: the groups each filter dropped since the run began (as `pool/filtered`)."""
        return {f"pool/filtered/{name}": float(count) for name, count in self.num_dropped.items()}

    def most_dropped(self, limit: int = 5) -> str:
        """Each filter's drops in this take, the prompts it dropped most often with their count and rewards,
        and what it drops, e.g. `all_equal_rewards dropped 40 groups, most often {...} (40 x, reward 0).
        all_equal_rewards: Drops a group whose ...`."""
        parts = []
        for name in self.names:
            if not (mine := self.dropped[name]):
                continue
            shown = [
                f"{prompt} ({count} x, {rewards})" for (prompt, rewards), count in mine.most_common(limit)
            ]
            more = len(mine) - len(shown)
            doc = " ".join((inspect.getdoc(FILTERS[name]) or "").split("\n\n")[0].split())
            parts.append(
                f"{name} dropped {mine.total()} groups, most often {'; '.join(shown)}"
                f"{f'; and {more} other prompts' if more > 0 else ''}. {name}: {doc}"
            )
        return " ".join(parts)


def _shown(prompt) -> str:
    text = repr(prompt)
    return text if len(text) <= 120 else text[:117] + "..."


def _rewards(group) -> str:
    rewards = [sample.reward for sample in group.samples]
    low, high = min(rewards), max(rewards)
    return f"reward {low:g}" if low == high else f"rewards {low:g} to {high:g}"
