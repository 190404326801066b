"""Launch guards that need more than the config: the model's `config.json`, and the GPUs Ray sees.

`molt.config.validate` refuses what the config alone decides; `check_launch` runs at the start of
`molt.loop.train`, once Ray is up and before any engine or actor starts, and refuses parallel sizes the
model cannot be split by, routing replay on a dense model, a teacher with another tokenizer, and more
GPUs than the cluster has. Each message names the flags. Reads JSON and tokenizer files and asks Ray
for its resources; loads no weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from molt.config import Config, ConfigError

__all__ = [
    "check_gpus", "check_launch", "check_model", "check_parallelism", "check_tokenizer", "extra_groups",
    "gpus_needed", "num_experts",
]  # fmt: skip

# Where Hugging Face configs keep the number of routed experts: Qwen-MoE, DeepSeek, Mixtral.
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def num_experts(model_config: dict) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    return next((int(model_config[key]) for key in _EXPERT_KEYS if model_config.get(key)), 0)


def check_model(config: Config, model_dir: str | Path) -> None:
    """Refuse sizes that do not divide the model's heads or experts, and routing replay without experts."""
    path = Path(model_dir) / "config.json"
    model_config = json.loads(path.read_text())
    if "vision_config" in model_config:
        check_vision_language(config, model_dir)
    model_config = model_config.get("text_config", model_config)  # a vision-language model's LLM
    experts = num_experts(model_config)
    fsdp, vllm = config.fsdp, config.vllm
    if config.train.routing_replay and not experts:
        raise ConfigError(
            f"--train.routing_replay replays MoE routing, but --model.path {model_dir} is dense (its "
            f"config.json has none of {', '.join(_EXPERT_KEYS)}): drop --train.routing_replay"
        )
    if fsdp.ep_size > 1 and (not experts or experts % fsdp.ep_size):
        raise ConfigError(
            f"--fsdp.ep_size {fsdp.ep_size} must divide the model's {experts} experts (config.json of "
            f"--model.path {model_dir}): pick a divisor, or 1 for a dense model"
        )
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    if heads % fsdp.tp_size or kv_heads % fsdp.tp_size:
        raise ConfigError(
            f"--fsdp.tp_size {fsdp.tp_size} must divide the model's {heads} attention heads and {kv_heads} "
            f"key-value heads (config.json of --model.path {model_dir})"
        )
    tp = vllm.tensor_parallel_size
    if not config.vllm.urls and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        raise ConfigError(
            f"--vllm.tensor_parallel_size {tp} must divide the model's {heads} attention heads, and divide "
            f"or be a multiple of its {kv_heads} key-value heads (config.json of --model.path {model_dir})"
        )


def check_vision_language(config: Config, model_dir: str | Path) -> None:
    """What a vision-language policy cannot run yet: tensor and context parallelism (untested with a
    vision tower), and the PPO critic (its value model loads as a causal LM, which a vision-language
    model's config is not). Data parallelism works (`PolicyWorker._blank_image_column`)."""
    if config.fsdp.tp_size > 1 or config.fsdp.cp_size > 1:
        raise ConfigError(
            f"--model.path {model_dir} is a vision-language model, whose actor runs data parallel only for "
            f"now: --fsdp.tp_size 1 --fsdp.cp_size 1 (got {config.fsdp.tp_size}, {config.fsdp.cp_size})"
        )
    if config.algo.advantage.estimator == "gae":
        raise ConfigError(
            f"--model.path {model_dir} is a vision-language model: the gae critic does not load one yet; "
            "pick an outcome estimator"
        )


def extra_groups(config: Config) -> list[str]:
    """The optional groups a run starts beside the policy (each with --actor.num_ranks ranks)."""
    algo = config.algo
    wanted = {
        "reference": algo.kl.coef != 0,
        "critic": algo.advantage.estimator == "gae",
        "teacher": algo.advantage.estimator == "opd",
    }
    return [name for name, started in wanted.items() if started]


