"""Where a run's processes sit on GPUs, and the refit path each layout takes (`--vllm.placement`).

- separate: every actor rank (of the policy and of each extra group) takes a GPU of its own, every engine
  TP x DP; the refit goes over NCCL (refit's `refit_nccl`: vLLM's NCCL weight transfer, every bucket
  checked). The paper's disaggregated layout.
- shared: one GPU holds the engine and every actor group, one process each. The engine takes
  `--vllm.gpu_memory_utilization` of the GPU's memory (0.4 unless set); the actor groups use the rest.
  `--vllm.num_engines` engines split that share and the sequences in flight evenly (each its own server:
  more API server processes, for agents whose requests one server's Python cannot keep up with).
  Where vLLM sizes its KV cache from the memory it finds free, the engine starts first
  (`engine_starts_first`); where the run gives the cache's size (`kv_cache_bytes`), both start side by
  side. The refit hands the engine CUDA IPC handles of the trainer's bucket buffers (refit's `refit_ipc`:
  vLLM's CUDA IPC weight transfer, every bucket checked): NCCL refuses two ranks on one device.
- auto: shared when a local Ray would have fewer GPUs than separate needs and the run fits on one GPU
  with one engine; separate otherwise (and always on a joined cluster, whose GPUs are counted once joined).

A CPU run has no placement (gloo refit, `placement` stays auto). This module refuses layouts that cannot
run: a shared GPU holds one actor rank and single-GPU engines.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from molt._checks import groups_in_flight
from molt._config_algo import estimator_needs
from molt.config import Config, ConfigError


def extra_groups(config: Config) -> list[str]:
    """The optional groups a run starts beside the policy (each with --actor.num_ranks ranks)."""
    algo = config.algo
    needs = estimator_needs(algo.advantage.estimator)
    wanted = {"reference": algo.kl.coef != 0, "critic": needs.critic, "teacher": needs.teacher}
    return [name for name, started in wanted.items() if started]


def gpus_needed(config: Config) -> int:
    """GPUs a separate layout takes: one per rank of the policy and of each extra group, TP x DP per
    engine it starts."""
    vllm = config.vllm
    engine_gpus = 0 if vllm.urls else vllm.num_engines * vllm.tensor_parallel_size * vllm.data_parallel_size
    return (1 + len(extra_groups(config))) * config.actor.num_ranks + engine_gpus


def _fits_one_gpu(config: Config) -> str:
    """Why the run cannot share one GPU (empty: it can)."""
    vllm = config.vllm
    if config.actor.num_ranks > 1:
        return f"--actor.num_ranks {config.actor.num_ranks} (a shared GPU holds one actor rank)"
    if not vllm.urls and vllm.tensor_parallel_size * vllm.data_parallel_size > 1:
        return "an engine over more than one GPU (--vllm.tensor_parallel_size x data_parallel_size)"
    return ""


def resolve_placement(config: Config, num_gpus: float) -> Config:
    """The config with `--vllm.placement auto` decided for a Ray with `num_gpus` GPUs; refuses a layout
    that does not fit them. Call on a CUDA machine only."""
    placement, needed, why = config.vllm.placement, gpus_needed(config), _fits_one_gpu(config)
    if placement == "auto":  # several engines share a GPU only when asked (--vllm.placement shared)
        one_engine = config.vllm.num_engines == 1
        placement = "shared" if needed > num_gpus and num_gpus >= 1 and not why and one_engine else "separate"
    if placement == "shared" and why:
        raise ConfigError(
            f"--vllm.placement shared puts the engine and the actor on one GPU; {why}: lower it"
        )
    if placement == "shared" and num_gpus < 1:
        raise ConfigError(f"--vllm.placement shared needs a GPU, and Ray sees {num_gpus:g}")
    if placement == "separate" and needed > num_gpus:  # Ray would wait for the GPUs forever
        vllm = config.vllm
        raise ConfigError(
            f"the run needs {needed} GPUs but Ray sees {num_gpus:g}: --actor.num_ranks "
            f"{config.actor.num_ranks} x the groups {['policy', *extra_groups(config)]} "
            f"+ --vllm.num_engines {vllm.num_engines} x --vllm.tensor_parallel_size "
            f"{vllm.tensor_parallel_size} x --vllm.data_parallel_size {vllm.data_parallel_size}; lower them, "
            "join a larger cluster with --ray.address, or (one actor rank, single-GPU engines) share one "
            "GPU with --vllm.placement shared"
        )
    return msgspec.structs.replace(config, vllm=msgspec.structs.replace(config.vllm, placement=placement))


def gpu_share(config: Config) -> float:
    """What one actor rank asks Ray for: a whole GPU (separate), or its part of the shared one."""
    if config.vllm.placement != "shared":
        return 1.0
    processes = 1 + len(extra_groups(config)) + (0 if config.vllm.urls else config.vllm.num_engines)
    return math.floor(1e4 / processes) / 1e4  # Ray counts GPU fractions in steps of 1e-4


def engine_gpus(config: Config) -> float:
    """What one engine asks Ray for."""
    if config.vllm.placement == "shared":
        return gpu_share(config)
    return config.vllm.tensor_parallel_size * config.vllm.data_parallel_size


def engine_memory_utilization(config: Config) -> float:
    """--vllm.gpu_memory_utilization, or the layout's default (a shared GPU leaves the actors the rest)."""
    chosen, shared = config.vllm.gpu_memory_utilization, config.vllm.placement == "shared"
    return chosen if chosen is not None else (0.4 if shared else 0.8)


