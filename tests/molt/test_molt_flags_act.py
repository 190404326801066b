"""Every flag acts: for each field of `Config`, a changed value changes what the run does with it, seen by
the code that consumes it (`molt_probes`): a started process's arguments, the tensors a step sees, a
metric, the files a run writes, or the resolved run itself where a value acts only through the values it
derives. The default's observation is taken twice, so that one which varies by itself (a port, a clock)
cannot pass for an effect.

A flag that only a CUDA machine accepts is resolved with CUDA pretended (`_on_gpu`, `_local_gpus` and
`torch.cuda.is_available`), as the engine and actor arguments it sets are built without a GPU. A flag
with no accepted value but its default (`refused`) is checked refused, then shown to reach its consumer
when set without validation (`molt._flags.parse`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, get_args, get_origin

import molt_probes as probes
import pytest
import torch

import molt._validate
from molt._bounds import leaves
from molt._flags import parse, resolve
from molt.config import Config, ConfigError

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@dataclass(frozen=True)
class Probe:
    observe: Callable[[Config, Path], object]
    changed: str = ""  # the changed value; empty: the default flipped, the next choice, or the default + 1
    needs: tuple[str, ...] = ()  # flags that the flag, or what observes it, needs
    part: str = ""  # the part of the observation the flag changes; empty: all of it
    cuda: bool = False
    refused: bool = False


def P(
    observe, changed: str = "", *needs: str, part: str = "", cuda: bool = False, refused: bool = False
) -> Probe:
    """A row of `PROBES`: what observes the flag, its changed value, then the flags it needs."""
    return Probe(observe, changed, needs, part, cuda, refused)


MODEL = ("--model.path", "{model}")
MOE = ("--model.path", "{moe}")
AGENT = ("--agent.module", "{agent}")
SMALL = ("--train.num_steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2")  # loop_run
LORA = (*MODEL, "--actor.lora.rank", "8")
GAE_ONLY = ("--algo.advantage.estimator", "gae")  # the estimator that reads --algo.gae and --algo.critic
GAE = (*SMALL, *GAE_ONLY)

PROBES: dict[str, Probe] = {
    "model.path": P(probes.model_dir, "{model}"),
    "model.dtype": P(probes.engines, cuda=True),  # --dtype
    "data.path": P(probes.rows, "{rows}"),
    "data.apply_chat_template": P(probes.episode, "", *MODEL, *AGENT, part="requests"),  # the prompt's tokens
    "data.messages_key": P(probes.rows, "prompt", "--data.path", "{rows}"),
    "data.seed": P(probes.rows),
    "agent.module": P(probes.rows, "{agent}"),
    "agent.timeout": P(probes.episode, "1e-6", *MODEL, part="outcome"),
    "agent.max_turns": P(probes.episode, "", *MODEL, *AGENT, part="requests"),
    "agent.num_runners": P(probes.hosts),
    "algo.advantage.estimator": P(probes.loop_run, "rloo", *SMALL, part="steps"),
    "algo.loss.kind": P(probes.loss),
    "algo.loss.clip_low": P(probes.loss, "0.1"),
    "algo.loss.clip_high": P(probes.loss),
    "algo.loss.dual_clip": P(probes.loss, "3"),
    "algo.loss.agg": P(probes.loss, "seq-mean-token-mean"),
    "algo.loss.agg_constant": P(probes.loss, "5", "--algo.loss.agg", "seq-mean-token-sum-norm"),
    "algo.correction.mode": P(probes.loss),
    "algo.correction.token_cap": P(probes.loss),
    "algo.correction.token_bounds": P(probes.loss, "", "--algo.correction.mode", "mis"),
    "algo.correction.seq_bounds": P(probes.loss, "0.5,2.0", "--algo.correction.mode", "seq-mask-tis"),
    "algo.kl.coef": P(probes.loss, "0.1"),
    "algo.kl.kind": P(probes.loss, "k3", "--algo.kl.coef", "0.1"),
    "algo.kl.in_reward": P(probes.loop_run, "", *SMALL, "--algo.kl.coef", "0.1", part="steps"),
    "algo.entropy_coef": P(probes.loss, "0.01"),
    "algo.filters": P(probes.filters, "all_equal_rewards"),
    "algo.filter_max_batches": P(probes.filters, "", "--algo.filters", "all_equal_rewards,truncated"),
    "algo.teacher.model": P(probes.groups, "{other}", *MODEL, "--algo.advantage.estimator", "opd",
                            "--algo.teacher.model", "{teacher}"),  # fmt: skip
    "algo.gae.gamma": P(probes.loop_run, "0.9", *GAE, part="steps"),
    "algo.gae.lam": P(probes.loop_run, "0.9", *GAE, part="steps"),
    "algo.gae.whiten": P(probes.loop_run, "", *GAE, part="steps"),
    "algo.critic.model": P(probes.groups, "{teacher}", *MODEL, "--algo.advantage.estimator", "gae"),
    "algo.critic.lr": P(probes.critic_step, "0.01", *MODEL, *GAE_ONLY, part="critic/lr"),
    "algo.critic.value_clip": P(probes.critic_step, "0.5", *MODEL, *GAE_ONLY, part="critic/value_loss"),
    "actor.lr": P(probes.policy_step, "0.01", *MODEL, part="steps"),
    "actor.weight_decay": P(probes.policy_step, "0.1", *MODEL, part="weights"),
    "actor.grad_clip": P(probes.policy_step, "1e-9", *MODEL, part="weights"),  # below Adam's epsilon
    "actor.micro_batch_tokens": P(probes.policy_step, "4096", *MODEL, part="budget"),
    "actor.pack": P(probes.policy_step, "", *MODEL, part="budget"),
    "actor.shared_prefix": P(probes.prefix_pass, "on", *MODEL),
    "actor.activation_checkpointing": P(probes.parallelism),
    "actor.compile": P(probes.compiled, "off", cuda=True),
    "actor.compute_dtype": P(probes.policy_step, "bfloat16", *MODEL, part="steps"),
    "actor.freeze_moe_router": P(probes.policy_step, "", *MOE, part="trained"),
    "actor.warmup_steps": P(probes.policy_step, "4", *MODEL, part="steps"),
    "actor.num_ranks": P(probes.groups, "", "--algo.kl.coef", "0.1"),  # the reference's, as the policy's
    "actor.lora.rank": P(probes.policy_step, "8", *MODEL, part="trained"),
    "actor.lora.alpha": P(probes.policy_step, "32", *LORA, part="steps"),  # the second step's forward
    "actor.lora.target_modules": P(probes.policy_step, "q_proj,v_proj", *LORA, part="trained"),
    "actor.lora.dropout": P(probes.engines, "0.05", *LORA, refused=True),  # the engines' adapter config
    "fsdp.tp_size": P(probes.parallelism, "2", *MOE, "--actor.num_ranks", "2", cuda=True),
    "fsdp.ep_size": P(probes.parallelism, "2", *MOE, "--actor.num_ranks", "2", cuda=True),
    "fsdp.cp_size": P(probes.parallelism, "2", "--actor.num_ranks", "2", refused=True),
    "fsdp.offload": P(probes.parallelism, cuda=True),
    "vllm.num_engines": P(probes.engines),
    "vllm.urls": P(probes.engines, "http://127.0.0.1:1"),  # attached: none started
    "vllm.max_restarts": P(probes.restarts, "0"),
    "vllm.tensor_parallel_size": P(probes.engines, cuda=True),
    "vllm.data_parallel_size": P(probes.engines, cuda=True),
    "vllm.enable_expert_parallel": P(probes.engines, cuda=True),
    "vllm.max_num_batched_tokens": P(probes.engines, "4096"),
    "vllm.stream_interval": P(probes.engines, "0"),  # no --stream-interval (tito takes replies whole)
    "vllm.mtp_num_speculative_tokens": P(probes.engines, cuda=True),
    "vllm.enable_prefix_caching": P(probes.engines),
    "vllm.cuda_graphs": P(probes.engines, cuda=True),
    "vllm.compile": P(probes.engines, cuda=True),
    "vllm.max_model_len": P(probes.engines),
    "vllm.gpu_memory_utilization": P(probes.engines, "0.5", cuda=True),
    "vllm.kv_cache_tokens": P(probes.engines, "65536", cuda=True),  # --kv-cache-memory-bytes
    "vllm.placement": P(probes.engines, "shared", cuda=True),
    "vllm.mps": P(probes.mps, "off", "--vllm.placement", "shared", cuda=True),
    "rollout.group_size": P(probes.pool),
    "rollout.prompts_per_step": P(probes.loop_run, "3", *SMALL, part="steps"),
    "rollout.max_new_tokens": P(probes.episode, "", *MODEL, part="requests"),
    "rollout.temperature": P(probes.episode, "", *MODEL, part="requests"),
    "rollout.top_p": P(probes.episode, "0.9", *MODEL, part="requests", refused=True),
    "rollout.queue_depth": P(probes.pool, "48"),
    "rollout.max_lag": P(probes.pool),
    "rollout.stale": P(probes.pool),
    "rollout.max_stale_requeues": P(probes.pool, "", "--rollout.stale", "drop"),
    "rollout.partial_rollout": P(probes.loop_run, "", *SMALL, part="refits"),  # the pool holds during refits
    "rollout.seed_requests": P(probes.episode, "", *MODEL, part="requests"),
    "train.num_steps": P(probes.loop_run, "2", *SMALL, "--train.num_steps", "1", part="metrics"),
    "train.seed": P(probes.engines),  # the engines' --seed
    "train.mini_batches": P(probes.loop_run, "3", *SMALL, part="steps"),
    "train.force_on_policy": P(probes.pool),  # through the values it derives
    "train.routing_replay": P(probes.engines, "", *MOE, cuda=True),
    "train.rollout_dump_dir": P(probes.loop_run, "dumps", *SMALL, part="files"),
    "eval.every": P(probes.loop_run, "1", *SMALL, "--eval.path", "{rows}", part="metrics"),
    "eval.path": P(probes.eval_rows_of, "{rows}", *AGENT),
    "eval.num_prompts": P(probes.eval_rows_of, "2", *AGENT),
    "eval.n": P(probes.eval_scores),
    "eval.k": P(probes.eval_scores, "2"),
    "eval.pass_reward": P(probes.eval_scores, "1.5"),
    "ckpt.every": P(probes.loop_run, "1", *SMALL, part="files"),
    "ckpt.dir": P(probes.loop_run, "ckpts", *SMALL, "--ckpt.every", "1", part="files"),
    "logger.run_dir": P(probes.log_files, "logs", part="files"),
    "logger.tensorboard": P(probes.log_files, part="files"),
    "logger.wandb_project": P(probes.log_files, "molt-runs", part="wandb"),
    "logger.verbose": P(probes.ray_init),
    "ray.address": P(probes.ray_init, "127.0.0.1:6379"),
    "ray.num_cpus": P(probes.ray_init, "2"),
    "refit.delta": P(probes.policy_step, "", *MODEL, part="refit"),
}  # fmt: skip


def test_every_flag_has_a_probe():
    assert set(PROBES) == set(leaves())


AGENT_MODULE = '''
from molt.agent import Env, Result


def dataset(seed):
    while True:
        yield {"messages": [{"role": "user", "content": f"count from {seed}"}], "start": seed}


def eval_dataset(seed):
    for n in range(100):
        yield {"messages": [{"role": "user", "content": f"held out {n}"}]}


class AgentRunner(Env):
    """Rendered-text observations, and an episode that --agent.max_turns alone ends."""

    def reset(self, sample):
        return f"say {sample['start']}"

    def step(self, action):
        return Result(reward=1.0, observation="again")
'''


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """What the flags' values name: the tiny model (and two more paths to it), a small MoE model, rows
    whose messages are under `messages` and `prompt`, and an agent module."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("inputs")
    for name in ("teacher", "other"):
        (root / name).symlink_to(tiny_model_dir)
    moe = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe).save_pretrained(root / "moe")
    lines = [{key: [{"role": "user", "content": f"{key} {i}"}] for key in ("messages", "prompt")}
             for i in range(4)]  # fmt: skip
    (root / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "agent.py").write_text(AGENT_MODULE)
    names = ("teacher", "other", "moe", "rows.jsonl", "agent.py")
    return {"model": str(tiny_model_dir)} | {name.split(".")[0]: str(root / name) for name in names}


