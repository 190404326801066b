"""Both agent forms on the real vLLM CPU server: one data path, compaction, and agent failures.

The agents run in local `AgentHost`s (the Ray actor class, called in process) and tito serves on the
test's event loop, as in `molt train`; the Ray placement itself is covered by the end-to-end runs.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import molt_probes as probes
import msgspec
import pytest

from asyncpool import GroupPool
from molt._batch import collate
from molt._dumps import read_rollouts, write_rollouts
from molt._flags import resolve
from molt._metrics import rollout_metrics
from molt._rollout import BUILT_IN, RolloutRunner, sampling
from molt._runners import AgentHost, launch_hosts
from molt._validate import validate
from molt.agent import Result
from molt.config import Agent, Config, ConfigError, Data, Rollout
from molt.loop import check_token_identity
from tito import Tito, create_app, serve_on_loop

EXAMPLES = Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # the examples' shared rows (arithmetic.py), as `load_agent` does


def config(**agent) -> Config:
    return msgspec.structs.replace(
        Config(),
        agent=msgspec.structs.replace(Agent(), **agent),
        rollout=msgspec.structs.replace(Rollout(), max_new_tokens=12, temperature=1.0),
    )


async def episodes(engine_url, model_dir, module: str, rows: list[dict], cfg: Config, *, chat: bool):
    """Run one rollout per row through `RolloutRunner`, as the pool would; errors are returned."""
    fixed = {"temperature": 1.0, "top_p": 1.0, "max_tokens": cfg.rollout.max_new_tokens}
    tito = Tito([engine_url], model_dir, served_model_name="policy", fixed_sampling=fixed)
    async with serve_on_loop(create_app(tito, api_key="key")) as url:
        runner = RolloutRunner(tito, cfg, [AgentHost(module)], chat_url=url if chat else "", api_key="key")
        results = await asyncio.gather(*(runner(row, 0) for row in rows), return_exceptions=True)
    await tito.aclose()
    return results, runner


def prompt_of(rollout) -> list[int]:
    first = rollout.segments[0]
    return first.token_ids[: first.loss_mask.index(1)]


@pytest.mark.slow  # the session's vLLM server
def test_both_forms_give_the_engine_identical_prompt_tokens(tiny_model_dir, vllm_server):
    from arithmetic import SYSTEM, dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [next(dataset(seed)) for seed in range(3)]  # system turn + question + tools
    cfg = config(max_turns=1)
    env, _ = asyncio.run(episodes(vllm_server.url, tiny_model_dir, str(EXAMPLES / "calculator_env.py"), rows,
                                  cfg, chat=False))  # fmt: skip
    sdk, _ = asyncio.run(episodes(vllm_server.url, tiny_model_dir, str(EXAMPLES / "openai_agent.py"), rows,
                                  cfg, chat=True))  # fmt: skip
    for row, env_rollout, sdk_rollout in zip(rows, env, sdk, strict=True):
        assert prompt_of(env_rollout) == prompt_of(sdk_rollout)
        text = tokenizer.decode(prompt_of(env_rollout))
        assert SYSTEM in text and '"name": "calculator"' in text and row["messages"][1]["content"] in text


def test_runners_0_host_the_agents_in_process_and_an_ended_episode_needs_no_close():
    (host,), ready = launch_hosts("molt.recipes.copy_word", 0)  # no Ray: an AgentHost of this process
    assert ready == []  # nothing to wait for
    assert isinstance(host, AgentHost)

    async def episode(action: str):
        await host.reset("e1", {"messages": [{"role": "user", "content": "copy fox"}], "word": "fox"})
        return await host.step("e1", action)

    result = asyncio.run(episode("fox"))
    assert result.reward == 1.0 and result.observation is None
    assert host.episodes == {}  # forgotten by its last step: the rollout makes no close call


def test_a_chat_agent_needs_the_template_applied_by_molt():
    cfg = msgspec.structs.replace(config(), data=Data(apply_chat_template=False))
    chat = msgspec.structs.replace(cfg, agent=Agent(module=str(EXAMPLES / "openai_agent.py")))
    with pytest.raises(ValueError, match="ChatAgent.*apply_chat_template false"):
        validate(chat)
    env = msgspec.structs.replace(cfg, agent=Agent(module=str(EXAMPLES / "math_env.py")))
    validate(env)  # an Env may take rendered rows


@pytest.mark.slow  # the session's vLLM server
def test_a_compacting_agent_trains_as_one_rollout_with_several_segments(tiny_model_dir, vllm_server):
    from compacting_agent import dataset

    rows = [next(dataset(0)), next(dataset(1))]
    (first, second), _ = asyncio.run(episodes(vllm_server.url, tiny_model_dir,
                                              str(EXAMPLES / "compacting_agent.py"), rows, config(),
                                              chat=True))  # fmt: skip
    assert len(first.segments) == 3  # every compaction rewrote the prefix: a new segment per turn
    trained = [t for s in first.segments for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    assert first.sampled == trained
    rows_out = [(s.token_ids, s.loss_mask, s.logprobs, 0.0) for r in (first, second) for s in r.segments]
    check_token_identity(collate(rows_out, pad_id=0), [first, second])  # the loop's batch: a row per segment


AGENTS = """
import asyncio, itertools
from molt import ChatAgent, Env, Result
calls = itertools.count()