def gpus_needed(config: Config, *, on_gpu: bool) -> int:
    """GPUs a run takes: one per rank of the policy and of each extra group, TP x DP per engine it
    starts; none on CPU."""
    if not on_gpu:
        return 0
    vllm = config.vllm
    engines = 0 if vllm.urls else vllm.num_engines
    groups = 1 + len(extra_groups(config))
    return groups * config.actor.num_ranks + engines * vllm.tensor_parallel_size * vllm.data_parallel_size


def check_gpus(config: Config, num_gpus: float, *, on_gpu: bool) -> None:
    """Refuse a run that asks for more GPUs than the cluster has (Ray would wait for them forever)."""
    needed = gpus_needed(config, on_gpu=on_gpu)
    if needed > num_gpus:
        vllm = config.vllm
        raise ConfigError(
            f"the run needs {needed} GPUs but Ray sees {num_gpus:g}: --actor.num_ranks "
            f"{config.actor.num_ranks} x the groups {['policy', *extra_groups(config)]} "
            f"+ --vllm.num_engines {vllm.num_engines} x --vllm.tensor_parallel_size "
            f"{vllm.tensor_parallel_size} x --vllm.data_parallel_size {vllm.data_parallel_size}; lower them, "
            "or join a larger cluster with --ray.address"
        )


def check_launch(config: Config, model_dir: str | Path) -> None:
    """The guards, against the model (and teacher) directory and the running Ray (call after `ray.init`)."""
    import ray
    import torch

    check_model(config, model_dir)
    algo = config.algo
    if algo.advantage.estimator == "opd":
        check_tokenizer("--algo.teacher.model", algo.teacher.model, model_dir)
    if algo.advantage.estimator == "gae" and algo.critic.model:
        check_tokenizer("--algo.critic.model", algo.critic.model, model_dir)
    check_gpus(config, ray.cluster_resources().get("GPU", 0.0), on_gpu=torch.cuda.is_available())


def check_parallelism(config: Config, num_ranks: int, *, on_gpu: bool) -> None:
    """The actor's parallel sizes against its ranks and device (the worker and the group both check)."""
    fsdp = config.fsdp
    if fsdp.cp_size > 1:
        raise ValueError(
            f"--fsdp.cp_size {fsdp.cp_size}: the actor does not split sequences over context-parallel ranks "
            "yet (each would train the whole row, scaling its gradient by cp_size; AutoModel 0.7 splits them "
            "only with Transformer Engine attention); pass --fsdp.cp_size 1"
        )
    if not on_gpu and (fsdp.tp_size, fsdp.ep_size) != (1, 1):
        raise ValueError(
            f"the CPU actor runs FSDP2 data parallelism only; got --fsdp.tp_size {fsdp.tp_size} "
            f"--fsdp.ep_size {fsdp.ep_size}: pass 1 for each (tensor and expert parallelism go through "
            "AutoModel's CUDA loader)"
        )
    if num_ranks % (fsdp.tp_size * fsdp.cp_size) or num_ranks % fsdp.ep_size:
        raise ValueError(
            f"{num_ranks} actor ranks do not split into --fsdp.tp_size {fsdp.tp_size} x --fsdp.cp_size "
            f"{fsdp.cp_size} x data parallel, or into --fsdp.ep_size {fsdp.ep_size} expert groups"
        )


def check_tokenizer(flag: str, other_dir: str | Path, model_dir: str | Path) -> None:
    """A teacher or critic reads the policy's token ids, so it must tokenize exactly as the policy does."""
    from transformers import AutoTokenizer

    if not (Path(other_dir) / "config.json").is_file():
        raise ConfigError(f"{flag} {other_dir} is not a Hugging Face model directory (no config.json)")
    other, policy = (AutoTokenizer.from_pretrained(path) for path in (other_dir, model_dir))
    if other.get_vocab() != policy.get_vocab():
        raise ConfigError(
            f"{flag} {other_dir} has another tokenizer than the policy ({model_dir}): it would read the "
            "policy's token ids as other tokens; pick a model of the policy's family"
        )
