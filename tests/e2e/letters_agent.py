"""A dense-reward agent for the end-to-end runs: the default recipe's prompts (`copy the word: fox`), and
as reward the share of the word's letters that appear in the reply. Even the untrained tiny model's
samples differ in it within a group, so every estimator has advantages from the first step."""

from __future__ import annotations

from molt.agent import Env, Result
from molt.recipes.copy_word import dataset

__all__ = ["AgentRunner", "dataset"]


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.letters = set(sample["word"])
        return sample["messages"]

    def step(self, action: str) -> Result:
        return Result(reward=len(self.letters & set(action)) / len(self.letters))
