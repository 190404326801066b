"""The one validation pass of a molt run: `validate(config)` refuses, before anything starts, every config
that cannot run here or would train silently wrong, and fills the derived values.

It checks, in this order: every numeric field against the bound its type declares, and floats for NaN
and infinities (`molt._bounds`), the numbers tied to one another, the files and addresses the run reads,
the combinations of flags (asynchrony without importance correction, DESIGN invariant 2; a group baseline
over groups of one; a sampler the trainer does not reproduce, invariant 3), what this machine can run
(CUDA-only features, flags that would do nothing on a CPU, more GPUs than a local Ray has), the model's shape
against the parallel sizes, a teacher's or critic's tokenizer, and the agent module against the data
settings. Every message names the flags and what to do. The checks of each field's bound are
`molt._bounds`', those of the combinations of flags and of the files, addresses and agent module the config
names `molt._checks`', those that read the model `molt._checks_model`'s; this module holds the pass, what
this machine can run, and the GPUs.
`molt train` calls it once, as soon as its flags are read; `molt.train` (the Python API) calls it first
thing, so it gets the same guards; it is idempotent. The one check that needs Ray, a joined cluster's
GPUs, is `check_cluster_gpus`, called right after joining. `start_notes` lists what a run should say at
start about a config it accepts.

Imports torch only when a flag needs CUDA, and transformers only for a teacher or critic model.
"""

from __future__ import annotations

import functools

from molt._bounds import check_bounds, field_value, leaves
from molt._checks import check_agent, check_algorithm, check_pairs, check_paths, loss_denominator, on_policy
from molt._checks_model import check_companions, check_model, why_not_packed
from molt._config_algo import kl_kind
from molt._mps import check_mps
from molt._placement import (
    compiles,
    compute_dtype_name,
    engine_memory_utilization,
    engines_per_gpu,
    resolve_placement,
)
from molt.config import Config, ConfigError

# What needs CUDA, by flag, at a value other than its default: on a CPU each would do nothing (or cannot
# run), so it is refused rather than ignored.
_CUDA_ONLY = {
    "fsdp.offload": "it moves optimizer states to host memory, where a CPU actor's already are",
    "vllm.cuda_graphs": "the CPU engine always runs eager",
    "vllm.compile": "the CPU engine always runs eager",
    "vllm.gpu_memory_utilization": "it sizes an engine's share of GPU memory",
    "vllm.kv_cache_tokens": "it sizes a CUDA engine's KV cache (the CPU engine's is VLLM_CPU_KVCACHE_SPACE)",
    "vllm.placement": "it places engines and actor ranks on GPUs",
    "vllm.tensor_parallel_size": "the CPU engine runs one process",
    "vllm.data_parallel_size": "the CPU engine runs one process",
    "vllm.enable_expert_parallel": "the CPU engine runs one process",
    "vllm.mtp_num_speculative_tokens": "the CPU engine runs without speculative decoding",
    "fsdp.tp_size": "the CPU actor runs FSDP2 data parallelism only (TP needs AutoModel's CUDA loader)",
    "fsdp.ep_size": "the CPU actor runs FSDP2 data parallelism only (EP needs AutoModel's CUDA loader)",
    "train.routing_replay": "vLLM captures routed experts in its GPU model runner only (use "
    "--actor.freeze_moe_router on a CPU)",
    "vllm.mps": "MPS runs CUDA kernels of several processes side by side on one GPU",
}


@functools.cache
def _on_gpu() -> bool:
    import torch  # only once a flag asks: `molt train --print-config` stays free of torch otherwise

    return torch.cuda.is_available()


def _local_gpus() -> int:
    """The GPUs a local Ray would see: all of this machine's."""
    import torch

    return torch.cuda.device_count()


