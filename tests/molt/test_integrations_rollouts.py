"""The environment libraries' episodes through tito on the real vLLM CPU server, as the pool runs them:
token-exact trajectories, the library's rewards and metrics, and what a broken environment costs.

Agents run in local `AgentHost`s (the Ray actor class, called in process), tito serves on the test's
event loop, as in `molt train`; the runs through the whole loop are in tests/e2e/test_integrations.py.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import msgspec
import pytest

from molt._rollout import Rollout, RolloutRunner
from molt._runners import AgentHost
from molt.agent import ChatAgent, load_agent
from molt.config import Agent, Config
from molt.config import Rollout as RolloutConfig
from tito import Tito, create_app, serve_on_loop

pytestmark = pytest.mark.slow

VF_ENVS = Path(__file__).with_name("verifiers_envs")


def config(max_turns: int) -> Config:
    return msgspec.structs.replace(
        Config(),
        agent=msgspec.structs.replace(Agent(), max_turns=max_turns, timeout=120.0),
        rollout=msgspec.structs.replace(RolloutConfig(), max_new_tokens=8, temperature=1.0),
    )


def rollouts(engine_url, model_dir, spec: str, count: int, *, max_turns: int = 1):
    """`count` rollouts of the agent `spec` on its own first rows; errors are returned, with the runner."""
    agent = load_agent(spec)
    rows = list(itertools.islice(agent.dataset(0), count))
    chat = issubclass(agent.AgentRunner, ChatAgent)

    async def run():
        fixed = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
        tito = Tito([engine_url], model_dir, served_model_name="policy", fixed_sampling=fixed)
        async with serve_on_loop(create_app(tito, api_key="key")) as url:
            runner = RolloutRunner(tito, config(max_turns), [AgentHost(spec)], chat_url=url if chat else "",
                                   api_key="key")  # fmt: skip
            results = await asyncio.gather(*(runner(row, 0) for row in rows), return_exceptions=True)
        await tito.aclose()
        return results, runner

    return asyncio.run(run())


def turns_of(rollout: Rollout) -> int:
    """How many sampled spans (assistant turns) the trajectory holds."""
    mask = [m for segment in rollout.segments for m in segment.loss_mask]
    return sum(1 for a, b in itertools.pairwise([0, *mask]) if b and not a)


@pytest.mark.parametrize(
    ("env", "metrics", "min_turns"),
    [
        pytest.param("vf_say.py", {"said", "reply_chars"}, 1, id="single-turn"),
        pytest.param("vf_guess.py", {"said", "turns"}, 2, id="multi-turn"),
        pytest.param("vf_tools.py", {"correct"}, 1, id="mcp-toolset"),
    ],
)
def test_verifiers_episodes_reach_tito_and_bring_back_their_rewards(tiny_model_dir, vllm_server, env, metrics,
                                                                    min_turns):  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    results, runner = rollouts(
        vllm_server.url, tiny_model_dir, f"molt.integrations.verifiers:{VF_ENVS / env}", 2
    )
    for result in results:
        assert isinstance(result, Rollout), result
        assert result.sampled and math.isfinite(result.reward)
        assert metrics <= set(result.info)
        assert result.reward == sum(result.info[k] for k in metrics if k in {"said", "correct"})
        assert turns_of(result) >= min_turns  # the tiny model never says the word: every turn is taken
        prompt = tokenizer.decode(result.segments[0].token_ids)
        assert (
            "copy the word" in prompt or "Use the add tool" in prompt
        ) and "<|im_start|>assistant" in prompt
        if env == "vf_tools.py":  # the toolset's tool reached the model through tito's chat template
            assert '"name": "add_toolset_add"' in prompt, prompt  # server name + tool name
    assert runner.failures["raised"] == 0


@pytest.mark.parametrize(
    ("spec", "max_turns"),
    [
        pytest.param("molt.integrations.reasoning_gym:basic_arithmetic", 1, id="reasoning-gym"),
        pytest.param(
            "molt.integrations.reasoning_gym:knights_knaves,answer=reply", 1, id="reasoning-gym-reply"
        ),
        pytest.param("molt.integrations.textarena:GuessTheNumber-v0,max_turns=3", 3, id="textarena"),
    ],
)
def test_env_libraries_roll_out_through_tito(tiny_model_dir, vllm_server, spec, max_turns):
    results, runner = rollouts(vllm_server.url, tiny_model_dir, spec, 3, max_turns=max_turns)
    assert all(isinstance(r, Rollout) and math.isfinite(r.reward) for r in results), results
    if "textarena" in spec:  # the game runs to its own turn limit (or a second invalid move ends it)
        assert all({"invalid_move", "game_turns"} <= set(r.info) for r in results)
        assert all(turns_of(r) >= 1 for r in results)


def test_a_broken_environment_costs_one_rollout_and_is_counted(tiny_model_dir, vllm_server):
    results, runner = rollouts(
        vllm_server.url, tiny_model_dir, f"molt.integrations.verifiers:{VF_ENVS}/vf_broken.py", 2
    )
    messages = sorted(f"{type(r).__name__}: {r}" for r in results)  # the rows come in a seeded order
    assert messages[0].startswith("RuntimeError: ") and "the scorer broke" in messages[0]
    assert messages[1].startswith("ValueError: ") and "non-finite" in messages[1]
    assert runner.failures == {**runner.failures, "raised": 1, "nonfinite_reward": 1}


def test_a_reasoning_gym_task_without_a_score_costs_one_rollout(tiny_model_dir, vllm_server):
    import reasoning_gym
    from reasoning_gym.arithmetic.basic_arithmetic import BasicArithmeticDataset, BasicArithmeticDatasetConfig

    class Unscored(BasicArithmeticDataset):
        def score_answer(self, answer, entry):
            return None

    if "molt_test_unscored" not in reasoning_gym.factory.DATASETS:
        reasoning_gym.register_dataset("molt_test_unscored", Unscored, BasicArithmeticDatasetConfig)
    results, runner = rollouts(
        vllm_server.url, tiny_model_dir, "molt.integrations.reasoning_gym:molt_test_unscored", 2
    )
    assert all(isinstance(r, ValueError) and "returned no score" in str(r) for r in results)
    assert runner.failures["raised"] == 2
