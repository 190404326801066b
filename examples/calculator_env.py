"""A multi-turn tool-use Env: the model may call a calculator before it answers.

The framework owns the LLM loop: each reply comes to `step` as text; a Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in it is run, and its result goes back as a
`tool` message, which continues the episode on the same token trace. Rows (with the tool schema) come
from arithmetic.py, the same rows the ChatAgent examples use.

    uv run molt train --agent.module examples/calculator_env.py --agent.max_turns 3
"""

from __future__ import annotations

import json
import re

from arithmetic import dataset, reward, run_tool

from molt import Env, Result

__all__ = ["AgentRunner", "dataset"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.answer = sample["answer"]
        return sample["messages"]

    def step(self, action: str) -> Result:
        calls = _CALL.findall(action)
        if not calls:
            return Result(reward=reward(action, self.answer))
        try:
            call = json.loads(calls[0])
            known = call.get("name") == "calculator"
            output = run_tool(call["arguments"]) if known else "error: the only tool is calculator"
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
            output = 'error: a tool call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
        return Result(observation=[{"role": "tool", "content": output}], info={"tool_calls": 1.0})