class Raises(Env):
    def step(self, action):
        raise RuntimeError("the sandbox crashed")

class Hangs(Env):
    async def step(self, action):
        await asyncio.sleep(60)

class NotFinite(Env):
    def step(self, action):
        return Result(reward=float("nan"))

class Flaky(Env):  # the first two episodes raise
    def step(self, action):
        if next(calls) < 2:
            raise ConnectionError("the tool server hiccuped")
        return Result(reward=1.0)

AgentRunner = {kind}
"""


@pytest.mark.parametrize(
    ("kind", "error", "counted"),
    [
        pytest.param("Raises", "the sandbox crashed", "raised", id="raises"),
        pytest.param("Hangs", "ran past --agent.timeout", "timed_out", id="hangs"),
        pytest.param("NotFinite", "non-finite reward", "nonfinite_reward", id="non-finite"),
    ],
)
@pytest.mark.slow  # the session's vLLM server
def test_a_failing_agent_loses_its_rollout_and_is_counted(tiny_model_dir, vllm_server, tmp_path, kind,
                                                          error, counted):  # fmt: skip
    module = tmp_path / "agent.py"
    module.write_text(AGENTS.format(kind=kind))
    row = {"messages": [{"role": "user", "content": "copy the word: fox"}]}
    (result,), runner = asyncio.run(episodes(vllm_server.url, tiny_model_dir, str(module), [row],
                                             config(timeout=1.0), chat=False))  # fmt: skip
    assert isinstance(result, Exception) and error in str(result)
    assert runner.failures[counted] == 1 and sum(runner.failures.values()) == 1


@pytest.mark.slow  # the session's vLLM server
def test_the_pool_retries_a_lost_rollout_and_the_run_goes_on(tiny_model_dir, vllm_server, tmp_path):
    module = tmp_path / "agent.py"
    module.write_text(AGENTS.format(kind="Flaky"))
    rows = iter([{"messages": [{"role": "user", "content": f"copy the word: {w}"}]} for w in ("fox", "cat")])

    async def main():
        tito = Tito([vllm_server.url], tiny_model_dir, fixed_sampling={"max_tokens": 4})
        runner = RolloutRunner(tito, config(), [AgentHost(str(module))])
        async with GroupPool(runner, rows, group_size=2, depth=2, retry_delay=0.01) as pool:
            groups = await pool.take(2)
        await tito.aclose()
        return groups, pool.stats, runner.failures

    groups, stats, failures = asyncio.run(main())
    assert [len(group.samples) for group in groups] == [2, 2]  # whole groups, every reward from a success
    assert all(sample.reward == 1.0 for group in groups for sample in group.samples)
    assert stats.retried == failures["raised"] == 2 and stats.failed == 0


NUMBERS = """
import numpy as np
from molt import Env, Result

class AgentRunner(Env):
    def step(self, action):
        return Result(reward=np.float32(0.5), info={info})
