"""A ChatAgent that compacts its context: after each exchange it keeps only the system turn and a summary.

The task: add numbers given one per turn ("add 17", "add 5", ...), then report the total. A long-running
agent cannot keep every turn, so this one drops the earlier turns and carries a one-line summary of the
running total it computed itself. Dropping turns rewrites the prompt's prefix, so tito seals the token
trace and starts a new segment: the rollout trains as several segments with one reward (each segment's
sampled tokens get the rollout's advantage). Uses the async openai client.

    uv run molt train --agent.module examples/compacting_agent.py
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from openai import AsyncOpenAI

from molt import ChatAgent, Context, Result

__all__ = ["AgentRunner", "dataset"]

SYSTEM = "Keep a running total. Reply to each number with: Total: N"
_TOTAL = re.compile(r"Total:\s*(-?\d+)")


def dataset(seed: int) -> Iterator[dict]:
    rng = random.Random(seed)
    while True:
        numbers = [rng.randint(1, 20) for _ in range(3)]
        yield {"messages": [{"role": "system", "content": SYSTEM}], "numbers": numbers}


class AgentRunner(ChatAgent):
    async def run(self, ctx: Context, sample: dict) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        system = sample["messages"][0]
        context = [system]  # what the model sees: compacted after every exchange
        total, reply = 0, ""
        for number in sample["numbers"]:
            total += number
            context.append({"role": "user", "content": f"add {number}"})
            answer = await client.chat.completions.create(model=ctx.model, messages=context, max_tokens=32)
            reply = answer.choices[0].message.content or ""
            summary = f"(earlier turns dropped; the total so far is {total})"
            context = [system, {"role": "user", "content": summary}, {"role": "assistant", "content": "ok"}]
        await client.close()
        found = _TOTAL.findall(reply)
        return Result(reward=float(bool(found) and int(found[-1]) == total))
