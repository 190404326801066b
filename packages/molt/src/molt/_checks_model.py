"""The checks of `molt._validate.validate` that read the model: its shape (heads, key-value heads, experts,
a vision tower) against the parallel sizes and what a vision-language policy can run, LoRA's flags against
the projections they wrap and what vLLM serves, and a teacher's or critic's tokenizer against the policy's.
The other checks are `molt._checks`'. Every message names the flags and what to do.

Imports transformers only for a teacher or critic model, or to ask whether --actor.shared_prefix's model
packs.
"""

from __future__ import annotations

import json
from pathlib import Path

from molt._bounds import field_value
from molt._config_algo import estimator_needs
from molt._placement import plain_kv_layout
from molt.config import Config, ConfigError

# Where Hugging Face configs keep the number of routed experts: Qwen-MoE, DeepSeek, Mixtral.
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.26's --max-lora-rank choices (MaxLoRARanks)


def num_experts(model_config: dict) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    return next((int(model_config[key]) for key in _EXPERT_KEYS if model_config.get(key)), 0)


def why_not_packed(model_dir: str | Path) -> str | None:
    """Why the actor cannot pack the model at `model_dir` (`molt._packing.packing_refusal`), or None."""
    from transformers import AutoConfig

    from molt._packing import packing_refusal

    return packing_refusal(AutoConfig.from_pretrained(model_dir))