def validate(config: Config) -> Config:
    """The config with derived values filled; a refused one raises `ConfigError` naming its flags."""
    check_bounds(config)
    check_pairs(config)
    check_paths(config)
    config = on_policy(config)
    config = loss_denominator(config)
    check_algorithm(config)
    _check_machine(config)
    if _on_gpu() and not config.ray.address:  # a joined cluster's GPUs are counted once joined
        config = resolve_placement(config, _local_gpus())
    check_mps(config)
    check_model(config, config.model.path)
    check_companions(config)
    check_agent(config)
    return config


def _check_machine(config: Config) -> None:
    """What needs CUDA, context parallelism, and the GPUs a local Ray would have."""
    if config.fsdp.cp_size > 1:
        raise ConfigError(
            f"--fsdp.cp_size {config.fsdp.cp_size}: the actor does not split sequences over context-parallel "
            "ranks (each would train the whole row, scaling its gradient by cp_size; AutoModel splits them "
            "only with Transformer Engine attention); pass --fsdp.cp_size 1"
        )
    changed = [path for path, leaf in leaves().items() if field_value(config, path) != leaf.default]
    # Every --vllm.* flag but these configures the engines molt starts. --vllm.placement also places the
    # actor groups and picks the refit's path to attached engines (auto is decided with them, below).
    attached_too = ("vllm.urls", "vllm.max_model_len", "vllm.placement")
    engine_flags = [path for path in changed if path.startswith("vllm.") and path not in attached_too]
    if config.vllm.urls and engine_flags:  # attached engines were started with their own flags
        raise ConfigError(
            f"--{engine_flags[0]} configures engines molt starts; --vllm.urls attaches running ones: drop one"
        )
    if (path := next((flag for flag in _CUDA_ONLY if flag in changed), None)) and not _on_gpu():
        raise ConfigError(f"--{path} needs CUDA, and this machine has none: {_CUDA_ONLY[path]}; drop it")
    if config.actor.shared_prefix == "on" and not config.actor.pack:
        raise ConfigError(
            "--actor.shared_prefix on shares prefixes within packed micro-batches, and --actor.pack false "
            "pads them: drop one of the two"
        )
    if config.actor.shared_prefix == "on" and config.train.routing_replay:
        raise ConfigError(
            "--actor.shared_prefix on with --train.routing_replay: a shared prefix token is computed once, "
            "with one route, where the engine may have routed it differently in each row; drop one of the two"
        )
    if config.refit.delta and _on_gpu():
        raise ConfigError(
            "--refit.delta sends changed elements over the CPU (gloo) refit only; CUDA engines take full "
            "refits over NCCL for now: drop --refit.delta"
        )
    lora_in_float32 = config.actor.lora.rank and compute_dtype_name(config) == "float32"
    if lora_in_float32 and _on_gpu() and not config.vllm.urls:
        raise ConfigError(  # vLLM 0.26's Triton LoRA kernels assert a 16-bit weight
            "--actor.lora.rank with CUDA engines needs a 16-bit dtype: vLLM's LoRA kernels take bfloat16 "
            "or float16 only, and the engines would serve float32 (--model.dtype, --actor.compute_dtype): "
            "pass --actor.compute_dtype bfloat16 (float32 master weights stay) or --model.dtype bfloat16"
        )
    fsdp, ranks = config.fsdp, config.actor.num_ranks
    if ranks % fsdp.tp_size:  # --fsdp.cp_size is 1 (above)
        raise ConfigError(
            f"--actor.num_ranks {ranks} must be a multiple of --fsdp.tp_size {fsdp.tp_size}: the "
            "data-parallel size is num_ranks / tp_size"
        )
    if ranks % fsdp.ep_size:
        raise ConfigError(
            f"--fsdp.ep_size {fsdp.ep_size} must divide --actor.num_ranks {ranks}: expert-parallel groups "
            "are carved out of the actor's ranks"
        )
    budget, longest = config.actor.micro_batch_tokens, config.vllm.max_model_len
    if 0 < budget < longest:
        raise ConfigError(
            f"--actor.micro_batch_tokens {budget} is smaller than the longest row the run can produce, "
            f"--vllm.max_model_len {longest}: raise it to at least {longest} (or 0, sized from free memory)"
        )
    if config.actor.compile == "on" and not _on_gpu():
        raise ConfigError(
            "--actor.compile on needs CUDA, and this machine has none: the CPU actor trains in eager "
            "mode; drop it"
        )
    if config.actor.compile == "on" and config.actor.activation_checkpointing:
        raise ConfigError(
            "--actor.compile on with --actor.activation_checkpointing: AutoModel's checkpoint wrapper passes "
            "torch.utils.checkpoint a context that torch.compile refuses; drop one of the two"
        )
    if config.actor.compile == "on" and config.train.routing_replay:
        raise ConfigError(
            "--actor.compile on with --train.routing_replay: replay swaps each router's choice per call from "
            "Python hooks, which compiled layers are not tested to follow; drop one of the two"
        )


