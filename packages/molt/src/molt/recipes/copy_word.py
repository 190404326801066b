"""The default recipe: copy a word. The prompt `copy the word: fox` earns reward 1 when the reply starts
with `fox`.

It is the smallest task on which a tiny random policy learns within minutes on a CPU: the seeded tiny
model (`molt.tiny`) has one token per task word among ~115, so a group of 8 samples finds the answer
often enough to give a signal. `molt train` with no flags trains it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from molt.agent import Env, Result

WORDS = ("fox", "cat", "dog", "owl", "bee")


def dataset(seed: int) -> Iterator[dict]:
    """An endless stream of rows, each word equally often, in a seeded order."""
    rng = random.Random(seed)
    while True:
        for word in rng.sample(WORDS, len(WORDS)):
            yield {"messages": [{"role": "user", "content": f"copy the word: {word}"}], "word": word}


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.word = sample["word"]
        return sample["messages"]

    def step(self, action: str) -> Result:
        return Result(reward=float(action.startswith(self.word)))
