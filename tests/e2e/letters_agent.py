"""A dense-reward agent for the end-to-end runs: the default recipe's prompts (`copy the word: fox`), and
as reward the share of the reply's characters that are lowercase letters. The untrained tiny model's
replies (printable ASCII and a few whole words) score anywhere between 0 and 1, so the samples of a group
differ and every estimator has advantages from the first step."""

from __future__ import annotations

import string

from molt.agent import Env, Result
from molt.recipes.copy_word import dataset

__all__ = ["AgentRunner", "dataset"]


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        return sample["messages"]

    def step(self, action: str) -> Result:
        lowercase = sum(char in string.ascii_lowercase for char in action)
        return Result(reward=lowercase / max(1, len(action)))
