"""The one validation pass (`molt._validate.validate`): every refusal comes before anything starts and names
its flags. Config-only checks go through `resolve` (flags -> `validate`); the model checks read hand-written
config.json files; CUDA is pretended where a check needs it (`_on_gpu`, `_local_gpus`), as this machine has
none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin

import msgspec
import pytest

import molt._validate
from molt._bounds import leaves
from molt._checks_model import num_experts
from molt._engines import engine_extra_args
from molt._flags import resolve
from molt._placement import engine_gpus, engine_memory_utilization, gpu_share, gpus_needed, refit_backend
from molt._validate import check_cluster_gpus, validate
from molt.config import Config, ConfigError


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: False)


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: True)
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 64)


def _refused(args: list[str], flags: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        resolve(args)
    for flag in flags:
        assert flag in str(error.value)


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        pytest.param(
            ["--algo.correction.mode", "none", "--rollout.partial_rollout", "false"],
            ["--algo.correction.mode", "--rollout.max_lag"],
            id="async-without-correction",
        ),
        pytest.param(
            ["--algo.correction.mode", "none", "--rollout.max_lag", "0"],
            ["--algo.correction.mode", "--rollout.partial_rollout"],
            id="partial-rollout-without-correction",
        ),
        pytest.param(["--train.routing_replay"], ["--train.routing_replay", "GPU model runner"], id="replay"),
        pytest.param(["--vllm.mps", "on"], ["--vllm.mps", "needs CUDA"], id="mps"),
        pytest.param(
            ["--vllm.tensor_parallel_size", "2"], ["--vllm.tensor_parallel_size", "CUDA"], id="engine-tp"
        ),
        pytest.param(["--actor.compile", "on"], ["--actor.compile on", "CUDA"], id="compile"),
        pytest.param(["--fsdp.tp_size", "2", "--actor.num_ranks", "2"], ["--fsdp.tp_size", "CUDA"], id="tp"),
        pytest.param(["--fsdp.ep_size", "2", "--actor.num_ranks", "2"], ["--fsdp.ep_size", "CUDA"], id="ep"),
        pytest.param(["--fsdp.offload"], ["--fsdp.offload", "host memory"], id="offload"),
        pytest.param(["--vllm.cuda_graphs", "false"], ["--vllm.cuda_graphs", "eager"], id="cuda-graphs"),
        pytest.param(["--vllm.compile", "false"], ["--vllm.compile", "eager"], id="engine-compile"),
        pytest.param(
            ["--vllm.gpu_memory_utilization", "0.5"], ["--vllm.gpu_memory_utilization"], id="gpu-memory"
        ),
    ],
)
def test_config_guards_refuse_on_cpu(cpu_only, args, flags):
    _refused(args, flags)


def test_compiled_layers_are_refused_with_routing_replay_or_checkpointing(with_cuda):
    replay = ["--actor.compile", "on", "--train.routing_replay"]
    _refused(replay, ["--actor.compile on", "--train.routing_replay"])
    both = ["--actor.compile", "on", "--actor.activation_checkpointing"]
    _refused(both, ["--actor.compile on", "--actor.activation_checkpointing"])
    assert resolve(["--actor.compile", "on"]).actor.compile == "on"


def test_compile_auto_is_on_with_cuda_unless_checkpointing_or_replay_asks_otherwise():
    from molt._placement import compiles

    assert compiles(resolve([]), on_gpu=True) and not compiles(resolve([]), on_gpu=False)
    checkpointing = resolve(["--actor.activation_checkpointing"])
    assert not compiles(checkpointing, on_gpu=True)
    assert not compiles(resolve(["--actor.compile", "off"]), on_gpu=True)


def test_a_gpu_run_says_when_compile_auto_leaves_the_layers_eager(with_cuda):
    from molt._validate import start_notes

    notes = start_notes(resolve(["--actor.activation_checkpointing"]))
    assert any("run eager (--actor.compile auto): --actor.activation_checkpointing" in note for note in notes)
    assert not any("run eager" in note for note in start_notes(resolve([])))


def test_a_micro_batch_budget_below_the_longest_row_is_refused_naming_both():
    _refused(
        ["--actor.micro_batch_tokens", "1000", "--vllm.max_model_len", "1024"],
        ["--actor.micro_batch_tokens 1000", "--vllm.max_model_len 1024"],
    )
    assert resolve(["--actor.micro_batch_tokens", "1024", "--vllm.max_model_len", "1024"])


def test_context_parallelism_message_says_why(with_cuda):
    _refused(["--fsdp.cp_size", "2", "--actor.num_ranks", "2"], ["--fsdp.cp_size 2", "Transformer Engine"])


def test_on_policy_without_correction_is_accepted():
    config = resolve(
        ["--algo.correction.mode", "none", "--rollout.max_lag", "0", "--rollout.partial_rollout=false"]
    )
    assert config.algo.correction.mode == "none"


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        pytest.param(
            ["--actor.num_ranks", "3", "--fsdp.tp_size", "2"],
            ["--actor.num_ranks", "--fsdp.tp_size"],
            id="tp",
        ),
        pytest.param(
            ["--actor.num_ranks", "4", "--fsdp.ep_size", "3"],
            ["--fsdp.ep_size", "--actor.num_ranks"],
            id="ep",
        ),
        pytest.param(["--fsdp.tp_size", "0"], ["--fsdp.tp_size"], id="zero-tp"),
        pytest.param(["--vllm.data_parallel_size", "0"], ["--vllm.data_parallel_size"], id="zero-dp"),
        pytest.param(["--actor.micro_batch_tokens", "-1"], ["--actor.micro_batch_tokens"], id="micro-batch"),
        pytest.param(
            ["--ray.address", "10.0.0.1:6379", "--ray.num_cpus", "2"],
            ["--ray.num_cpus", "--ray.address"],
            id="ray-address-with-num-cpus",
        ),
    ],
)
def test_parallel_sizes_must_split_the_ranks(with_cuda, args, flags):
    _refused(args, flags)


def test_parallel_sizes_that_split_are_accepted_on_cuda(with_cuda, tmp_path):
    model = _model(tmp_path, num_key_value_heads=8, num_experts=8)
    args = ["--actor.num_ranks", "8", "--fsdp.tp_size", "2", "--fsdp.ep_size", "8", "--model.path", model]
    config = resolve(args + ["--actor.freeze_moe_router", "--vllm.tensor_parallel_size", "4"])
    assert (config.fsdp.tp_size, config.fsdp.ep_size) == (2, 8)


def test_routing_replay_is_accepted_on_cuda_for_an_moe_model(with_cuda, tmp_path):
    config = resolve(["--train.routing_replay", "--model.path", _model(tmp_path, num_experts=8)])
    assert config.train.routing_replay is True


def test_freezing_the_moe_router_freezes_every_gate_and_refuses_a_dense_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from molt._sharding import freeze_moe_routers

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    freeze_moe_routers(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert {name.split(".mlp.gate.")[0] for name in frozen} == {"model.layers.0", "model.layers.1"}
    assert any(".mlp.experts." in name for name, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="no router"):
        freeze_moe_routers(AutoModelForCausalLM.from_pretrained(tiny_model_dir))


def _model(tmp_path, **fields) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 16, **fields}))
    return str(tmp_path)


def _config(**groups) -> Config:
    config = Config()
    return msgspec.structs.replace(
        config, **{name: msgspec.structs.replace(getattr(config, name), **f) for name, f in groups.items()}
    )


def check_model(config: Config, model_dir) -> None:
    """`validate` with --model.path `model_dir`, and as many actor ranks as the parallel sizes ask."""
    raw = msgspec.to_builtins(config)
    raw["model"]["path"] = str(model_dir)
    raw["actor"]["num_ranks"] = config.fsdp.tp_size * config.fsdp.ep_size
    validate(msgspec.convert(raw, Config))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, 0), ({"num_experts": 128}, 128), ({"n_routed_experts": 256}, 256), ({"num_local_experts": 8}, 8)],
    ids=["dense", "qwen-moe", "deepseek", "mixtral"],
)
def test_num_experts_reads_each_family_key(fields, expected):
    assert num_experts(fields) == expected


@pytest.mark.parametrize(("group", "flag"), [("train", "routing_replay"), ("actor", "freeze_moe_router")])
def test_a_router_flag_on_a_dense_model_is_refused(with_cuda, tmp_path, tiny_model_dir, group, flag):
    with pytest.raises(ConfigError, match=rf"--{group}\.{flag} .*dense"):
        check_model(_config(**{group: {flag: True}}), tiny_model_dir)
    check_model(_config(**{group: {flag: True}}), _model(tmp_path, num_experts=8))


@pytest.mark.parametrize("key", ["num_experts", "n_routed_experts", "num_local_experts"])
def test_ep_size_must_divide_the_experts(with_cuda, tmp_path, key):
    model_dir = _model(tmp_path, **{key: 6})
    with pytest.raises(ConfigError, match=r"--fsdp\.ep_size 4 must divide the model's 6 experts"):
        check_model(_config(fsdp={"ep_size": 4}), model_dir)
    check_model(_config(fsdp={"ep_size": 3}), model_dir)


def test_ep_size_on_a_dense_model_is_refused(with_cuda, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"--fsdp\.ep_size 2 .*0 experts"):
        check_model(_config(fsdp={"ep_size": 2}), tiny_model_dir)


@pytest.mark.parametrize(
    ("tp", "kv_heads", "refused"),
    [(2, 4, False), (3, 4, True), (8, 4, True), (32, 32, True)],
    ids=["divides", "not-heads", "not-kv-heads", "more-than-heads"],
)
def test_fsdp_tp_size_must_divide_heads_and_kv_heads(with_cuda, tmp_path, tp, kv_heads, refused):
    model_dir = _model(tmp_path, num_key_value_heads=kv_heads)
    config = _config(fsdp={"tp_size": tp})
    if not refused:
        check_model(config, model_dir)
        return
    with pytest.raises(
        ConfigError, match=rf"--fsdp\.tp_size {tp} must divide the model's 16 attention heads"
    ):
        check_model(config, model_dir)


def test_engine_tp_may_replicate_kv_heads_but_must_divide_heads(with_cuda, tmp_path):
    model_dir = _model(tmp_path, num_key_value_heads=4)
    check_model(_config(vllm={"tensor_parallel_size": 8}), model_dir)  # vLLM replicates KV heads
    with pytest.raises(ConfigError, match=r"--vllm\.tensor_parallel_size 6"):
        check_model(_config(vllm={"tensor_parallel_size": 6}), model_dir)
    with pytest.raises(ConfigError, match=r"--vllm\.tensor_parallel_size configures engines molt starts"):
        check_model(_config(vllm={"tensor_parallel_size": 6, "urls": ["http://x"]}), model_dir)


def test_gpus_needed_counts_actor_ranks_and_engine_gpus():
    config = _config(
        actor={"num_ranks": 4}, vllm={"num_engines": 2, "tensor_parallel_size": 2, "data_parallel_size": 2}
    )
    assert gpus_needed(config) == 4 + 2 * 2 * 2
    attached = _config(actor={"num_ranks": 4}, vllm={"num_engines": 2, "urls": ["http://x"]})
    assert gpus_needed(attached) == 4


def test_gpus_needed_counts_each_extra_group_like_the_policy(with_cuda, monkeypatch):
    args = ["--actor.num_ranks", "2", "--vllm.urls", "http://x:1", "--algo.kl.coef", "0.1",
            "--algo.advantage.estimator", "gae"]  # fmt: skip
    assert gpus_needed(resolve(args)) == 3 * 2  # policy, reference, critic
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 4)
    _refused(args, ["['policy', 'reference', 'critic']"])


def test_a_teacher_or_critic_must_share_the_policys_tokenizer(tmp_path, tiny_model_dir):
    from molt.tiny import build_tiny_model

    opd = ["--algo.advantage.estimator", "opd", "--model.path", str(tiny_model_dir), "--algo.teacher.model"]
    resolve([*opd, str(build_tiny_model(tmp_path / "sibling", seed=1))])  # other weights, same tokenizer
    other = str(build_tiny_model(tmp_path / "other", words=("alpha", "beta")))
    _refused([*opd, other], ["--algo.teacher.model", "has another tokenizer"])
    gae = ["--algo.advantage.estimator", "gae", "--model.path", str(tiny_model_dir), "--algo.critic.model"]
    _refused([*gae, other], ["--algo.critic.model", "has another tokenizer"])
    _refused([*gae, str(tmp_path / "missing")], ["--algo.critic.model", "not a Hugging Face model directory"])
    _refused(
        [*opd[:2], "--algo.teacher.model", str(tiny_model_dir)], ["--algo.teacher.model", "--model.path"]
    )


def test_opd_refuses_a_kl_folded_into_the_reward_it_ignores(tiny_model_dir):
    model = str(tiny_model_dir)
    args = ["--algo.advantage.estimator", "opd", "--algo.teacher.model", model, "--model.path", model,
            "--algo.kl.coef", "0.1"]  # fmt: skip
    resolve(args)  # a KL loss term is fine
    _refused([*args, "--algo.kl.in_reward", "true"], ["--algo.kl.in_reward", "opd"])


def test_more_gpus_than_a_local_ray_would_see_is_refused(with_cuda, monkeypatch):
    args = ["--actor.num_ranks", "2", "--vllm.tensor_parallel_size", "2"]
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 4)
    resolve(args)
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 3)
    _refused(args, ["needs 4 GPUs", "Ray sees 3", "--actor.num_ranks", "--vllm.tensor_parallel_size",
                    "--ray.address"])  # fmt: skip
    resolve([*args, "--ray.address", "head:6379"])  # a cluster's GPUs are checked once joined


def test_a_joined_clusters_gpus_are_checked_against_what_it_has(with_cuda, monkeypatch):
    import ray

    config = resolve(["--actor.num_ranks", "2", "--ray.address", "head:6379"])
    assert config.vllm.placement == "auto"  # decided once the cluster is joined
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    with pytest.raises(ConfigError, match="needs 3 GPUs but Ray sees 2"):
        check_cluster_gpus(config)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 3.0})
    assert check_cluster_gpus(config).vllm.placement == "separate"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 1.0})
    assert check_cluster_gpus(resolve(["--ray.address", "head:6379"])).vllm.placement == "shared"


def test_one_gpu_is_enough_the_engine_and_the_actor_share_it(with_cuda, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # for the engine's command line
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 1)
    config = resolve([])
    assert config.vllm.placement == "shared"
    assert gpu_share(config) == engine_gpus(config) == 0.5  # Ray places both on the one GPU
    assert engine_memory_utilization(config) == 0.4 and refit_backend(config, on_gpu=True) == "refit_ipc"
    with_kl = resolve(["--algo.kl.coef", "0.1"])  # the reference policy shares it too
    assert gpu_share(with_kl) == engine_gpus(with_kl) == 0.3333
    assert "--weight-transfer-config" in (args := engine_extra_args(config))
    assert '{"backend": "refit_ipc"}' in args and args[args.index("--gpu-memory-utilization") + 1] == "0.4"
    from molt._validate import start_notes

    assert any("refits go over CUDA IPC" in note for note in start_notes(config))
    lora = resolve(["--actor.lora.rank", "8", "--actor.compute_dtype", "bfloat16"])
    assert refit_backend(lora, on_gpu=True) == "refit_gloo"
    assert any("LoRA adapter refits go over gloo" in note for note in start_notes(lora))
    # several engines on the one GPU, when asked, split the engines' share and Ray's GPU between them
    _refused(["--vllm.num_engines", "2"], ["needs 3 GPUs but Ray sees 1"])  # auto: one engine a GPU
    two = resolve(["--vllm.num_engines", "2", "--vllm.placement", "shared"])
    assert gpu_share(two) == engine_gpus(two) == 0.3333
    two_args = engine_extra_args(two)
    assert two_args[two_args.index("--gpu-memory-utilization") + 1] == "0.2"
    assert any("its 2 engines take (evenly) 40%" in note for note in start_notes(two))
    for flags, named in [
        (["--actor.num_ranks", "2"], "--actor.num_ranks 2"),
        (["--vllm.tensor_parallel_size", "2"], "an engine over more than one GPU"),
    ]:
        _refused(flags, ["needs 3 GPUs but Ray sees 1", "--vllm.placement shared"])  # auto: separate
        _refused([*flags, "--vllm.placement", "shared"], ["--vllm.placement shared", named])


@pytest.mark.parametrize(
    ("flag", "value"),
    [("num_engines", "2"), ("max_restarts", "0"), ("max_num_batched_tokens", "512"),
     ("enable_prefix_caching", "false")],
)  # fmt: skip
def test_flags_of_started_engines_are_refused_with_attached_ones(cpu_only, flag, value):
    """Engines of --vllm.urls were started with their own flags: one of molt's would do nothing."""
    _refused(["--vllm.urls", "http://x:1", f"--vllm.{flag}", value], [f"--vllm.{flag}", "--vllm.urls"])
    assert resolve(["--vllm.urls", "http://x:1", "--vllm.max_model_len", "4096"])  # the trainer's too


