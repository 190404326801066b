"""A ChatAgent built with the OpenAI Agents SDK: an `Agent` with a function tool, run by the SDK's own
`Runner` on its default model (the Responses API), multi-turn, unchanged.

molt gives each rollout a tito session; the SDK's client points at it (`ctx.base_url`) and tito captures
every model call token by token, so the agent trains as it is. A reply cut at `--rollout.max_new_tokens`
is a Responses `incomplete`, which the SDK raises on: it is a truncated episode, rewarded 0 (its turns
are captured all the same). Rows and reward: arithmetic.py (the same rows as openai_agent.py).

    uv run molt train --agent.module examples/agents_sdk_agent.py
"""

from __future__ import annotations

import asyncio

from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from arithmetic import SYSTEM, dataset, reward, run_tool
from openai import AsyncOpenAI

from molt import ChatAgent, Context, Result

__all__ = ["AgentRunner", "dataset"]

MAX_TURNS = 3
set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * and parentheses, e.g. (3 + 4) * 2."""
    return run_tool({"expression": expression})


class AgentRunner(ChatAgent):
    def run(self, ctx: Context, sample: dict) -> Result:
        return asyncio.run(self._run(ctx, sample))

    async def _run(self, ctx: Context, sample: dict) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        agent = Agent(
            name="calculator",
            instructions=SYSTEM,
            tools=[calculator],
            model=OpenAIResponsesModel(model=ctx.model, openai_client=client),
        )
        question = sample["messages"][-1]["content"]
        try:
            result = await Runner.run(agent, question, max_turns=MAX_TURNS, run_config=RunConfig())
            text, truncated = str(result.final_output or ""), 0.0
        except (MaxTurnsExceeded, ModelBehaviorError):  # out of turns, or a reply cut at max tokens
            text, truncated = "", 1.0
        finally:
            await client.close()
        return Result(reward=reward(text, sample["answer"]), info={"truncated_by_sdk": truncated})