def engines_per_gpu(config: Config) -> int:
    """The engines on one GPU: --vllm.num_engines on a shared GPU, else one (TP x DP GPUs each)."""
    shared = config.vllm.placement == "shared" and not config.vllm.urls
    return config.vllm.num_engines if shared else 1


def engine_memory_share(config: Config) -> float:
    """Each engine's `--gpu-memory-utilization`: the engines' share of their GPU, split between them."""
    return engine_memory_utilization(config) / engines_per_gpu(config)


def actor_free_bytes(config: Config, *, free: int, total: int, held: int) -> int:
    """The GPU memory one actor rank may still take (its token budget is sized from it): what is free, and
    on a shared GPU no more than its group's part of what the engine leaves (the rest of `total` after the
    engine's share, split evenly between the actor groups) less the `held` bytes it has already. The engine
    may still be starting beside it, its share not yet taken: free memory alone would hand the actor that
    share too (on an 80 GB GPU the actor grew to 48.5 GiB and the engine's next refit ran out of memory)."""
    if config.vllm.placement != "shared":
        return free
    part = (1 - engine_memory_utilization(config)) * total / (1 + len(extra_groups(config)))
    return int(min(free, part - held))


def plain_kv_layout(model_config: dict) -> bool:
    """Whether every layer caches K and V per token (no MLA, linear attention or sliding windows)."""
    model_config = model_config.get("text_config", model_config)
    kinds = set(model_config.get("layer_types") or ["full_attention"])
    return "kv_lora_rank" not in model_config and kinds == {"full_attention"}


def kv_bytes_per_token(model_config: dict, tp_size: int, dtype_bytes: int) -> int | None:
    """KV cache bytes one token takes on one engine GPU (K and V of every layer, its share of the key-value
    heads); None for a layout that caches otherwise (MLA, linear attention, sliding windows)."""
    if not plain_kv_layout(model_config):
        return None
    model_config = model_config.get("text_config", model_config)  # a vision-language model's LLM
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    return 2 * model_config["num_hidden_layers"] * math.ceil(kv_heads / tp_size) * head_dim * dtype_bytes


def sequences_in_flight(config: Config) -> int:
    """The most sequences the engines serve at once: every group the pool keeps in flight
    (--rollout.queue_depth), each of --rollout.group_size samples, and an evaluation's beside them."""
    evaluated = config.eval.num_prompts * config.eval.n if config.eval.every else 0
    return groups_in_flight(config) * config.rollout.group_size + evaluated


def sequences_per_engine(config: Config) -> int:
    """The sequences one engine serves at once: all in flight, split between the engines of a shared GPU
    (tito sends each new session to the least busy engine)."""
    return math.ceil(sequences_in_flight(config) / engines_per_gpu(config))