def test_validating_a_resolved_config_with_attached_engines_changes_nothing(with_cuda):
    """The placement `validate` decides is no engine flag of the user's: a config it resolved, validated
    again (`molt.train(resolve(...))`, a --print-config file read back), is accepted unchanged."""
    config = resolve(["--vllm.urls", "http://x:1"])
    assert config.vllm.placement == "separate"
    assert validate(config) == config


def test_gpus_of_their_own_keep_the_nccl_refit(with_cuda, monkeypatch):
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 2)
    config = resolve([])
    assert config.vllm.placement == "separate" and gpu_share(config) == 1.0 and engine_gpus(config) == 1
    assert engine_memory_utilization(config) == 0.8 and refit_backend(config, on_gpu=True) == "refit_nccl"
    shared = resolve(["--vllm.placement", "shared", "--vllm.gpu_memory_utilization", "0.3"])
    assert shared.vllm.placement == "shared" and engine_memory_utilization(shared) == 0.3
    assert refit_backend(config, on_gpu=False) == "refit_gloo"
    lora = resolve(["--actor.lora.rank", "8", "--actor.compute_dtype", "bfloat16"])
    # an adapter goes over refit_gloo, which swaps it in place
    assert refit_backend(lora, on_gpu=True) == "refit_gloo"


