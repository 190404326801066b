"""Launch guards that need more than the config: the model's `config.json`, and the GPUs Ray sees.

`molt.config.validate` refuses what the config alone decides; `check_launch` runs at the start of
`molt.loop.train`, once Ray is up and before any engine or actor starts, and refuses parallel sizes the
model cannot be split by, routing replay on a dense model, and more GPUs than the cluster has. Each
message names the flags. Reads JSON and asks Ray for its resources; loads no weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from molt.config import Config, ConfigError

__all__ = ["check_gpus", "check_launch", "check_model", "gpus_needed", "num_experts"]

# Where Hugging Face configs keep the number of routed experts: Qwen-MoE, DeepSeek, Mixtral.
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def num_experts(model_config: dict) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    return next((int(model_config[key]) for key in _EXPERT_KEYS if model_config.get(key)), 0)


def check_model(config: Config, model_dir: str | Path) -> None:
    """Refuse sizes that do not divide the model's heads or experts, and routing replay without experts."""
    path = Path(model_dir) / "config.json"
    model_config = json.loads(path.read_text())
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


def gpus_needed(config: Config, *, on_gpu: bool) -> int:
    """GPUs a run takes: one per actor rank, TP x DP per engine it starts; none on CPU."""
    if not on_gpu:
        return 0
    vllm = config.vllm
    engines = 0 if vllm.urls else vllm.num_engines
    return config.actor.num_ranks + engines * vllm.tensor_parallel_size * vllm.data_parallel_size


def check_gpus(config: Config, num_gpus: float, *, on_gpu: bool) -> None:
    """Refuse a run that asks for more GPUs than the cluster has (Ray would wait for them forever)."""
    needed = gpus_needed(config, on_gpu=on_gpu)
    if needed > num_gpus:
        vllm = config.vllm
        raise ConfigError(
            f"the run needs {needed} GPUs but Ray sees {num_gpus:g}: --actor.num_ranks "
            f"{config.actor.num_ranks} + --vllm.num_engines {vllm.num_engines} x --vllm.tensor_parallel_size "
            f"{vllm.tensor_parallel_size} x --vllm.data_parallel_size {vllm.data_parallel_size}; lower them, "
            "or join a larger cluster with --ray.address"
        )


def check_launch(config: Config, model_dir: str | Path) -> None:
    """Both guards, against the model directory and the running Ray (call after `ray.init`)."""
    import ray
    import torch

    check_model(config, model_dir)
    check_gpus(config, ray.cluster_resources().get("GPU", 0.0), on_gpu=torch.cuda.is_available())