def engine_max_num_seqs(config: Config) -> int | None:
    """`--max-num-seqs` of a CUDA engine: the sequences it serves at once where they are fewer than
    vLLM's smallest default (256; 1024 on a large GPU), so that it captures CUDA graphs at start-up for
    the batches it can get (up to twice this, at most 512), not for 512; None keeps vLLM's default, which
    neither lowers the engine's batches below what is in flight nor raises them past its batch budget."""
    in_flight = sequences_per_engine(config)
    return in_flight if in_flight < 256 else None


def kv_cache_bytes(config: Config, model_dir: Path, gpu_bytes: int) -> int | None:
    """`--kv-cache-memory-bytes` for each engine GPU of `gpu_bytes` memory: --vllm.kv_cache_tokens, or the
    tokens every sequence in flight can take (a partly filled 16-token block each) where that fits beside
    the weights in the engine's memory share; on a shared GPU, else, what fits (about the cache vLLM would
    size from its share, and given, the actor starts beside the engine: `engine_starts_first`); None
    leaves the sizing to vLLM (--gpu-memory-utilization)."""
    vllm = config.vllm
    model_config = json.loads((model_dir / "config.json").read_text())
    dtype_bytes = 4 if compute_dtype_name(config) == "float32" else 2
    per_token = kv_bytes_per_token(model_config, vllm.tensor_parallel_size, dtype_bytes)
    if per_token is None:
        return None
    if vllm.kv_cache_tokens:
        return vllm.kv_cache_tokens * per_token
    wanted = sequences_per_engine(config) * (vllm.max_model_len + 16) * per_token
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) // vllm.tensor_parallel_size
    room = engine_memory_share(config) * gpu_bytes - weights - 4 * 2**30  # activations, graphs
    if wanted <= room:
        return wanted
    fits_a_sequence = room >= (vllm.max_model_len + 16) * per_token
    return int(room) if vllm.placement == "shared" and fits_a_sequence else None


def engine_starts_first(config: Config, model_dir: Path) -> bool:
    """Whether a shared GPU's engine must be up before the actor groups start: where vLLM sizes its KV cache
    from the memory it finds free (no `kv_cache_bytes`), memory the actors took meanwhile would be counted
    as the engine's. Given the cache's size, vLLM only checks at its start that its share of the GPU is
    free, which the actors' weights leave wherever the run fits, and the two start side by side."""
    if config.vllm.placement != "shared":
        return False
    import torch

    return kv_cache_bytes(config, model_dir, torch.cuda.get_device_properties(0).total_memory) is None


def compute_dtype_name(config: Config) -> str:
    """The dtype the actor computes in, its engines serve and a refit sends: --actor.compute_dtype, or
    --model.dtype where that is `model`."""
    name = config.actor.compute_dtype
    return config.model.dtype if name == "model" else name


def compiles(config: Config, *, on_gpu: bool) -> bool:
    """Whether the actor compiles its decoder layers: --actor.compile on, or auto on CUDA without
    activation checkpointing or routing replay (which compiled layers do not combine with)."""
    actor = config.actor
    auto = on_gpu and not actor.activation_checkpointing and not config.train.routing_replay
    return actor.compile == "on" or (actor.compile == "auto" and auto)


def shares_prefixes(config: Config, *, on_gpu: bool) -> bool:
    """Whether the actor shares prefixes (a model that cannot pack aside): --actor.shared_prefix on, or
    auto on CUDA with packed micro-batches and without routing replay (one route per shared token)."""
    actor = config.actor
    auto = on_gpu and actor.pack and not config.train.routing_replay
    return actor.shared_prefix == "on" or (actor.shared_prefix == "auto" and auto)


def refit_backend(config: Config, *, on_gpu: bool) -> str:
    """The weight-transfer backend of the run's engines: CUDA IPC on a shared GPU, NCCL on separate ones,
    refit's gloo backend on a CPU and for LoRA adapters (a few MiB, which only refit_gloo swaps in)."""
    import refit

    if not on_gpu or config.actor.lora.rank:
        return refit.GLOO_BACKEND
    return refit.IPC_BACKEND if config.vllm.placement == "shared" else refit.NCCL_BACKEND