def test_engine_flags_reach_the_vllm_command_line_on_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vllm = {"tensor_parallel_size": 4, "data_parallel_size": 2, "enable_expert_parallel": True,
            "max_num_batched_tokens": 8192, "mtp_num_speculative_tokens": 2, "enable_prefix_caching": False,
            "cuda_graphs": False}  # fmt: skip
    args = engine_extra_args(_config(vllm=vllm, train={"routing_replay": True}))
    line = " ".join(args)
    for expected in ("--tensor-parallel-size 4", "--data-parallel-size 2", "--max-num-batched-tokens 8192",
                     "--no-enable-prefix-caching", "--enforce-eager", "--enable-expert-parallel",
                     "--enable-return-routed-experts"):  # fmt: skip
        assert expected in line
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 2}
    uncompiled = engine_extra_args(_config(vllm={"compile": False}))
    compilation = json.loads(uncompiled[uncompiled.index("--compilation-config") + 1])
    assert compilation == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}  # no compile, decode graphs
    eager = engine_extra_args(_config(vllm={"compile": False, "cuda_graphs": False}))
    assert "--enforce-eager" in eager and "--compilation-config" not in eager
    defaults = " ".join(engine_extra_args(Config()))
    assert "--enable-prefix-caching" in defaults and "--enforce-eager" not in defaults
    assert "--compilation-config" not in defaults
    assert "--speculative-config" not in defaults and "--enable-expert-parallel" not in defaults


