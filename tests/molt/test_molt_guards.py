"""Launch guards (issue: scale by configuration): each refuses before anything starts, naming its flags.

Config-only guards go through `resolve` (flags -> `validate`); the guards that read the model's
config.json or Ray's GPUs are called directly on hand-written config.json files and GPU counts.
"""

from __future__ import annotations

import json

import msgspec
import pytest

import molt.config
from molt._engines import engine_extra_args
from molt._flags import resolve
from molt._guards import check_gpus, check_model, check_tokenizer, gpus_needed, num_experts
from molt.config import Config, ConfigError


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(molt.config, "_cuda_available", lambda: False)


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(molt.config, "_cuda_available", lambda: True)


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
        pytest.param(["--fsdp.cp_size", "2", "--actor.num_ranks", "2"], ["--fsdp.cp_size"], id="cp-on-cpu"),
        pytest.param(["--train.routing_replay"], ["--train.routing_replay", "CPU build"], id="replay-on-cpu"),
        pytest.param(
            ["--vllm.tensor_parallel_size", "2"], ["--vllm.tensor_parallel_size"], id="engine-tp-on-cpu"
        ),
        pytest.param(["--actor.compile"], ["--actor.compile", "CUDA"], id="compile-on-cpu"),
    ],
)
def test_config_guards_refuse_on_cpu(cpu_only, args, flags):
    _refused(args, flags)


def test_compiled_layers_are_refused_with_routing_replay_or_checkpointing(with_cuda):
    _refused(["--actor.compile", "--train.routing_replay"], ["--actor.compile", "--train.routing_replay"])
    both = ["--actor.compile", "--actor.activation_checkpointing"]
    _refused(both, both)
    assert resolve(["--actor.compile"]).actor.compile


def test_context_parallelism_message_says_sequences_must_be_unpacked(cpu_only):
    _refused(["--fsdp.cp_size", "2", "--actor.num_ranks", "2"], ["unpacked"])


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
            ["--actor.num_ranks", "4", "--fsdp.tp_size", "2", "--fsdp.cp_size", "4"],
            ["--actor.num_ranks", "--fsdp.cp_size"],
            id="tp-cp",
        ),
        pytest.param(
            ["--actor.num_ranks", "4", "--fsdp.ep_size", "3"],
            ["--fsdp.ep_size", "--actor.num_ranks"],
            id="ep",
        ),
        pytest.param(["--fsdp.tp_size", "0"], ["--fsdp.tp_size"], id="zero-tp"),
        pytest.param(["--vllm.data_parallel_size", "0"], ["--vllm.data_parallel_size"], id="zero-dp"),
        pytest.param(["--actor.micro_batch_size", "0"], ["--actor.micro_batch_size"], id="micro-batch"),
        pytest.param(
            ["--ray.address", "10.0.0.1:6379", "--ray.num_cpus", "2"],
            ["--ray.num_cpus", "--ray.address"],
            id="ray-address-with-num-cpus",
        ),
    ],
)
def test_parallel_sizes_must_split_the_ranks(with_cuda, args, flags):
    _refused(args, flags)


def test_parallel_sizes_that_split_are_accepted_on_cuda(with_cuda):
    args = ["--actor.num_ranks", "8", "--fsdp.tp_size", "2", "--fsdp.cp_size", "2", "--fsdp.ep_size", "8"]
    config = resolve(args + ["--actor.freeze_moe_router", "--vllm.tensor_parallel_size", "4"])
    assert (config.fsdp.tp_size, config.fsdp.cp_size, config.fsdp.ep_size) == (2, 2, 8)


def test_routing_replay_is_accepted_on_cuda(with_cuda):
    assert resolve(["--train.routing_replay"]).train.routing_replay is True


def test_freezing_the_moe_router_freezes_every_gate_and_refuses_a_dense_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from molt._sharding import freeze_moe_routers

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    assert freeze_moe_routers(model) == 2
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".mlp.gate." in name for name in frozen)
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


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, 0), ({"num_experts": 128}, 128), ({"n_routed_experts": 256}, 256), ({"num_local_experts": 8}, 8)],
    ids=["dense", "qwen-moe", "deepseek", "mixtral"],
)
def test_num_experts_reads_each_family_key(fields, expected):
    assert num_experts(fields) == expected


def test_routing_replay_on_a_dense_model_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"--train\.routing_replay .*dense"):
        check_model(_config(train={"routing_replay": True}), tiny_model_dir)
    check_model(_config(train={"routing_replay": True}), _model(tmp_path, num_experts=8))


@pytest.mark.parametrize("key", ["num_experts", "n_routed_experts", "num_local_experts"])
def test_ep_size_must_divide_the_experts(tmp_path, key):
    model_dir = _model(tmp_path, **{key: 6})
    with pytest.raises(ConfigError, match=r"--fsdp\.ep_size 4 must divide the model's 6 experts"):
        check_model(_config(fsdp={"ep_size": 4}), model_dir)
    check_model(_config(fsdp={"ep_size": 3}), model_dir)