def _changed_value(path: str) -> str:
    leaf = leaves()[path]
    if leaf.type is bool:
        return str(not leaf.default).lower()
    if get_origin(leaf.type) is Literal:
        return next(str(choice) for choice in get_args(leaf.type) if choice != leaf.default)
    if get_origin(leaf.type) is tuple:
        return ",".join(str(v * 1.5) for v in leaf.default)
    return str(leaf.default + 1)


def _same(a, b) -> bool:
    """Equal, tensors element by element (and in dtype and shape), through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _observe(probe: Probe, args: list[str], where: Path, monkeypatch) -> object:
    """What `probe` sees of the run `args` configure, run in `where` (a fresh directory)."""
    where.mkdir()
    with monkeypatch.context() as inside:
        inside.chdir(where)
        return probe.observe((parse if probe.refused else resolve)(args), where)


_DEFAULTS: dict[tuple, object] = {}  # (probe, needs) -> what it sees of the run the needs alone configure


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A CPU machine, or (`machine(cuda=True)`) one with CUDA, GPUs for every part of a run and NVIDIA's
    driver utilities (a stand-in MPS control daemon)."""

    def pretend(cuda: bool) -> None:
        if cuda:
            probes.fake_mps_control(monkeypatch, tmp_path / "bin")
        monkeypatch.setattr(molt._validate, "_on_gpu", lambda: cuda)
        monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 64 if cuda else 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        h200 = SimpleNamespace(total_memory=150_000_000_000)  # what an engine's KV cache is sized within
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h200)

    return pretend