def test_engine_flags_on_cpu_keep_the_cpu_engine_single_process(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = engine_extra_args(_config(vllm={"max_num_batched_tokens": 512}))
    assert "--max-num-batched-tokens" in args and "--tensor-parallel-size" not in args


# --- every field: a bad value is refused naming its flag (that a changed one acts: test_molt_flags_act) ---


def _numeric(tp) -> bool:
    """An int or float field: itself, optional, or a tuple of them (each field's bound: test_molt_bounds)."""
    if get_origin(tp) is Annotated:
        return _numeric(get_args(tp)[0])
    args = [a for a in get_args(tp) if a is not type(None)]
    return all(map(_numeric, args)) if args else tp in (int, float)


_NOT_FINITE = ["nan", "inf", "-inf"]

# Values just outside each numeric field's bound, written out here rather than read from the fields' types,
# so a bound that is loosened (or lost) fails this test. A float field also refuses a non-finite
# value; a pair refuses one end out of range and low above high.
_BAD_NUMBERS: dict[str, list[str]] = {
    "data.seed": ["-1"],
    "agent.timeout": ["0", "-1.5", *_NOT_FINITE], "agent.max_turns": ["0"], "agent.num_runners": ["-1"],
    "algo.loss.clip_low": ["-0.1", "1.0", "nan"], "algo.loss.clip_high": ["-0.01", *_NOT_FINITE],
    "algo.loss.dual_clip": ["1.0", "0.5", "inf"],
    "algo.correction.token_cap": ["0", "-2.0", *_NOT_FINITE],
    "algo.correction.token_bounds": ["0.0,3", "-1.0,3", "2.0,1.0", "0.5,inf"],
    "algo.correction.seq_bounds": ["0.0,3", "1.01,0.99", "nan,1.0"],
    "algo.kl.coef": ["-0.1", *_NOT_FINITE], "algo.entropy_coef": ["-0.01", *_NOT_FINITE],
    "algo.filter_max_batches": ["0", "-1"], "algo.loss.agg_constant": ["-1"],
    "algo.gae.gamma": ["-0.1", "1.01", "nan"], "algo.gae.lam": ["-0.1", "1.5", "nan"],
    "algo.critic.lr": ["0", "-1e-3", *_NOT_FINITE], "algo.critic.value_clip": ["0", "-0.2", "inf"],
    "actor.lr": ["0", "-1e-3", *_NOT_FINITE], "actor.weight_decay": ["-0.1", "nan"],
    "actor.grad_clip": ["0", "-1.0", "inf"],
    "actor.micro_batch_tokens": ["-1"], "actor.warmup_steps": ["-1"], "actor.num_ranks": ["0"],
    "fsdp.tp_size": ["0"], "fsdp.ep_size": ["0"], "fsdp.cp_size": ["0"],
    "vllm.num_engines": ["0"], "vllm.max_restarts": ["-1"], "vllm.tensor_parallel_size": ["0"],
    "vllm.data_parallel_size": ["0"], "vllm.stream_interval": ["-1"],
    "vllm.max_num_batched_tokens": ["0"], "vllm.mtp_num_speculative_tokens": ["-1"],
    "vllm.max_model_len": ["1", "0"], "vllm.gpu_memory_utilization": ["0", "1.01", "nan"],
    "vllm.kv_cache_tokens": ["-1"],
    "rollout.group_size": ["0"], "rollout.prompts_per_step": ["0"], "rollout.max_new_tokens": ["0"],
    "rollout.temperature": ["0", "-1.0", *_NOT_FINITE], "rollout.top_p": ["0", "1.01", "nan"],
    "rollout.queue_depth": ["-1"], "rollout.max_lag": ["-1"], "rollout.max_stale_requeues": ["0"],
    "train.num_steps": ["0"], "train.seed": ["-1"], "train.mini_batches": ["0"],
    "eval.every": ["-1"], "eval.num_prompts": ["0"], "eval.n": ["0"], "eval.k": ["0"],
    "eval.pass_reward": _NOT_FINITE,
    "actor.lora.rank": ["-1"], "actor.lora.alpha": ["0", "-16.0", "inf"],
    "actor.lora.dropout": ["-0.1", "1.0", "nan"],
    "ckpt.every": ["-1"],
    "ray.num_cpus": ["0"],
}  # fmt: skip


def test_every_numeric_field_has_bad_values_written_out():
    numeric = {path for path, leaf in leaves().items() if _numeric(leaf.type)}
    assert numeric == set(_BAD_NUMBERS)


def _file(tmp_path: Path) -> str:
    (tmp_path / "a_file").write_text("x")
    return str(tmp_path / "a_file")


_BAD_TEXT = {  # the string fields' bad values (tmp_path -> value)
    "model.path": lambda tmp: str(tmp / "missing"),
    "data.path": lambda tmp: str(tmp / "missing.jsonl"),
    "data.messages_key": lambda tmp: "",
    "agent.module": lambda tmp: "no_such_agent_module",
    "algo.teacher.model": lambda tmp: str(tmp / "missing"),
    "algo.critic.model": lambda tmp: str(tmp / "missing"),
    "vllm.urls": lambda tmp: "localhost:8000",
    "train.rollout_dump_dir": _file,
    "eval.path": lambda tmp: str(tmp / "missing.jsonl"),
    "ckpt.dir": _file,
    "logger.run_dir": _file,
    "ray.address": lambda tmp: "not an address",
    "logger.wandb_project": lambda tmp: "team/project",
    "actor.lora.target_modules": lambda tmp: "qkv_proj",
    "algo.filters": lambda tmp: "all_equal",
}


def _bad_values(path: str, tmp_path: Path) -> list[str]:
    leaf_type = leaves()[path].type
    if path in _BAD_NUMBERS:
        return _BAD_NUMBERS[path]
    if leaf_type is bool:
        return ["maybe"]
    if get_origin(leaf_type) is Literal:
        return ["no-such-choice"]
    return [_BAD_TEXT[path](tmp_path)]


@pytest.mark.parametrize("path", list(leaves()))
def test_every_field_refuses_a_bad_value_naming_its_flag(path, tmp_path):
    extra = {"algo.critic.model": ["--algo.advantage.estimator", "gae"]}.get(path, [])
    for value in _bad_values(path, tmp_path):
        with pytest.raises(ConfigError) as error:
            resolve([*extra, f"--{path}", value])
        assert f"--{path}" in str(error.value), (value, str(error.value))


def test_the_python_api_validates_before_anything_starts(tmp_path):
    import ray

    from molt import train

    config = _config(rollout={"top_p": 0.9}, logger={"run_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match=r"--rollout\.top_p 0\.9: the engine would renormalise"):
        train(config)
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_a_command_run_validates_once_and_the_launch_does_not_again(tmp_path, monkeypatch):
    """`molt train` validates its flags, then launches what it validated: the launch's first act is its
    start-up clock, not a second pass (which would import the agent and load tokenizers again)."""
    import molt._cli
    import molt._launch

    passes = []
    monkeypatch.setattr(molt._cli, "validate", lambda config: passes.append(config) or validate(config))
    monkeypatch.setattr(molt._launch, "validate", lambda config: pytest.fail("launch validated again"))

    class Launched(Exception):
        pass

    def launched():
        raise Launched

    monkeypatch.setattr(molt._launch, "StartupClock", launched)
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    result = CliRunner().invoke(molt._cli.app, ["train", "--train.num_steps", "3"])
    assert isinstance(result.exception, Launched), result.output
    assert len(passes) == 1


def test_the_command_refuses_an_out_of_range_flag_before_anything_starts(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from molt._cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--rollout.max_new_tokens", "0"])
    assert result.exit_code == 2
    assert "--rollout.max_new_tokens must be a whole number >= 1, got 0" in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            ["--train.mini_batches", "1"],
            "--algo.loss.kind ppo with --train.mini_batches 1",
            id="ppo-one-step",
        ),
        pytest.param(
            ["--algo.loss.kind", "cispo", "--train.mini_batches", "1"],
            "surrogate reduces to pg",
            id="cispo-one-step",
        ),
        pytest.param(["--actor.compute_dtype", "bfloat16"], "CPU engine samples in float32", id="bf16-actor"),
        pytest.param(
            ["--algo.kl.coef", "0.1", "--algo.kl.in_reward", "true", "--algo.kl.kind", "k2"],
            "--algo.kl.kind k2 in the reward",
            id="k2-in-the-reward",
        ),
        pytest.param(
            ["--algo.kl.coef", "0.1", "--algo.kl.in_reward", "true", "--algo.kl.kind", "k3"],
            "--algo.kl.kind k3 in the reward",
            id="k3-in-the-reward",
        ),
    ],
)
def test_the_run_says_at_start_what_acts_otherwise_than_its_name(cpu_only, args, says):
    from molt._validate import start_notes

    assert any(says in note for note in start_notes(resolve(args)))


def test_k1_in_the_reward_and_k2_in_the_loss_get_no_kl_note(cpu_only):
    # k1 through the score function, and k2 differentiated, each follow the gradient of KL(pi || ref);
    # auto, the default, picks them
    from molt._validate import start_notes

    for args in (["--algo.kl.in_reward", "true", "--algo.kl.kind", "k1"], ["--algo.kl.kind", "k2"],
                 ["--algo.kl.in_reward", "true"], []):  # fmt: skip
        notes = start_notes(resolve(["--algo.kl.coef", "0.1", *args]))
        assert not any("--algo.kl.kind" in note for note in notes)


def test_a_model_that_cannot_pack_is_said_to_pad_at_start(cpu_only, tmp_path, tiny_model_dir):
    from transformers import Qwen3NextConfig

    from molt._validate import start_notes

    Qwen3NextConfig(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2).save_pretrained(
        tmp_path
    )
    hybrid = msgspec.structs.replace(
        Config(), model=msgspec.structs.replace(Config().model, path=str(tmp_path))
    )
    notes = [note for note in start_notes(hybrid) if "--actor.pack" in note]
    assert len(notes) == 1 and "qwen3_next (linear_attention layers) carries state" in notes[0]
    dense = msgspec.structs.replace(
        hybrid, model=msgspec.structs.replace(hybrid.model, path=str(tiny_model_dir))
    )
    assert not [note for note in start_notes(dense) if "--actor.pack" in note]


def test_no_start_note_where_the_settings_act_as_named(cpu_only):
    from molt._validate import start_notes

    assert start_notes(resolve([])) == []  # the defaults never warn about themselves
    assert start_notes(resolve(["--train.mini_batches", "2"])) == []
    assert start_notes(resolve(["--algo.loss.kind", "pg", "--train.mini_batches", "1"])) == []


def test_delta_refit_is_refused_with_cuda_engines(with_cuda):
    _refused(["--refit.delta"], ["--refit.delta", "gloo"])


def test_delta_refit_is_accepted_on_a_cpu(cpu_only):
    assert resolve(["--refit.delta"]).refit.delta is True


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            ["--actor.lora.alpha", "32"], "--actor.lora.alpha is set but --actor.lora.rank is 0", id="off"
        ),
        pytest.param(["--actor.lora.rank", "32"], "--actor.lora.rank 32 does not fit k_proj", id="kv-heads"),
        pytest.param(
            ["--actor.lora.rank", "8", "--actor.lora.target_modules", ""],
            "target_modules is empty",
            id="empty",
        ),
        pytest.param(
            ["--actor.lora.rank", "8", "--actor.lora.dropout", "0.05"],
            "--actor.lora.dropout 0.05: dropout in the loss's forward would train a randomly thinned policy",
            id="dropout",
        ),
    ],
)
def test_lora_that_cannot_run_is_refused(args, says):
    with pytest.raises(ConfigError, match=says):
        resolve(args)


