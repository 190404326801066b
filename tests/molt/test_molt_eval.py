"""Evaluation: unbiased pass@k over held-out rows from n samples, failures counted as not passing."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from molt._data import eval_rows
from molt._eval import evaluate
from molt._rollout import Rollout
from molt.config import Config, Eval
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
