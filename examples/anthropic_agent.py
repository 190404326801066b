"""A ChatAgent on the stock anthropic SDK: the Messages API, tool_use and tool_result blocks.

The agent points `Anthropic(base_url=ctx.session_url)` at its tito session (the SDK appends
`/v1/messages` itself). Rows and reward: arithmetic.py, with the tool schema turned into Anthropic's
form and the system turn passed as `system`.

    uv run molt train --agent.module examples/anthropic_agent.py
"""

from __future__ import annotations

from anthropic import Anthropic
from arithmetic import dataset, reward, run_tool

from molt import ChatAgent, Context, Result

__all__ = ["AgentRunner", "dataset"]

MAX_TURNS = 3


def anthropic_tool(tool: dict) -> dict:
    function = tool["function"]
    return {"name": function["name"], "description": function["description"],
            "input_schema": function["parameters"]}  # fmt: skip


class AgentRunner(ChatAgent):
    def run(self, ctx: Context, sample: dict) -> Result:
        client = Anthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        system, question = sample["messages"]
        messages = [{"role": "user", "content": question["content"]}]
        tools = [anthropic_tool(tool) for tool in sample["tools"]]
        text = ""
        for _ in range(MAX_TURNS):
            reply = client.messages.create(
                model=ctx.model, system=system["content"], messages=messages, tools=tools, max_tokens=256
            )
            messages.append({"role": "assistant", "content": reply.content})
            text = "".join(block.text for block in reply.content if block.type == "text")
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                break
            results = [{"type": "tool_result", "tool_use_id": use.id, "content": run_tool(use.input)}
                       for use in uses]  # fmt: skip
            messages.append({"role": "user", "content": results})
        client.close()
        return Result(reward=reward(text, sample["answer"]))
