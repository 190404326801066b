"""A ChatAgent on the stock openai SDK with tools: the code an agent developer already has.

molt gives each rollout a tito session; the agent points `OpenAI(base_url=...)` at it and runs its own
loop (call the model, run the tool calls it asks for, send the results back). tito captures every turn
token by token, so this trains as-is. Rows and reward: arithmetic.py (the same rows as
calculator_env.py).

    uv run molt train --agent.module examples/openai_agent.py
"""

from __future__ import annotations

import json

from arithmetic import dataset, reward, run_tool
from openai import OpenAI

from molt import ChatAgent, Context, Result

__all__ = ["AgentRunner", "dataset"]

MAX_TURNS = 3


class AgentRunner(ChatAgent):
    def run(self, ctx: Context, sample: dict) -> Result:
        client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(sample["messages"])
        tool_calls = 0
        for _ in range(MAX_TURNS):
            reply = client.chat.completions.create(
                model=ctx.model, messages=messages, tools=sample["tools"], max_tokens=256
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                tool_calls += 1
                output = run_tool(json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        client.close()
        # The model's last reply is scored (a tool result is not its answer, and may echo an argument).
        return Result(reward=reward(message.content or "", sample["answer"]),
                      info={"tool_calls": float(tool_calls)})  # fmt: skip