@pytest.mark.parametrize("path", list(leaves()))
def test_a_changed_flag_changes_what_the_run_does(path, inputs, machine, tmp_path, monkeypatch):
    probe = PROBES[path]
    machine(probe.cuda)
    needs = [arg.format(**inputs) for arg in probe.needs]
    value = (probe.changed or _changed_value(path)).format(**inputs)
    if probe.refused:
        with pytest.raises(ConfigError, match=f"--{path}"):
            resolve([*needs, f"--{path}", value])
    key = (probe.observe, probe.needs, probe.cuda, probe.refused)
    if key not in _DEFAULTS:
        default = _observe(probe, needs, tmp_path / "default", monkeypatch)
        again = _observe(probe, needs, tmp_path / "again", monkeypatch)
        assert _same(default, again), f"{probe.observe.__name__} sees the same run differently twice"
        _DEFAULTS[key] = default
    changed = _observe(probe, [*needs, f"--{path}", value], tmp_path / "changed", monkeypatch)
    default = _DEFAULTS[key]
    if probe.part:
        default, changed = default[probe.part], changed[probe.part]
    seen = f"{probe.observe.__name__}{probe.part and f'[{probe.part!r}]'}"
    assert not _same(default, changed), f"--{path} {value}: {seen} sees no change"
