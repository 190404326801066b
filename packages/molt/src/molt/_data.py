"""The dataset rows a run trains and evaluates on (`--data.*`, `--eval.path`).

Training rows stream without end: a `--data.path` JSONL file reshuffled every epoch, or the agent module's
`dataset(seed)`. `RowStream` hands them to the pool and remembers which the run consumed, so a resumed run
skips exactly those. Evaluation rows (`eval_rows`) are a fixed list, never trained on, and held out:
`check_held_out` compares their prompts with the rows the run will train on, refuses an evaluation set
that is all training prompts and names the overlap of one that is partly. A JSONL row's chat messages are
read from its `--data.messages_key` field into `messages`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from molt.config import Config

EVAL_SEED_OFFSET = 7_919  # a generated dataset's evaluation rows come from another seed


def read_rows(config: Config, agent_module) -> Iterator[dict]:
    """Dataset rows: `--data.path` JSONL (reshuffled every epoch), or the agent module's `dataset(seed)`.
    The file is read in this call, not at the first row drawn: a malformed one fails before Ray starts."""
    if not config.data.path:  # the agent module has dataset(seed) (`molt._checks.check_agent`)
        return iter(agent_module.dataset(config.data.seed))
    rows = _read_jsonl(config.data.path, "--data.path", config.data.messages_key)
    rng = random.Random(config.data.seed)
    return (row for _ in itertools.count() for row in rng.sample(rows, len(rows)))  # one sample per epoch


def _read_jsonl(path: str, flag: str, key: str, limit: int | None = None) -> list[dict]:
    """The rows of a JSONL file (the first `limit`), each with its chat messages (field `key`) also under
    `messages`; refuses a file without rows or a row without that field."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:limit]
    if not rows or any(key not in row for row in rows):
        raise ValueError(f"{flag} {path}: every row needs a {key!r} field (and it has rows)")
    return [{**row, "messages": row[key]} for row in rows]


class RowStream:
    """The dataset rows as the pool draws them. It remembers each drawn row's position in the stream
    (the pool numbers rows in the order it draws them), so a checkpoint records which rows the run
    consumed (`consumed`) and a resumed run skips exactly those: rows in flight at the checkpoint are drawn
    again."""

    def __init__(self, rows: Iterator[dict], *, skip: Sequence[int] = ()) -> None:
        self.rows, self.skip = rows, set(skip)
        self.positions: list[int] = []  # pool prompt index -> position in the stream
        self.trained: list[int] = []  # positions of the rows this run trained

    def __iter__(self) -> Iterator[dict]:
        for position, row in enumerate(self.rows):
            if position not in self.skip:
                self.positions.append(position)
                yield row

    def mark_trained(self, groups) -> None:
        self.trained += [self.positions[group.prompt_index] for group in groups]

    def consumed(self, discarded: Iterable[int]) -> list[int]:
        """The positions of the rows an uninterrupted run would never draw again: those skipped, trained,
        and those whose groups the pool dropped for good (`discarded`: its prompt indices), e.g. the
        all-correct ones of --algo.filters all_equal_rewards."""
        return [*self.skip, *self.trained, *(self.positions[index] for index in discarded)]


def eval_rows(config: Config, agent_module) -> list[dict]:
    """The first `--eval.num_prompts` evaluation rows (see `--eval.path`)."""
    count = config.eval.num_prompts
    if config.eval.path:
        return _read_jsonl(config.eval.path, "--eval.path", config.data.messages_key, limit=count)
    if hasattr(agent_module, "eval_dataset"):
        return list(itertools.islice(agent_module.eval_dataset(config.data.seed), count))
    if hasattr(agent_module, "dataset"):
        return list(itertools.islice(agent_module.dataset(config.data.seed + EVAL_SEED_OFFSET), count))
    raise ValueError(
        f"--eval.every needs evaluation rows: pass --eval.path, or export eval_dataset(seed) from "
        f"--agent.module {config.agent.module}"
    )


def check_held_out(rows: list[dict], config: Config, agent_module) -> str:
    """Refuse evaluation rows whose prompts are all among the training rows the run draws (the first
    `--train.num_steps` x `--rollout.prompts_per_step` + `--rollout.queue_depth` of the training stream,
    which is seeded); a warning naming the overlap when some are, else "". A prompt is a row's chat
    `messages` (the whole row where it has none): what the model sees, whatever else the row carries."""

    def prompt(row: dict) -> str:
        return json.dumps(row.get("messages", row), sort_keys=True, default=str)

    num_train = config.train.num_steps * config.rollout.prompts_per_step + config.rollout.queue_depth
    trained = {prompt(row) for row in itertools.islice(read_rows(config, agent_module), num_train)}
    overlap = [row for row in rows if prompt(row) in trained]
    if not overlap:
        return ""
    where = config.eval.path or config.agent.module
    source = f"--eval.path {where}" if config.eval.path else f"--agent.module {where}"
    said = (
        f"{len(overlap)} of the {len(rows)} evaluation prompts ({source}) are among the {num_train} "
        f"training rows this run draws, e.g. {prompt(overlap[0])[:120]}"
    )
    if len(overlap) == len(rows):
        raise ValueError(
            f"{said}: eval/* would score the training prompts, not held-out ones. Give evaluation rows "
            "that training never draws (--eval.path, or an eval_dataset(seed) in the agent module disjoint "
            "from its dataset(seed)), or drop --eval.every"
        )
    return f"{said}; eval/* partly scores training prompts"
