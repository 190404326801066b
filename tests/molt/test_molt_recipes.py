"""The recipes' rows and rewards (the SmolLM2 conversion itself needs the `smollm2` uv group)."""

from __future__ import annotations

import itertools

import pytest

from molt.recipes import smollm2


def test_smollm2_rows_are_seeded_additions_and_eval_rows_differ():
    rows = list(itertools.islice(smollm2.dataset(0), 50))
    assert rows == list(itertools.islice(smollm2.dataset(0), 50))
    for row in rows:
        question = row["messages"][0]["content"]
        a, b = question.removeprefix("What is ").split("?")[0].split(" + ")
        assert row["answer"] == int(a) + int(b) and 2 <= row["answer"] <= 40
    assert list(itertools.islice(smollm2.eval_dataset(0), 50)) != rows


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        pytest.param("23", 1.0, id="bare"),
        pytest.param("14 + 9 = 23", 1.0, id="restated"),
        pytest.param("14 + 9 = 24", 0.0, id="wrong"),
        pytest.param("23 is wrong, it is 22", 0.0, id="last-number-counts"),
        pytest.param("twenty-three", 0.0, id="no-number"),
    ],
)
def test_smollm2_reward_is_the_last_number(reply, reward):
    env = smollm2.AgentRunner()
    env.reset({"messages": [], "answer": 23})
    assert env.step(reply).reward == reward


def test_conversion_without_the_package_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="uv run --group smollm2"):
        smollm2.convert(tmp_path)
