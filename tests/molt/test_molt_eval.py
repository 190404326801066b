"""Evaluation: unbiased pass@k over held-out rows from n samples, failures counted as not passing."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import msgspec
import pytest

import molt.recipes
from molt._data import check_held_out, eval_rows, read_rows
from molt._flags import resolve
from molt._metrics import evaluate
from molt._rollout import Rollout
from molt.config import Config, Eval
from molt.recipes import copy_word, smollm2
from tito import Segment


def config(**values) -> Config:
    return msgspec.structs.replace(Config(), eval=msgspec.structs.replace(Eval(every=1), **values))


def test_pass_at_k_from_n_samples_per_row():
    rewards = {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0, 0.0, 0.0, 0.0], "c": [1.0, 1.0, 0.5, None]}

    async def runner(row, index):
        reward = rewards[row["id"]][index]
        if reward is None:
            raise RuntimeError("the agent crashed")
        return Rollout([Segment([1, 2], [0, 1], [0.0, -1.0], [-1, 0])], reward, [2], truncated=False)

    rows = [{"id": key} for key in rewards]
    metrics = asyncio.run(evaluate(runner, rows, config(n=4, k=2)))
    # correct counts (reward >= 1): a 1, b 0, c 2. pass@1 = mean(c/n); pass@2 = mean(1 - C(n-c,2)/C(n,2)).
    assert metrics["eval/pass@1"] == pytest.approx((1 / 4 + 0 + 2 / 4) / 3)
    assert metrics["eval/pass@2"] == metrics["eval/pass@k"] == pytest.approx((1 / 2 + 0 + 5 / 6) / 3)
    assert metrics["eval/reward_mean"] == pytest.approx(3.5 / 11)
    assert metrics["eval/failed"] == 1.0


def test_evaluation_rows_come_from_the_file_or_the_agent_module(tmp_path):
    path = tmp_path / "eval.jsonl"
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = msgspec.structs.replace(config(path=str(path), num_prompts=3), data=msgspec.structs.replace(
        Config().data, messages_key="prompt"))  # fmt: skip
    assert [row["messages"][0]["content"] for row in eval_rows(cfg, agent_module=None)] == ["0", "1", "2"]

    class Generated:
        @staticmethod
        def dataset(seed):
            while True:
                yield {"seed": seed}

    rows = eval_rows(config(num_prompts=2), Generated)
    assert rows == [{"seed": 7_919}] * 2  # held out from training's seed 0

    with pytest.raises(ValueError, match="--eval.every needs evaluation rows"):
        eval_rows(config(), object())


RECIPES = Path(molt.recipes.__file__).parent


class Numbers:
    """An agent module whose training rows are the numbers 0, 1, 2, ... (a stand-in dataset)."""

    @staticmethod
    def dataset(seed):
        yield from ({"messages": [{"role": "user", "content": str(i)}], "id": i} for i in itertools.count())


def test_an_eval_set_of_training_prompts_is_refused_and_a_partial_overlap_is_named():
    cfg = resolve(["--eval.every", "1", "--train.num_steps", "3", "--rollout.prompts_per_step", "2"])
    drawn = 3 * 2 + cfg.rollout.queue_depth  # the training rows the run draws

    def rows(*numbers):  # an evaluation row differs from a training row in all but its prompt
        return [{"messages": [{"role": "user", "content": str(i)}], "id": -1} for i in numbers]

    assert check_held_out(rows(drawn, drawn + 1), cfg, Numbers) == ""
    with pytest.raises(ValueError, match="2 of the 2 evaluation prompts .* would score the training prompts"):
        check_held_out(rows(0, drawn - 1), cfg, Numbers)
    assert check_held_out(rows(0, drawn), cfg, Numbers).startswith("1 of the 2 evaluation prompts")


def test_the_recipes_evaluate_prompts_their_training_never_draws(tiny_model_dir):
    recipe = ["--config", str(RECIPES / "smollm2.toml"), "--model.path", str(tiny_model_dir)]  # a model
    cfg = resolve([*recipe, "--eval.num_prompts", "40"])
    num_train = cfg.train.num_steps * cfg.rollout.prompts_per_step + cfg.rollout.queue_depth
    prompts = [row["messages"] for row in itertools.islice(read_rows(cfg, smollm2), 10 * num_train)]
    held_out = [row["messages"] for row in eval_rows(cfg, smollm2)]
    assert len(held_out) == 40 and not [p for p in held_out if p in prompts]  # ten runs' worth of rows
    # copy_word's five words are all trained (the tiny model has no other single-token word): refused
    with pytest.raises(ValueError, match="copy_word recipe has no held-out prompts"):
        eval_rows(resolve(["--eval.every", "1"]), copy_word)
