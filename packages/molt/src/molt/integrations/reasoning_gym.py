"""reasoning-gym's procedural tasks as they are: its seeded generator gives the rows, its `score_answer`
the reward.

    molt train --agent.module molt.integrations.reasoning_gym:basic_arithmetic
    molt train --agent.module 'molt.integrations.reasoning_gym:chain_sum,min_terms=2,max_terms=2,answer=reply'

Settings after the task name are the task's own config fields (`reasoning_gym.create_dataset(task,
**settings)`), plus two of this module's:

- `system_prompt`: a name in reasoning-gym's `SYSTEM_PROMPTS` (default `default`: think, then answer
  inside `<answer>` tags), `none` for the bare question, or the text itself (it holds a space).
- `answer`: which part of the reply `score_answer` sees. `tag` (default, reasoning-gym's own rule: the
  last `<answer>...</answer>`; no tag scores as no answer), `reply` (the whole reply, stripped), or
  `last_number` (the reply's last number, the usual rule for numeric answers, read without its thousands
  separators: `1,234` is 1234; none: no answer). The last two serve models that never learned the tags.
  With `tag`, `rollout/answered` logs the share of replies that carried one.

Rows: training rows come from the generator seeded from `--data.seed` upward, held-out evaluation rows
from seeds 2**31 higher (reasoning-gym draws item i of a dataset seeded s from `Random(s + i)`), so the
two never share a draw; a task with a small space of questions may still repeat a question.
A score that is missing (None) raises, so the rollout is lost and counted, as is one that is not finite.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from molt.agent import Env, Result
from molt.integrations import parse_env, require

__all__ = ["load"]

CHUNK = 10_000  # rows per generator instance; the next chunk continues the seeds
EVAL_SEED_BASE = 2**31
ANSWER_MODES = ("tag", "reply", "last_number")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|-?\d+(?:\.\d+)?")


def _library():
    return require("reasoning_gym", "reasoning-gym")


def _rows(task: str, settings: dict, system: str | None, base: int) -> Iterator[dict]:
    for chunk in itertools.count():
        dataset = _library().create_dataset(task, seed=base + chunk * CHUNK, size=CHUNK, **settings)
        for index in range(CHUNK):
            entry = dataset[index]
            messages = [{"role": "user", "content": entry["question"]}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            yield {"messages": messages, "entry": entry}


class ReasoningGymEnv(Env):
    """One reply, scored by the task's `score_answer`. `task`, `scorer`, `answer` are set by `load`."""

    task: str
    scorer: Any  # a dataset of the task and settings, for its `score_answer` (which may read its config)
    answer: str

    def reset(self, sample: dict) -> list[dict]:
        self.entry = sample["entry"]
        return sample["messages"]

    def step(self, action: str) -> Result:
        info = {}
        answer: str | None = action.strip()
        if self.answer == "tag":
            answer = _library().utils.extract_answer(action)
            info["answered"] = float(answer is not None)
        elif self.answer == "last_number":
            numbers = _NUMBER.findall(action)
            answer = numbers[-1].replace(",", "") if numbers else None
        score = self.scorer.score_answer(answer, self.entry)
        if score is None:
            raise ValueError(f"reasoning-gym task {self.task!r} returned no score for the reply {action!r}")
        return Result(reward=float(score), info=info)


def load(env: str) -> SimpleNamespace:
    """The agent namespace for `TASK[,key=value...]` (module docstring)."""
    library = _library()
    task, settings = parse_env(env)
    prompt_name = str(settings.pop("system_prompt", "default"))  # None, 42: read as Python literals
    answer = settings.pop("answer", "tag")
    if task not in library.factory.DATASETS:
        names = ", ".join(sorted(library.factory.DATASETS))
        raise ValueError(f"reasoning-gym has no task {task!r}; its tasks: {names}")
    if answer not in ANSWER_MODES:
        raise ValueError(f"reasoning-gym answer={answer!r}: use one of {ANSWER_MODES}")
    prompts = library.utils.SYSTEM_PROMPTS
    if prompt_name != "none" and prompt_name not in prompts and " " not in prompt_name:
        raise ValueError(
            f"reasoning-gym system_prompt={prompt_name!r}: use none, one of {sorted(prompts)}, "
            "or the text itself"
        )
    system = None if prompt_name == "none" else prompts.get(prompt_name, prompt_name)
    try:
        scorer = library.create_dataset(task, seed=0, size=1, **settings)
        scorer[0]  # bad settings fail here, before a run starts
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"reasoning-gym task {task!r} refused the settings {settings}: {error}") from error
    runner = type("AgentRunner", (ReasoningGymEnv,), {"task": task, "scorer": scorer, "answer": answer})

    def dataset(seed: int) -> Iterator[dict]:
        return _rows(task, settings, system, seed % EVAL_SEED_BASE)

    def eval_dataset(seed: int) -> Iterator[dict]:
        return _rows(task, settings, system, EVAL_SEED_BASE + seed % EVAL_SEED_BASE)

    return SimpleNamespace(AgentRunner=runner, dataset=dataset, eval_dataset=eval_dataset)