"""


def fake_engine_episode(model_dir, tmp_path, source: str, cfg: Config | None = None):
    """One Env episode of the agent module `source`: the rollout or its error, the runner and the engine.
    The engine is a fake (`molt_probes.FakeEngine`, a 512-token context): what it samples does not
    matter here."""
    module = tmp_path / "agent.py"
    module.write_text(source)
    cfg = cfg or config()
    engine = probes.FakeEngine()
    transport = httpx.MockTransport(engine)
    tito = Tito(["http://engine"], model_dir, engine_transport=transport, fixed_sampling=sampling(cfg))
    runner = RolloutRunner(tito, cfg, [AgentHost(str(module))])
    row = {"messages": [{"role": "user", "content": "copy the word: fox"}]}

    async def run():
        (result,) = await asyncio.gather(runner(row, 0), return_exceptions=True)
        await tito.aclose()
        return result

    return asyncio.run(run()), runner, engine


def test_an_agents_numpy_numbers_are_logged_and_dumped_as_floats(tiny_model_dir, tmp_path):
    info = '{"score": np.float64(0.25), "turns": np.int64(1)}'
    rollout, _, _ = fake_engine_episode(tiny_model_dir, tmp_path, NUMBERS.format(info=info))
    assert rollout.reward == 0.5 and rollout.info == {"score": 0.25, "turns": 1.0}
    assert rollout_metrics([rollout], 1)["rollout/score"] == 0.25
    group = type("Group", (), {"prompt_index": 0, "samples": [rollout]})
    write_rollouts(tmp_path / "dump", 1, [group], [0])  # the run's --train.rollout_dump_dir
    (record,) = read_rollouts(tmp_path / "dump")
    assert record.reward == 0.5 and record.info == {"score": 0.25, "turns": 1.0}


def test_an_info_value_that_is_no_number_loses_the_rollout_naming_its_key(tiny_model_dir, tmp_path):
    bad = NUMBERS.format(info='{"note": "a string"}')
    error, runner, _ = fake_engine_episode(tiny_model_dir, tmp_path, bad)
    assert isinstance(error, ValueError) and "'note'" in str(error), error
    assert runner.failures["raised"] == 1


def chat_episode(model_dir, module: Path, row: dict, reply: list[int]):
    """One ChatAgent episode of the agent module `module` through tito's loopback app, over a fake engine
    whose every turn samples `reply`: the rollout or its error, and the runner."""

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": 100_000}]})
        logprobs = {"content": [{"token_id": token, "logprob": -0.5} for token in reply]}
        choice = {"index": 0, "token_ids": reply, "logprobs": logprobs, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice]})

    async def run():
        tito = Tito(["http://engine"], model_dir, engine_transport=httpx.MockTransport(engine))
        async with serve_on_loop(create_app(tito, api_key="key")) as url:
            runner = RolloutRunner(tito, config(), [AgentHost(str(module))], chat_url=url, api_key="key")
            (result,) = await asyncio.gather(runner(row, 0), return_exceptions=True)
        await tito.aclose()
        return result, runner

    return asyncio.run(run())


def test_the_openai_example_scores_the_models_answer_not_a_tool_result(tiny_model_dir):
    """The model calls the calculator on every turn, the last time with the expression `Answer: N` (N the
    right answer), which the tool's error echoes: the episode ends without an answer, so it earns 0."""
    from arithmetic import dataset
    from transformers import AutoTokenizer

    row = next(dataset(0))
    call = {"name": "calculator", "arguments": {"expression": f"Answer: {row['answer']}"}}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = tokenizer.encode(f"<tool_call>{json.dumps(call)}</tool_call>", add_special_tokens=False)

    rollout, _ = chat_episode(tiny_model_dir, EXAMPLES / "openai_agent.py", row, reply)  # every turn alike
    assert not isinstance(rollout, Exception), rollout
    assert rollout.info["tool_calls"] == 3.0  # every turn called the tool
    assert rollout.reward == 0.0


OUTGROWING = """
from molt import Env, Result

class AgentRunner(Env):
    def step(self, action):  # a tool output longer than the context's room: the next turn cannot fit
        return Result(reward=0.25, observation="word " * 600)
"""


