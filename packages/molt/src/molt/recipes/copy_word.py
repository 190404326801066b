"""The default recipe: copy a word. The prompt `copy the word: fox` earns reward 1 when the reply starts
with `fox`.

It is the smallest task on which a tiny random policy learns within minutes on a CPU: the seeded tiny
model (`molt.tiny`) has one token per task word among ~115, so a group of 8 samples finds the answer
often enough to give a signal. `molt train` with no flags trains it.

It has no held-out prompts: the tiny model has a single token for each of these five words only, and
every one is trained, so `eval_dataset` refuses `--eval.every` (an evaluation here would score the
training prompts) rather than report them as held out.
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


def eval_dataset(seed: int) -> Iterator[dict]:
    raise ValueError(
        f"the copy_word recipe has no held-out prompts: its words {', '.join(WORDS)} are the tiny model's "
        "only single-token words and all are trained, so eval/* would score the training prompts; drop "
        "--eval.every, or pass --eval.path with prompts training never draws"
    )


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.word = sample["word"]
        return sample["messages"]

    def step(self, action: str) -> Result:
        return Result(reward=float(action.startswith(self.word)))
