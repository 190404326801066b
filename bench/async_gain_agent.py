"""The agent of bench/async_gain.py: the default recipe's task as a ChatAgent whose tool calls are slow.

An episode is two chat turns through the stock openai SDK (`AsyncOpenAI` on the rollout's tito session):
the model answers `copy the word: fox`, the agent then calls a tool, and the tool's result goes back as
a new user turn asking for the word again. The tool is simulated: a sleep drawn from a lognormal
distribution (sigma 1 by default, so a heavy tail: the slowest of 128 draws is about 8x the mean), since
a tiny policy writes no tool-call syntax. What matters to the loop is the same as with a real tool: the
episode holds its slot in the pool while the engine has nothing to do for it. The reward is the share of
the two replies that start with the word (the default recipe's rule, `molt.recipes.copy_word`).

The delays come from one seeded stream per process (`random.Random(seed)`), drawn in the order the tool
calls happen: two runs draw the same delays, though not for the same episodes. Set by the environment
variable `ASYNC_GAIN_TOOL="MEAN_S,SIGMA,SEED"` (default `1.0,1.0,0`). Each rollout reports, as
`rollout/<key>`: `turn_s` (mean seconds of its chat calls, as the SDK saw them: queueing in the engine
included) and `tool_s` (seconds of its tool call).

All episodes of a process share one `httpx.AsyncClient` under their SDK clients, as a production agent
would: a fresh client per episode builds an SSL context (tens of milliseconds of CPU), and 256 episodes
starting at once then starved the agents' event loop long enough for connects to time out.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time

import httpx
from openai import AsyncOpenAI

from molt import ChatAgent, Context, Result
from molt.recipes.copy_word import dataset

__all__ = ["AgentRunner", "dataset", "tool_delays"]


def tool_delays(mean_s: float, sigma: float, seed: int):
    """An endless seeded stream of lognormal delays with the given mean (mu = ln(mean) - sigma^2 / 2)."""
    rng = random.Random(seed)
    mu = math.log(mean_s) - sigma**2 / 2
    while True:
        yield rng.lognormvariate(mu, sigma)


_MEAN_S, _SIGMA, _SEED = (float(x) for x in os.environ.get("ASYNC_GAIN_TOOL", "1.0,1.0,0").split(","))
_DELAYS = tool_delays(_MEAN_S, _SIGMA, int(_SEED))
_HTTP: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}  # one per event loop, never closed


def _http_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:  # as many connections as episodes in flight (the pool's depth x group size)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        _HTTP[loop] = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=60.0))
    return _HTTP[loop]


class AgentRunner(ChatAgent):
    async def run(self, ctx: Context, sample: dict) -> Result:
        word = sample["word"]
        client = AsyncOpenAI(
            base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=_http_client()
        )
        messages = list(sample["messages"])
        hits, turn_s, tool_s = 0, 0.0, 0.0
        for turn in range(2):
            if turn:  # the tool call between the two replies
                tool_s = next(_DELAYS)
                await asyncio.sleep(tool_s)
                messages.append({"role": "user", "content": f"tool: ok. copy the word: {word}"})
            began = time.monotonic()
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            turn_s += time.monotonic() - began
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            hits += text.startswith(word)
        return Result(reward=hits / 2, info={"turn_s": turn_s / 2, "tool_s": tool_s})