def test_an_env_episode_that_outgrows_the_context_ends_truncated_with_what_it_sampled(
    tiny_model_dir, tmp_path
):
    rollout, runner, engine = fake_engine_episode(tiny_model_dir, tmp_path, OUTGROWING, config(max_turns=4))
    assert not isinstance(rollout, Exception), rollout
    assert len(engine.requests) == 1 and rollout.sampled == [7, 8, 9]  # the turn that fitted, kept
    assert rollout.truncated and rollout.reward == 0.25 and runner.failures["raised"] == 0


ODD_RETURNS = """
from molt import ChatAgent, Env, Result

class Silent(Env):
    def step(self, action):  # forgets its Result
        pass

class Forwarding(ChatAgent):
    def run(self, ctx, sample):  # a plain method handing back its helper's coroutine
        return self.finish(sample)

    async def finish(self, sample):
        return Result(reward=float(sample["reward"]))
"""


def test_a_step_without_a_result_is_named_and_a_returned_coroutine_is_awaited(tmp_path):
    (tmp_path / "odd.py").write_text(ODD_RETURNS + "AgentRunner = Silent\n")
    (tmp_path / "forwarding.py").write_text(ODD_RETURNS + "AgentRunner = Forwarding\n")
    silent, forwarding = AgentHost(str(tmp_path / "odd.py")), AgentHost(str(tmp_path / "forwarding.py"))

    async def main():
        await silent.reset("e", {"messages": [{"role": "user", "content": "hi"}]})
        with pytest.raises(TypeError, match=r"Silent.step returned None; return a molt.Result"):
            await silent.step("e", "reply")
        return await forwarding.run(None, {"reward": 0.5})

    assert asyncio.run(main()) == Result(reward=0.5)


def test_an_info_key_named_like_a_built_in_metric_loses_the_rollout_naming_it(tiny_model_dir, tmp_path):
    clash = NUMBERS.format(info='{"reward_mean": 9.0, "score": 1.0}')
    error, runner, _ = fake_engine_episode(tiny_model_dir, tmp_path, clash)
    assert isinstance(error, ValueError) and "['reward_mean']" in str(error), error
    assert runner.failures["raised"] == 1
    (tmp_path / "plain").mkdir()  # the names checked are the ones logged
    rollout, _, _ = fake_engine_episode(tiny_model_dir, tmp_path / "plain", NUMBERS.format(info="{}"))
    assert set(rollout_metrics([rollout], 1)) == {f"rollout/{name}" for name in BUILT_IN}


CLAIMS_PARSE_COUNT = """
from openai import AsyncOpenAI
from molt import ChatAgent, Result

class AgentRunner(ChatAgent):
    async def run(self, ctx, row):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            await client.chat.completions.create(model=ctx.model, messages=row["messages"])
        return Result(reward=1.0, info={"tool_parse_failed": 0.0})
"""


def test_a_chat_agents_info_cannot_overwrite_molts_count_of_unparsed_tool_calls(tiny_model_dir, tmp_path):
    (tmp_path / "agent.py").write_text(CLAIMS_PARSE_COUNT)

    row = {"messages": [{"role": "user", "content": "copy the word: fox"}]}
    error, runner = chat_episode(tiny_model_dir, tmp_path / "agent.py", row, [7, 8, 9])
    assert isinstance(error, ValueError) and "'tool_parse_failed'" in str(error), error
    assert runner.failures["raised"] == 1


@pytest.mark.parametrize("flag", [["--agent.max_turns", "3"], ["--rollout.seed_requests"]])
def test_a_chat_agent_refuses_the_flags_of_env_turns(flag):
    # a ChatAgent's own SDK loop makes its turns and requests; these flags act on an Env's alone
    with pytest.raises(ConfigError, match=f"{flag[0]} .*ChatAgent"):
        resolve(["--agent.module", str(EXAMPLES / "openai_agent.py"), *flag])
    resolve(["--agent.module", str(EXAMPLES / "calculator_env.py"), *flag])  # an Env reads them
