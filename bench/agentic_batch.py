"""The agentic workload of the GPU benches: episodes of 1-12 turns, lognormal reply and tool-output lengths.

An episode (`episode`) is a prompt (standing for a system prompt and task: lognormal, median 400 tokens),
then turns: a reply the policy samples (trained; lognormal, mean 220 tokens, sigma 1), followed, except
after the last, by a tool output (not trained; lognormal, mean 220 tokens, sigma 1.3: file reads and logs
have the heavier tail). The number of turns is uniform in 1..12. An episode stays within `max_len`
tokens counting `TEMPLATE_TOKENS` of chat markup per message: a reply is cut at the room left (as the
engine cuts one at the context), and the episode ends rather than add a tool output that leaves no room
for a reply. At `max_len` 16384 a row holds 3.2k tokens on average (median 2.9k, 6.6 turns, under half
of it trained; the longest of 300 rows 11k), and 70% of the slots of 32 rows padded to their longest are
padding (`python bench/agentic_batch.py` prints these figures).

Two benches use it:

- bench/actor_gpu.py builds its batches with `train_batch`, its agentic one from `agentic_rows` (the
  segments' lengths and loss masks; the token ids are random).
- bench/loop_gpu.py trains `AgentRunner` (`--agent.module bench/agentic_batch.py`), a ChatAgent on the
  openai SDK that plays one `episode` per rollout through tito: each reply asks `max_tokens` of the plan
  (a random-weight policy almost never samples its end-of-turn token, so the reply is that long), each
  tool output is a user turn of that many random consonants (one token each with the tiny ChatML
  tokenizer, whose whole-word tokens all hold a vowel). Its `dataset(seed)` rows carry the prompts. The
  reward is a seeded uniform draw: a random policy learns nothing here, and what is measured is the cost
  of a step, for which the advantages need only be non-zero.

Seeds: the rows come from `dataset(seed)` (`--train.seed`); the turns from one `random.Random` per agent
process (seeded by the environment variable `AGENTIC_BATCH="MAX_LEN,SEED"`, default `16384,0`), drawn in
the order episodes start: two runs draw the same plans, though not for the same rows.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import string

from molt import ChatAgent, Context, Result

__all__ = ["AgentRunner", "agentic_rows", "dataset", "episode", "tokens_batch", "train_batch"]

MAX_TURNS = 12
TEMPLATE_TOKENS = 8  # chat markup per message: `<|im_start|>ROLE\n` ... `<|im_end|>\n` is 5 with ChatML
CONSONANTS = "".join(c for c in string.ascii_lowercase if c not in "aeiouy")
_MAX_LEN, _SEED = (int(x) for x in os.environ.get("AGENTIC_BATCH", "16384,0").split(","))


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A lognormal token count of the given mean (mu = ln(mean) - sigma^2 / 2), at least 1."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def prompt_tokens(rng: random.Random, max_len: int) -> int:
    """A prompt's tokens: lognormal, median 400, at most a quarter of `max_len`."""
    return min(max_len // 4, max(1, round(rng.lognormvariate(math.log(400), 0.6))))


def episode(rng: random.Random, prompt: int, max_len: int) -> list[tuple[int, bool]]:
    """One episode as (tokens, trained) segments: the prompt, then replies (trained) and tool outputs."""
    segments, used = [(prompt, False)], prompt + TEMPLATE_TOKENS
    num_turns = rng.randint(1, MAX_TURNS)
    for turn in range(num_turns):
        reply = min(_lognormal(rng, 220, 1.0), max_len - used - TEMPLATE_TOKENS)
        segments.append((reply, True))
        used += reply + TEMPLATE_TOKENS
        tool = _lognormal(rng, 220, 1.3)
        if turn == num_turns - 1 or used + tool + 2 * TEMPLATE_TOKENS + 1 > max_len:
            break
        segments.append((tool, False))
        used += tool + TEMPLATE_TOKENS
    return segments


def agentic_rows(num_tokens: int, max_len: int, seed: int = 0) -> list[list[tuple[int, bool]]]:
    """Episodes (`episode`) drawn from `seed` until their tokens reach `num_tokens`."""
    rng, rows, total = random.Random(seed), [], 0
    while total < num_tokens:
        rows.append(episode(rng, prompt_tokens(rng, max_len), max_len))
        total += sum(n for n, _ in rows[-1])
    return rows


def train_batch(vocab: int, rows: list[list[tuple[int, bool]]]):
    """A right-padded `molt._batch.TrainBatch` of `rows` (segments' lengths): random token ids, the rest
    as `tokens_batch`."""
    import torch

    gen = torch.Generator().manual_seed(1)
    lengths = [sum(n for n, _ in row) for row in rows]
    ids_BT = torch.randint(0, vocab, (len(rows), max(lengths)), generator=gen)
    segments = []
    for b, row in enumerate(rows):
        bounds = [0, *itertools.accumulate(n for n, _ in row)]
        pieces = zip(itertools.pairwise(bounds), row, strict=True)
        segments.append([(ids_BT[b, start:stop], trained) for (start, stop), (_, trained) in pieces])
    return tokens_batch(vocab, segments, gen)


def tokens_batch(vocab: int, rows: list, gen=None):
    """A right-padded `molt._batch.TrainBatch` of rows given as (token ids [n], trained) segments: the loss
    mask 1 on trained segments, advantages +-1 per row, engine logprobs near a random model's
    -log(vocab), drawn from `gen` (seeded 1 if None)."""
    import torch

    from molt._batch import TrainBatch

    gen = gen or torch.Generator().manual_seed(1)
    lengths = [sum(len(ids) for ids, _ in row) for row in rows]
    tokens_BT = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
    mask_BT = torch.zeros(len(rows), max(lengths))
    for b, row in enumerate(rows):
        tokens_BT[b, : lengths[b]] = torch.cat([ids for ids, _ in row])
        mask_BT[b, : lengths[b]] = torch.cat(
            [torch.full((len(ids),), float(trained)) for ids, trained in row]
        )
    advantages_B = torch.where(torch.rand(len(rows), generator=gen) < 0.5, -1.0, 1.0)
    noise_BT = 0.1 * torch.randn(*mask_BT.shape, generator=gen)
    rollout_logp_BT = (noise_BT - torch.log(torch.tensor(float(vocab)))) * mask_BT
    return TrainBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        rollout_logp_BT=rollout_logp_BT,
        advantages_BT=advantages_B[:, None] * mask_BT,
        num_tokens=int(mask_BT.sum()),
        num_seqs=int((mask_BT != 0).any(dim=1).sum()),
        lengths_B=torch.tensor(lengths, dtype=torch.int64),
    )


