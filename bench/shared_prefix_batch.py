"""The shared-prefix workloads of bench/actor_gpu.py (`--batches prompt4k,multiturn`): rows that begin
alike, laid out as Molt's actor gets them, with random token ids (seeded).

- `prompt4k`: 16 prompts x 8 samples. A 4096-token prompt (not trained) begins each of its group's 8
  rows, each then its own 512-token reply (trained): 128 rows of 4608 tokens, 589,824 tokens.
- `multiturn`: 2 tasks x 8 samples of an agent episode of 8 turns, each turn a reply (trained:
  reasoning, lognormal mean 160 tokens, then an answer, mean 60) and a tool output (not trained, mean
  220, sigma 1.3: the heavier tail of bench/agentic_batch.py), after a 2048-token system prompt shared
  by every row and the task (`agentic_batch.prompt_tokens`, median 400). The chat template drops earlier
  replies' reasoning, as Qwen3's does for every assistant message before the last user message (an
  agent that returns tool outputs as user messages, as bench/agentic_batch.py's does, puts one after
  every reply). Each turn's prompt then rewrites the reply before it, so tito opens a new segment per
  turn (`tito._trajectory`: a prompt that extends no segment starts one), and Molt trains each segment
  as a row (`molt.loop.run_steps`): row t of an episode is the system prompt, the task, turns 1..t-1
  as their answers and tool outputs, then reply t whole. An episode's 8 rows share its history, one
  turn more each; an episode whose tool outputs came back as tool messages would be one row instead.
  About 128 rows and 480k tokens.

`python bench/shared_prefix_batch.py` prints each batch's rows, tokens, longest row and the share of
the rows' tokens that `molt._prefix.SharedPrefixRows` saves in the micro-batches Molt plans for them.
"""

from __future__ import annotations

import random

import torch
from agentic_batch import _lognormal, prompt_tokens, tokens_batch

__all__ = ["SHARED_BATCHES", "multiturn_rows", "prompt4k_rows", "shared_batch"]


def prompt4k_rows(vocab: int, seed: int = 0) -> list:
    """16 groups of 8 rows, each a group's 4096-token prompt then its own 512-token reply."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(16):
        prompt = torch.randint(0, vocab, (4096,), generator=gen)
        for _ in range(8):
            rows.append([(prompt, False), (torch.randint(0, vocab, (512,), generator=gen), True)])
    return rows


def multiturn_rows(vocab: int, seed: int = 0, *, num_tasks: int = 2, num_samples: int = 8) -> list:
    """Each episode's 8 segments as rows (module docstring), episode after episode."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)

    def ids(count: int) -> torch.Tensor:
        return torch.randint(0, vocab, (count,), generator=gen)

    system = ids(2048)
    rows = []
    for _ in range(num_tasks):
        task = ids(prompt_tokens(rng, 16384))
        for _ in range(num_samples):
            history = [(system, False), (task, False)]
            for _ in range(8):
                reasoning, answer = ids(_lognormal(rng, 160, 1.0)), ids(_lognormal(rng, 60, 1.0))
                rows.append([*history, (torch.cat([reasoning, answer]), True)])
                history += [(answer, False), (ids(_lognormal(rng, 220, 1.3)), False)]
    return rows


SHARED_BATCHES = {"prompt4k": prompt4k_rows, "multiturn": multiturn_rows}


def shared_batch(name: str, vocab: int):
    """The `molt._batch.TrainBatch` of `SHARED_BATCHES[name]`."""
    return tokens_batch(vocab, SHARED_BATCHES[name](vocab))


def plan_shared(batch, budget: int):
    """`batch` with its micro-batches planned as `molt._group.PolicyGroup` plans them for one rank under
    --actor.shared_prefix: the rows of each shared-prefix group kept in one micro-batch."""
    import dataclasses

    from molt._packing import plan_micro_batches
    from molt._prefix import prefix_groups

    together = [
        (rows, shared) for rows, shared in prefix_groups(batch.tokens_BT, batch.row_lengths) if shared
    ]
    (micro_batches,) = plan_micro_batches(batch.row_lengths, num_ranks=1, budget=budget, together=together)
    rows = [row for mb in micro_batches for row in mb]
    local = iter(range(len(rows)))
    plan = tuple(tuple(next(local) for _ in mb) for mb in micro_batches)
    return dataclasses.replace(batch.select(rows), plan=plan)


if __name__ == "__main__":
    from molt._prefix import SharedPrefixRows

    for name in SHARED_BATCHES:
        batch = plan_shared(shared_batch(name, 151936), 65536)
        lengths = batch.row_lengths
        saved = slots = 0
        for rows in batch.plan:
            mb = batch.select(list(rows))
            layout = SharedPrefixRows.of(mb.tokens_BT, mb.row_lengths, pad_to=256)
            saved, slots = saved + layout.num_saved, slots + layout.num_packed
        print(
            f"{name}: {len(lengths)} rows, {sum(lengths):,} tokens, longest {max(lengths)}, "
            f"{batch.num_tokens:,} trained; {len(batch.plan)} micro-batches of 65,536 tokens: "
            f"shared prefixes save {saved / sum(lengths):.0%} of the tokens, {slots:,} slots"
        )