def test_ep_size_on_a_dense_model_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"--fsdp\.ep_size 2 .*0 experts"):
        check_model(_config(fsdp={"ep_size": 2}), tiny_model_dir)


@pytest.mark.parametrize(
    ("tp", "kv_heads", "refused"),
    [(2, 4, False), (3, 4, True), (8, 4, True), (32, 32, True)],
    ids=["divides", "not-heads", "not-kv-heads", "more-than-heads"],
)
def test_fsdp_tp_size_must_divide_heads_and_kv_heads(tmp_path, tp, kv_heads, refused):
    model_dir = _model(tmp_path, num_key_value_heads=kv_heads)
    config = _config(fsdp={"tp_size": tp})
    if not refused:
        check_model(config, model_dir)
        return
    with pytest.raises(
        ConfigError, match=rf"--fsdp\.tp_size {tp} must divide the model's 16 attention heads"
    ):
        check_model(config, model_dir)


def test_engine_tp_may_replicate_kv_heads_but_must_divide_heads(tmp_path):
    model_dir = _model(tmp_path, num_key_value_heads=4)
    check_model(_config(vllm={"tensor_parallel_size": 8}), model_dir)  # vLLM replicates KV heads
    with pytest.raises(ConfigError, match=r"--vllm\.tensor_parallel_size 6"):
        check_model(_config(vllm={"tensor_parallel_size": 6}), model_dir)
    check_model(_config(vllm={"tensor_parallel_size": 6, "urls": ["http://x"]}), model_dir)  # not ours


def test_gpus_needed_counts_actor_ranks_and_engine_gpus():
    config = _config(
        actor={"num_ranks": 4}, vllm={"num_engines": 2, "tensor_parallel_size": 2, "data_parallel_size": 2}
    )
    assert gpus_needed(config, on_gpu=True) == 4 + 2 * 2 * 2
    assert gpus_needed(config, on_gpu=False) == 0
    attached = _config(actor={"num_ranks": 4}, vllm={"num_engines": 2, "urls": ["http://x"]})
    assert gpus_needed(attached, on_gpu=True) == 4


def test_gpus_needed_counts_each_extra_group_like_the_policy():
    config = resolve(["--actor.num_ranks", "2", "--vllm.urls", "http://x", "--algo.kl.coef", "0.1",
                      "--algo.advantage.estimator", "gae"])  # fmt: skip
    assert gpus_needed(config, on_gpu=True) == 3 * 2  # policy, reference, critic
    with pytest.raises(ConfigError, match=r"\['policy', 'reference', 'critic'\]"):
        check_gpus(config, 4.0, on_gpu=True)


def test_a_teacher_or_critic_must_share_the_policys_tokenizer(tmp_path, tiny_model_dir):
    from molt.tiny import build_tiny_model

    flag = "--algo.teacher.model"
    check_tokenizer(flag, build_tiny_model(tmp_path / "sibling", seed=1), tiny_model_dir)  # other weights
    other = build_tiny_model(tmp_path / "other", words=("alpha", "beta"))
    with pytest.raises(ConfigError, match="--algo.teacher.model .* has another tokenizer"):
        check_tokenizer(flag, other, tiny_model_dir)
    with pytest.raises(ConfigError, match="--algo.critic.model .* not a Hugging Face model directory"):
        check_tokenizer("--algo.critic.model", tmp_path / "missing", tiny_model_dir)


def test_opd_refuses_a_kl_folded_into_the_reward_it_ignores():
    args = ["--algo.advantage.estimator", "opd", "--algo.teacher.model", "t", "--algo.kl.coef", "0.1"]
    resolve(args)  # a KL loss term is fine
    _refused([*args, "--algo.kl.in_reward", "true"], ["--algo.kl.in_reward", "opd"])


def test_more_gpus_than_ray_sees_is_refused():
    config = _config(actor={"num_ranks": 2}, vllm={"num_engines": 1, "tensor_parallel_size": 2})
    check_gpus(config, 4.0, on_gpu=True)
    with pytest.raises(ConfigError) as error:
        check_gpus(config, 3.0, on_gpu=True)
    for text in (
        "needs 4 GPUs",
        "Ray sees 3",
        "--actor.num_ranks",
        "--vllm.tensor_parallel_size",
        "--ray.address",
    ):
        assert text in str(error.value)
    check_gpus(config, 0.0, on_gpu=False)  # a CPU run takes no GPUs


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
    defaults = " ".join(engine_extra_args(Config()))
    assert "--enable-prefix-caching" in defaults and "--enforce-eager" not in defaults
    assert "--speculative-config" not in defaults and "--enable-expert-parallel" not in defaults


def test_engine_flags_on_cpu_keep_the_cpu_engine_single_process(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = engine_extra_args(_config(vllm={"max_num_batched_tokens": 512}))
    assert "--max-num-batched-tokens" in args and "--tensor-parallel-size" not in args
