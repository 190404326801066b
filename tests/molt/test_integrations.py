"""The environment libraries' adapters without a model: rows, rewards and refusals (`molt.integrations`).

The rollouts through tito and the real loop are in tests/molt/test_integrations_rollouts.py and
tests/e2e/test_integrations.py.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

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
        pytest.param(
            "chain_sum,system_prompt=None", "system_prompt='None': use none", id="system-prompt-None"
        ),
    ],
)
def test_reasoning_gym_refuses_bad_settings_before_a_run(env, message):
    with pytest.raises(ValueError, match=message):
        load_agent(f"{RG}:{env}")


def test_a_missing_library_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an install without it imports
    with pytest.raises(ValueError, match=r"reasoning-gym package .*uv sync --group envs"):
        load_agent(f"{RG}:chain_sum")


TA = "molt.integrations.textarena"


def play_guess_the_number(runner, seed: int) -> tuple[list, list, float]:
    """Bisect the secret number: the observations, the moves and the final reward."""
    low, high = 1, 20
    observations, moves = [runner.reset({"seed": seed})], []
    while True:
        moves.append(f"[{(low + high) // 2}]")
        result = runner.step(moves[-1])
        if result.observation is None:
            return observations, moves, result.reward
        observations.append(result.observation)
        guess = (low + high) // 2
        low, high = (guess + 1, high) if "higher" in result.observation else (low, guess - 1)


def test_textarena_game_reward_is_the_games_own_and_a_seed_gives_the_same_game():
    import random

    import textarena as ta

    agent = load_agent(f"{TA}:GuessTheNumber-v0")
    rows = first(agent.dataset(0), 3)
    assert rows == first(agent.dataset(0), 3) and rows != first(agent.eval_dataset(0), 3)
    state = random.getstate()
    observations, moves, reward = play_guess_the_number(agent.AgentRunner(), rows[1]["seed"])
    assert random.getstate() == state  # the caller's `random` is left as it was
    assert "Guess The Number" in observations[0] and "[GAME]" not in observations[0]
    assert all("lower" in o or "higher" in o for o in observations[1:])
    assert play_guess_the_number(agent.AgentRunner(), rows[1]["seed"]) == (observations, moves, reward)
    game = ta.make("GuessTheNumber-v0")  # textarena's own game, seeded alike, given the same moves
    game.reset(num_players=1, seed=rows[1]["seed"])
    assert [game.step(move)[0] for move in moves] == [False] * (len(moves) - 1) + [True]
    rewards, _ = game.close()
    random.setstate(state)
    assert reward == rewards[0] == 1.0


def test_textarena_episodes_interleaved_play_as_they_do_alone():
    agent = load_agent(f"{TA}:Minesweeper-v0-small")  # it places the mines at the first move
    moves = ["[2 2]", "[0 0]", "[4 4]"]

    def alone(seed):
        runner = agent.AgentRunner()
        return [runner.reset({"seed": seed})] + [runner.step(m).observation for m in moves]

    expected = {seed: alone(seed) for seed in (1, 2)}
    runners = {seed: agent.AgentRunner() for seed in (1, 2)}
    seen = {seed: [runners[seed].reset({"seed": seed})] for seed in (1, 2)}
    for move in moves:  # one move each in turn, as concurrent episodes in one host do
        for seed in (1, 2):
            seen[seed].append(runners[seed].step(move).observation)
    assert seen == expected and expected[1] != expected[2]


@pytest.mark.parametrize(
    ("game", "message"),
    [
        pytest.param("Wordle-v0", "cannot run offline: it downloads NLTK corpora", id="corpus"),
        pytest.param("TwentyQuestions-v0", "cannot run offline: .*hosted", id="hosted-model"),
        pytest.param("Chess-v0", "does not start with one player", id="two-players"),
        pytest.param("Klondike-v0", "cannot be built", id="broken"),
        pytest.param("NoSuchGame-v0", "has no game 'NoSuchGame-v0'; its games: .*Mastermind", id="unknown"),
        pytest.param("GuessTheNumber-v0,colour=2", "refused the settings", id="setting"),
    ],
)
def test_textarena_refuses_games_it_cannot_run_with_the_reason(game, message):
    with pytest.raises(ValueError, match=message):
        load_agent(f"{TA}:{game}")


VF = "molt.integrations.verifiers"
VF_ENVS = Path(__file__).with_name("verifiers_envs")


@pytest.mark.slow  # importing verifiers takes ~8 s
def test_verifiers_rows_are_the_tasksets_tasks_reshuffled_each_pass():
    agent = load_agent(f"{VF}:{VF_ENVS / 'vf_say.py'}")
    rows = first(agent.dataset(0), 8)
    words = [row["task"]["word"] for row in rows]
    assert sorted(words[:4]) == sorted(words[4:]) == ["cat", "dog", "fox", "owl"]
    assert rows == first(agent.dataset(0), 8) and rows != first(agent.dataset(1), 8)
    assert rows[0]["task"]["prompt"] == f"copy the word: {words[0]}"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param("no_such_dir/tasks.py", "no such file", id="missing-file"),
        pytest.param("molt_no_such_taskset", "cannot load the taskset", id="missing-module"),
        pytest.param(
            str(Path(__file__).parent / "test_environment.py"), "cannot load the taskset", id="not-a-taskset"
        ),
    ],
)
@pytest.mark.slow
def test_verifiers_refuses_what_is_not_a_taskset(env, message):
    with pytest.raises(ValueError, match=message):
        load_agent(f"{VF}:{env}")


def test_settings_may_hold_tuples_and_quoted_text_with_commas():
    agent = load_agent(
        f"{RG}:basic_arithmetic,operators=('+', '-'),min_terms=2,max_terms=2,allow_parentheses=False,"
        "system_prompt='Think, then reply with the number only.'"
    )
    rows = first(agent.dataset(0), 40)
    assert rows[0]["messages"][0] == {"role": "system", "content": "Think, then reply with the number only."}
    assert {op for r in rows for op in "+-*/" if op in r["entry"]["question"]} == {"+", "-"}


def test_reasoning_gym_settings_may_be_lists_as_the_tasks_declare_them():
    agent = load_agent(f"{RG}:basic_arithmetic,operators=['+', '-'],min_terms=2,max_terms=2")  # list[str]
    rows = first(agent.dataset(0), 40)
    assert {op for r in rows for op in "+-*/" if op in r["entry"]["question"]} == {"+", "-"}
    runner = agent.AgentRunner()
    runner.reset(rows[0])
    assert runner.step(f"<answer>{rows[0]['entry']['answer']}</answer>").reward == 1.0


def test_the_smollm2_reasoning_gym_recipe_asks_single_digit_sums_and_scores_the_bare_sum_1():
    import tomllib

    import molt.recipes

    recipe = Path(molt.recipes.__file__).with_name("smollm2_reasoning_gym.toml")
    agent = load_agent(tomllib.loads(recipe.read_text())["agent"]["module"])
    for row in first(agent.eval_dataset(0), 30):
        terms = row["entry"]["metadata"]["expression"].split(" + ")
        assert len(terms) == 2 and all(0 <= int(t) <= 10 for t in terms)
        assert row["messages"] == [{"role": "user", "content": row["entry"]["question"]}]
        runner = agent.AgentRunner()
        runner.reset(row)
        assert runner.step(row["entry"]["answer"]).reward == 1.0


@pytest.mark.parametrize(
    ("reply", "answer", "reward"),
    [
        pytest.param("11", "11", 1.0, id="bare"),
        pytest.param("4 + 7 = 11.", "11", 1.0, id="restated"),
        pytest.param("11? no, 12", "11", 0.0, id="last-counts"),
        pytest.param("eleven", "11", 0.0, id="no-number"),
        pytest.param("1,234", "1234", 1.0, id="thousands"),
        pytest.param("1000 + 234 = 1,234.", "1234", 1.0, id="thousands-restated"),
        pytest.param("1,2345", "1234", 0.0, id="not-thousands"),
    ],
)
def test_reasoning_gym_last_number_mode_hands_the_last_number_to_score_answer(reply, answer, reward):
    """The reply's last number, read without its thousands separators (`1,234` is 1234, `1,2345` two)."""
    agent = load_agent(f"{RG}:basic_arithmetic,answer=last_number")
    runner = agent.AgentRunner()
    runner.reset(
        {"messages": [], "entry": {"question": "What is the sum?", "answer": answer, "metadata": {}}}
    )
    assert runner.step(reply).reward == reward