def check_model(config: Config, model_dir: str | Path) -> None:
    """Sizes that do not divide the model's heads or experts, router flags without experts, and what a
    vision-language policy cannot run. No --model.path: the seeded tiny model's shape (`molt.tiny`)."""
    # --actor.shared_prefix lays rows out in packed micro-batches (the tiny model packs).
    if config.actor.shared_prefix == "on" and model_dir and (refusal := why_not_packed(model_dir)):
        raise ConfigError(
            "--actor.shared_prefix on shares prefixes within packed micro-batches, and --model.path "
            f"{model_dir} cannot pack ({refusal}): use --actor.shared_prefix auto or off"
        )
    if model_dir:
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
    else:
        from molt.tiny import TINY_SHAPE

        model_dir, model_config = "(the tiny model)", dict(TINY_SHAPE)
    fsdp, algo = config.fsdp, config.algo
    if "vision_config" in model_config and fsdp.tp_size > 1:  # --fsdp.cp_size is 1 (`_check_machine`)
        raise ConfigError(
            f"--model.path {model_dir} is a vision-language model, whose actor runs data parallel only for "
            f"now: --fsdp.tp_size 1 (got {fsdp.tp_size})"
        )
    if "vision_config" in model_config and config.actor.lora.rank:
        raise ConfigError(
            f"--actor.lora.rank with --model.path {model_dir}, a vision-language model: the engines serve "
            "adapters on a language model only, and the target modules would wrap the vision tower too; "
            "LoRA runs on text models for now"
        )
    if "vision_config" in model_config and estimator_needs(algo.advantage.estimator).critic:
        raise ConfigError(
            f"--model.path {model_dir} is a vision-language model: the gae critic does not load one yet; "
            "pick an outcome estimator"
        )
    if config.vllm.kv_cache_tokens and not plain_kv_layout(model_config):
        raise ConfigError(
            f"--vllm.kv_cache_tokens with --model.path {model_dir}, whose layers do not all cache K and V "
            "per token (MLA, linear attention or sliding windows): size its engines with "
            "--vllm.gpu_memory_utilization instead"
        )
    model_config = model_config.get("text_config", model_config)  # a vision-language model's LLM
    experts = num_experts(model_config)
    # Both act on the routers `refit.RoutingReplay` finds, and it refuses a dense model once the actor loads.
    moe_flags = ("train.routing_replay", "actor.freeze_moe_router")
    if not experts and (routers := [flag for flag in moe_flags if field_value(config, flag)]):
        raise ConfigError(
            f"--{routers[0]} acts on MoE routers, but --model.path {model_dir} is dense (its config.json has "
            f"none of {', '.join(_EXPERT_KEYS)}): drop --{routers[0]}"
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
    _check_lora(config, model_dir, model_config, heads, kv_heads)
    tp = config.vllm.tensor_parallel_size
    if not config.vllm.urls and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        raise ConfigError(
            f"--vllm.tensor_parallel_size {tp} must divide the model's {heads} attention heads, and divide "
            f"or be a multiple of its {kv_heads} key-value heads (config.json of --model.path {model_dir})"
        )


def _check_lora(config: Config, model_dir: str | Path, model_config: dict, heads: int, kv_heads: int) -> None:
    """LoRA's flags are set only with a rank, there is no dropout (the ratio's policy must be the one that
    scored the old logprobs), the rank is below every wrapped projection's smaller side (else the adapter
    is no low-rank update and costs more than the weight) and within what vLLM serves, the refit is not a
    delta (it sends the adapter), and the model is dense: AutoModel's LinearLoRA and the export's merge
    cover linear layers, not grouped experts."""
    lora, default = config.actor.lora, Config().actor.lora
    if not lora.rank:
        fields = ("alpha", "target_modules", "dropout")
        if changed := [name for name in fields if getattr(lora, name) != getattr(default, name)]:
            raise ConfigError(
                f"--actor.lora.{changed[0]} is set but --actor.lora.rank is 0 (LoRA off): pass a rank, or "
                "drop it"
            )
        return
    if lora.dropout:
        raise ConfigError(
            f"--actor.lora.dropout {lora.dropout}: dropout in the loss's forward would train a randomly "
            "thinned policy, not the one that scored the old logprobs and sampled the tokens (the logprob "
            "passes and the engines run without it), so every ratio and correction weight would compare two "
            "different policies; pass --actor.lora.dropout 0 (regularise with --actor.weight_decay or a "
            "smaller --actor.lora.rank)"
        )
    if num_experts(model_config):
        raise ConfigError(
            f"--actor.lora.rank with --model.path {model_dir}, an MoE model: its experts' adapters would not "
            "be merged into the weights the engines serve; LoRA runs on dense models for now"
        )
    if lora.rank > LORA_RANKS[-1]:
        raise ConfigError(
            f"--actor.lora.rank {lora.rank} is above {LORA_RANKS[-1]}, the largest adapter rank vLLM serves "
            f"(--max-lora-rank): pass {LORA_RANKS[-1]} or less"
        )
    if config.refit.delta:
        raise ConfigError(
            "--refit.delta with --actor.lora.rank: a LoRA refit sends the adapters alone, whole (they are "
            "small); drop --refit.delta"
        )
    if not lora.target_modules:
        raise ConfigError(
            "--actor.lora.target_modules is empty: name at least one projection, or --actor.lora.rank 0"
        )
    hidden = int(model_config.get("hidden_size", 0))
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    # Every projection maps the hidden size to its own size (or back): the MLP's (gate, up, down) to the
    # intermediate size. A size the config does not state is 0 (unchecked).
    own = {"q_proj": heads, "o_proj": heads, "k_proj": kv_heads, "v_proj": kv_heads}
    intermediate = int(model_config.get("intermediate_size", 0))
    for name in lora.target_modules:
        side = own[name] * head_dim if name in own else intermediate
        smaller = min((size for size in (hidden, side) if size), default=0)
        if smaller and lora.rank >= smaller:
            raise ConfigError(
                f"--actor.lora.rank {lora.rank} does not fit {name}, whose smaller side is {smaller} "
                f"(config.json of --model.path {model_dir}): a rank-{smaller} update is the full weight; "
                "pass a rank below it"
            )


def check_companions(config: Config) -> None:
    """A teacher or critic reads the policy's token ids, so it must tokenize exactly as the policy does."""
    algo = config.algo
    needs, others = estimator_needs(algo.advantage.estimator), {}
    if needs.teacher:
        others["--algo.teacher.model"] = algo.teacher.model
    if needs.critic and algo.critic.model:
        others["--algo.critic.model"] = algo.critic.model
    if not others:
        return
    if not config.model.path:
        raise ConfigError(
            f"{', '.join(others)} needs --model.path: the seeded tiny policy has its own tokenizer, which no "
            "other model shares"
        )
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(config.model.path).get_vocab()
    for flag, path in others.items():
        if AutoTokenizer.from_pretrained(path).get_vocab() != policy:
            raise ConfigError(
                f"{flag} {path} has another tokenizer than the policy ({config.model.path}): it would read "
                "the policy's token ids as other tokens; pick a model of the policy's family"
            )