def dataset(seed: int):
    """An endless stream of rows: one user message of a lognormal number of consonants (`prompt_tokens`)."""
    rng = random.Random(seed)
    while True:
        num = prompt_tokens(rng, _MAX_LEN)
        text = "".join(rng.choices(CONSONANTS, k=num))
        yield {"messages": [{"role": "user", "content": text}], "prompt_tokens": num}


_RNG = random.Random(_SEED)
_HTTP: dict = {}  # one httpx client per event loop, shared by its episodes (bench/async_gain_agent.py)


def _http_client():
    import httpx

    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        _HTTP[loop] = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=60.0))
    return _HTTP[loop]


class AgentRunner(ChatAgent):
    async def run(self, ctx: Context, sample: dict) -> Result:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=_http_client()
        )
        plan = episode(_RNG, sample["prompt_tokens"], _MAX_LEN)
        messages = list(sample["messages"])
        for tokens, trained in plan[1:]:
            if trained:  # a reply of `tokens` (module docstring)
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, max_tokens=tokens
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            else:  # a tool output of `tokens`
                messages.append({"role": "user", "content": "".join(_RNG.choices(CONSONANTS, k=tokens))})
        turns = sum(trained for _, trained in plan)
        return Result(reward=_RNG.random(), info={"turns": turns, "planned_tokens": sum(n for n, _ in plan)})


if __name__ == "__main__":
    import statistics

    for max_len in (4096, 16384):
        rows = agentic_rows(10**6, max_len)
        lengths = [sum(n for n, _ in row) for row in rows]
        trained = sum(n for row in rows for n, t in row if t) / sum(lengths)
        turns = statistics.mean(sum(t for _, t in row) for row in rows)
        padding = 1 - statistics.mean(lengths[:32]) / max(lengths[:32])
        print(
            f"max_len {max_len}: {len(rows)} rows, mean {statistics.mean(lengths):.0f} tokens, median "
            f"{statistics.median(lengths):.0f}, max {max(lengths)}, {turns:.1f} turns, {trained:.0%} "
            f"trained; 32 rows padded to their longest: {padding:.0%} padding"
        )