def test_float32_lora_is_refused_with_cuda_engines(with_cuda):
    """vLLM's Triton LoRA kernels assert a bfloat16 or float16 weight (seen on an H200: the engine died at
    start with float32); the default --model.dtype is float32."""
    _refused(["--actor.lora.rank", "8"], ["--actor.lora.rank", "--actor.compute_dtype bfloat16"])
    for args in (["--actor.compute_dtype", "bfloat16"], ["--model.dtype", "bfloat16"]):
        assert resolve(["--actor.lora.rank", "8", *args]).actor.lora.rank == 8


def test_float32_lora_is_accepted_on_a_cpu(cpu_only):
    assert resolve(["--actor.lora.rank", "8"]).actor.lora.rank == 8


def test_lora_rank_below_every_projection_is_accepted():
    """The tiny model's smallest projection side is its one key-value head of 32 (k_proj, v_proj)."""
    assert resolve(["--actor.lora.rank", "31"]).actor.lora.rank == 31
    assert resolve(
        ["--actor.lora.rank", "32", "--actor.lora.target_modules", "q_proj,o_proj"]
    ).actor.lora.rank


def test_lora_on_an_moe_model_is_refused(tmp_path, tiny_model_dir):
    model = tmp_path / "moe"
    model.mkdir()
    fields = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**fields, "num_experts": 4}))
    with pytest.raises(ConfigError, match="an MoE model"):
        resolve(["--model.path", str(model), "--actor.lora.rank", "8"])


@pytest.mark.parametrize(
    ("fields", "args", "says"),
    [
        pytest.param(
            {"hidden_size": 4096, "intermediate_size": 8192, "num_attention_heads": 32, "head_dim": 128,
             "num_key_value_heads": 8},
            ["--actor.lora.rank", "640"], "--actor.lora.rank 640 is above 512", id="rank-above-vllm",
        ),
        pytest.param({"vision_config": {}}, ["--actor.lora.rank", "8"], "vision-language", id="vision"),
        pytest.param({}, ["--actor.lora.rank", "8", "--refit.delta"], "drop --refit.delta", id="delta"),
    ],
)  # fmt: skip
def test_lora_the_engines_cannot_serve_is_refused(tmp_path, tiny_model_dir, fields, args, says):
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(ConfigError, match=says):
        resolve(["--model.path", str(model), *args])
