"""A single-turn Env: answer an arithmetic question, reward 1 for the right number.

uv run molt train --agent.module examples/math_env.py
"""

from __future__ import annotations

from arithmetic import dataset as _rows
from arithmetic import reward

from molt import Env, Result


def dataset(seed: int):
    return _rows(seed, tools=False)


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.answer = sample["answer"]
        return sample["messages"]

    def step(self, action: str) -> Result:
        return Result(reward=reward(action, self.answer))