def check_cluster_gpus(config: Config) -> Config:
    """The config placed on the Ray cluster joined with --ray.address (call right after joining): its
    GPUs are counted there (`molt._placement`)."""
    import ray

    return resolve_placement(config, ray.cluster_resources().get("GPU", 0.0)) if _on_gpu() else config


def start_notes(config: Config) -> list[str]:
    """What a run should say at start about a config it accepts: settings that act differently from what
    their names suggest here."""
    notes = []
    if config.train.mini_batches == 1 and config.algo.loss.kind != "pg":
        notes.append(
            f"--algo.loss.kind {config.algo.loss.kind} with --train.mini_batches 1: each batch is one "
            "optimizer step, so the ratio to the old policy is 1 and the surrogate reduces to pg (the "
            "clip never binds); raise --train.mini_batches for a trust region"
        )
    kl = config.algo.kl
    if kl.coef and kl.in_reward and kl_kind(kl) != "k1":  # tests/rlestimators/..._kl_gradients.py
        notes.append(
            f"--algo.kl.kind {kl.kind} in the reward (--algo.kl.in_reward): a reward penalty reaches the "
            "policy through the score function, where only k1's expected gradient is that of KL(pi || ref); "
            f"{kl.kind}'s is second order in the log-ratio, so the penalty barely acts near the reference; "
            "pass --algo.kl.kind k1"
        )
    # The tiny default model packs.
    if config.actor.pack and config.model.path and (refusal := why_not_packed(config.model.path)):
        notes.append(f"the actor pads its micro-batches (--actor.pack): {refusal}")
    if config.actor.compile == "auto" and _on_gpu() and not compiles(config, on_gpu=True):
        why = (
            "--actor.activation_checkpointing" if config.actor.activation_checkpointing else "routing replay"
        )
        notes.append(f"the actor's layers run eager (--actor.compile auto): {why} does not combine with it")
    if config.actor.shared_prefix == "auto" and _on_gpu() and config.train.routing_replay:
        notes.append(
            "the actor shares no prefixes (--actor.shared_prefix auto): routing replay replays each "
            "row's own routes"
        )
    actor_dtype = compute_dtype_name(config)
    if actor_dtype != "float32" and not config.vllm.urls and not _on_gpu():
        notes.append(
            f"the actor computes in {actor_dtype} but the CPU engine samples in float32: "
            "their logprobs differ by the rounding (train/mismatch_kl shows it; the correction weighs it)"
        )
    if config.vllm.placement == "shared":
        share, engines = engine_memory_utilization(config), engines_per_gpu(config)
        refits = "LoRA adapter refits go over gloo" if config.actor.lora.rank else "refits go over CUDA IPC"
        who = "the engine takes" if engines == 1 else f"its {engines} engines take (evenly)"
        notes.append(
            f"the engine and the actor share one GPU (--vllm.placement shared): {who} {share:.0%} "
            f"of its memory (--vllm.gpu_memory_utilization), the actor the rest; {refits}"
        )
    return notes
