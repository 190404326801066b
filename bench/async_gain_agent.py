"""The agent of bench/async_gain.py: a recipe's task as a ChatAgent whose tool calls are slow.

An episode is two chat turns through the stock openai SDK (`AsyncOpenAI` on the rollout's tito session)
with a tool call between them: the model answers the row's question, the agent calls a tool, and the
tool's result goes back as a new user turn asking the question again. The tool is simulated: a sleep
drawn from a lognormal distribution (sigma 1 by default, so a heavy tail: the slowest of 128 draws is
about 8x the mean), since neither policy writes tool-call syntax. What matters to the loop is the same as
with a real tool: the episode holds its slot in the pool while the engine has nothing to do for it.

The task, by the environment variable `ASYNC_GAIN_TASK` (bench/async_gain.py's `--task`):

  copy_word  (default) the default recipe (`molt.recipes.copy_word`): `copy the word: fox`, then
             `tool: ok. copy the word: fox`; a reply is right when it starts with the word
  additions  the SmolLM2 recipe (`molt.recipes.smollm2`, its rows and held-out rows): `What is 14 + 9?
             Reply with the number only.`, then `tool: recorded. ` and the same question; a reply is right
             when the recipe's own rule scores it 1 (its last number is the sum). The tool's result says
             nothing of whether the first answer was right, so the second reply is asked, not helped

The reward is the share of the two replies that are right, each scored by its recipe's own rule. That is
the quantity the recipe's own reward measures (its one reply a rollout right or not: `rollout/reward_mean`
is the share of replies right), so a run's reward reads on the scale of the recipe trained without the
tool (for additions, the TRL comparison's SmolLM2 row); and both replies are trained tokens, each credited
with its own answer. The last reply's alone would score a reply that can copy the first one, and leave
the first reply's tokens with no reward of their own. The module exports the task's `dataset` and
`eval_dataset` (copy_word's refuses, as the recipe does: it has no held-out words), so molt's `--eval.*`
evaluates the additions' held-out questions through the same agent, slow tool included.

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
from molt.recipes import copy_word, smollm2

__all__ = ["AgentRunner", "dataset", "eval_dataset", "tool_delays", "tool_result"]


def tool_delays(mean_s: float, sigma: float, seed: int):
    """An endless seeded stream of lognormal delays with the given mean (mu = ln(mean) - sigma^2 / 2)."""
    rng = random.Random(seed)
    mu = math.log(mean_s) - sigma**2 / 2
    while True:
        yield rng.lognormvariate(mu, sigma)


RECIPES = {"copy_word": copy_word, "additions": smollm2}
TASK = os.environ.get("ASYNC_GAIN_TASK", "copy_word")
if TASK not in RECIPES:
    raise ValueError(f"ASYNC_GAIN_TASK={TASK!r}: choose from {sorted(RECIPES)}")
_RECIPE = RECIPES[TASK]
dataset, eval_dataset = _RECIPE.dataset, _RECIPE.eval_dataset


def tool_result(sample: dict) -> str:
    """The second turn's user message: the tool's result and the row's question again, nothing said of
    whether the first reply was right."""
    if TASK == "copy_word":
        return f"tool: ok. copy the word: {sample['word']}"
    return f"tool: recorded. {sample['messages'][-1]['content']}"


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
        client = AsyncOpenAI(
            base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=_http_client()
        )
        scorer = _RECIPE.AgentRunner()  # the recipe's own Env scores each reply (it keeps the answer)
        messages = list(scorer.reset(sample))
        hits, turn_s, tool_s = 0.0, 0.0, 0.0
        for turn in range(2):
            if turn:  # the tool call between the two replies
                tool_s = next(_DELAYS)
                await asyncio.sleep(tool_s)
                messages.append({"role": "user", "content": tool_result(sample)})
            began = time.monotonic()
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            turn_s += time.monotonic() - began
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            hits += scorer.step(text).reward
        return Result(reward=hits / 2, info={"turn_s": turn_s / 2, "tool_s": tool_s})
