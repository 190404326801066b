"""The environment libraries' adapters without a model: rows, rewards and refusals (`molt.integrations`).

The rollouts through tito and the real loop are in tests/molt/test_integrations_rollouts.py and
tests/e2e/test_integrations.py.
"""

from __future__ import annotations

import itertools
import sys

import pytest

from molt.agent import load_agent
from molt.integrations import parse_env

RG = "molt.integrations.reasoning_gym"
TASKS = ["basic_arithmetic", "knights_knaves", "sudoku", "gsm_symbolic"]


def first(rows, count: int) -> list[dict]:
    return list(itertools.islice(rows, count))


def test_parse_env_reads_literals_and_keeps_text():
    name, settings = parse_env("chain_sum, min_terms=2,allow_negation=False,system_prompt=none,scale=0.5")
    assert name == "chain_sum"
    assert settings == {"min_terms": 2, "allow_negation": False, "system_prompt": "none", "scale": 0.5}
    with pytest.raises(ValueError, match="not key=value"):
        parse_env("chain_sum,min_terms")


def test_an_env_suffix_needs_a_module_that_serves_many():
    with pytest.raises(ValueError, match="exports no load"):
        load_agent("molt.recipes.copy_word:fox")


@pytest.mark.parametrize("task", TASKS)
def test_reasoning_gym_rows_are_seeded_and_scored_by_the_task_itself(task):
    import reasoning_gym

    agent = load_agent(f"{RG}:{task}")
    rows = first(agent.dataset(3), 20)
    assert rows == first(agent.dataset(3), 20)  # the seeded generator: the same rows again
    assert rows != first(agent.dataset(4), 20)
    held_out = first(agent.eval_dataset(3), 20)
    assert not {r["entry"]["question"] for r in rows} & {r["entry"]["question"] for r in held_out}
    assert rows[0]["messages"][0]["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["default"]
    score = reasoning_gym.get_score_answer_fn(task)
    for row in rows[:5]:
        entry = row["entry"]
        assert row["messages"][-1] == {"role": "user", "content": entry["question"]}
        for reply in (f"<answer>{entry['answer']}</answer>", "<answer>no idea</answer>", entry["answer"]):
            runner = agent.AgentRunner()
            runner.reset(row)
            result = runner.step(reply)
            answer = reasoning_gym.utils.extract_answer(reply)
            assert result.reward == score(answer, entry)
            assert result.info == {"answered": float(answer is not None)}
            assert result.observation is None


def test_reasoning_gym_settings_reach_the_task_and_the_reply_mode_scores_the_whole_reply():
    agent = load_agent(f"{RG}:chain_sum,min_terms=2,max_terms=2,min_digits=1,max_digits=1,"
                       "system_prompt=none,answer=reply")  # fmt: skip
    rows = first(agent.dataset(0), 30)
    for row in rows:
        assert len(row["messages"]) == 1 and row["entry"]["metadata"]["num_terms"] == 2
    runner = agent.AgentRunner()
    runner.reset(rows[0])
    assert runner.step(f" {rows[0]['entry']['answer']}\n").reward == 1.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param("no_such_task", "has no task 'no_such_task'; its tasks: .*basic_arithmetic", id="task"),
        pytest.param("chain_sum,min_terms=0", "refused the settings", id="setting-value"),
        pytest.param("chain_sum,colour=3", "refused the settings", id="setting-name"),
        pytest.param("chain_sum,answer=last", "answer='last'", id="answer-mode"),
        pytest.param("chain_sum,system_prompt=shout", "system_prompt='shout'", id="system-prompt"),
    ],
)
def test_reasoning_gym_refuses_bad_settings_before_a_run(env, message):
    with pytest.raises(ValueError, match=message):
        load_agent(f"{RG}:{env}")


def test_a_missing_library_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an install without it imports
    with pytest.raises(ValueError, match=r"reasoning-gym package .*uv sync --group envs"):
        load_agent(f"{RG}:chain_sum")
