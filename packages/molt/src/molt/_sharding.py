"""How the actor's model is loaded and sharded over its ranks (NeMo AutoModel + FSDP2), and the
FSDP2 adjustments the actor's loss normalisation and optimizer need. Used by the policy worker and the
critic (`molt._actor`, `molt._critic`)."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from molt._lean import use_lean_modules
from molt._placement import compiles, compute_dtype_name
from molt.config import Config, LoRA


def replicas(config: Config) -> int:
    """Ranks that share one data-parallel coordinate, hence the same rows (module docstring)."""
    return config.fsdp.tp_size * config.fsdp.cp_size


def compute_dtype(config: Config) -> torch.dtype:
    """--actor.compute_dtype: the policy's forward/backward dtype, which is also the dtype its engines run
    and a refit sends (DESIGN invariant 3); by default the parameters' own dtype (--model.dtype)."""
    return getattr(torch, compute_dtype_name(config))


def distributed_settings(config: Config, world_size: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """The arguments of AutoModel's `DistributedSetup.build` for `--fsdp.*` over `world_size` ranks,
    computing in `dtype`: the FSDP2 strategy, the parallel sizes and activation checkpointing."""
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    # AutoModel's default policy computes in bf16; the trainer must compute in the dtype it is asked for
    # (invariant 3, and fp32 tests compare exactly), reducing gradients in fp32.
    strategy = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        # On CPU everything already lives in host memory: --fsdp.offload only matters on GPU.
        offload_policy=CPUOffloadPolicy() if config.fsdp.offload and on_gpu else None,
    )
    fsdp = config.fsdp
    sizes = ParallelismSizes(
        dp_size=world_size // replicas(config),
        tp_size=fsdp.tp_size,
        cp_size=fsdp.cp_size,
        ep_size=fsdp.ep_size,
    )
    return dict(
        strategy=strategy,
        parallelism_sizes=sizes,
        activation_checkpointing=config.actor.activation_checkpointing,
        world_size=world_size,
    )


def distributed_setup(config: Config, world_size: int, dtype: torch.dtype, on_gpu: bool):
    """AutoModel's FSDP2 setup over `world_size` ranks, computing in `dtype` (`distributed_settings`)."""
    from nemo_automodel.components.distributed.config import DistributedSetup

    return DistributedSetup.build(**distributed_settings(config, world_size, dtype, on_gpu))


def peft_config(lora: LoRA):
    """AutoModel's PEFT config for --actor.lora.*: an adapter on each named projection of every layer."""
    from nemo_automodel.components._peft.lora import PeftConfig

    return PeftConfig(
        target_modules=[f"*.{name}" for name in lora.target_modules],  # AutoModel matches full module paths
        dim=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        use_triton=False,  # its kernels need CUDA and the adapter's dtype to equal the input's
        # Its fused LoRA MLP would replace each MLP's forward on the instance, shadowing `molt._lean`'s
        # LeanMLP (the same silu recompute); LeanMLP calls the wrapped projections, so one MLP path runs.
        use_memory_efficient_lora=False,
    )


def adapter_config(lora: LoRA) -> dict:
    """PEFT's `adapter_config.json` of the --actor.lora.* adapters: what vLLM's LoRA loader reads, from a
    directory or with a refit (`refit.update_weights(lora=...)`), and what `molt export` writes."""
    return {
        "peft_type": "LORA",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": list(lora.target_modules),
        "lora_dropout": lora.dropout,
        "bias": "none",
    }


def load_model(
    model_dir: str, config: Config, world_size: int, device: torch.device, lora: LoRA | None = None
) -> torch.nn.Module:
    """The policy, sharded over the ranks: AutoModel's own loader on GPU (it needs CUDA), a transformers
    model parallelized by AutoModel on CPU (FACTS: both shard with `parallelize_model`). A model whose
    config has a vision tower (Qwen-VL) loads as an image-text-to-text model, the class that takes
    `pixel_values` (`TrainBatch.model_inputs`); AutoModelForCausalLM refuses its config.

    `lora` (a rank > 0): AutoModel's PEFT wraps the target projections before sharding (`LinearLoRA`:
    `weight` stays at its checkpoint name, `lora_A` / `lora_B` beside it) and freezes everything else."""
    from transformers import AutoConfig

    vision = hasattr(AutoConfig.from_pretrained(model_dir), "vision_config")
    dtype = getattr(torch, config.model.dtype)
    setup = distributed_setup(config, world_size, compute_dtype(config), on_gpu=device.type == "cuda")
    if device.type == "cuda":
        from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText

        # No Liger kernels: the trainer needs the logits themselves (chunked logprobs, entropy).
        loader = NeMoAutoModelForImageTextToText if vision else NeMoAutoModelForCausalLM
        model = loader.from_pretrained(
            model_dir,
            dtype=dtype,
            distributed_setup=setup,
            use_liger_kernel=False,
            peft_config=None if lora is None else peft_config(lora),
        )
    else:
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = loader.from_pretrained(model_dir, dtype=dtype)
        if lora is not None:  # as AutoModel's GPU loader does it: wrap and freeze, then shard
            from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules

            if not apply_lora_to_linear_modules(model, peft_config(lora)):
                raise ValueError(f"--actor.lora.target_modules {lora.target_modules}: none in {model_dir}")
        model = parallelize_model(model, setup.mesh_context)
    use_lean_modules(model, config)  # the same function in less memory (`molt._lean`)
    if world_size == 1 and (compute_dtype(config) != dtype or setup.strategy_config.offload_policy):
        shard_one_rank(model, setup.strategy_config, device)
    if device.type == "cuda":  # where the layers, or FlexAttention for shared prefixes, compile
        remember_dynamic_shapes(model.config)
    if compiles(config, on_gpu=device.type == "cuda"):
        compile_layers(model)
    return model


def remember_dynamic_shapes(model_config: Any) -> None:
    """Lets torch.compile keep, in its cache directory, which input sizes of each compiled function varied
    (Dynamo's profile-guided "automatic dynamic"), so the next run of the same model on this machine
    compiles each graph with dynamic shapes at once instead of a static graph first and a dynamic one at
    the second size: about half the graphs of the actor's warm-up (`PolicyWorker._warm_up`). Dynamo keeps
    that profile only under a job id (`torch.compiler.config.job_id`); this one names the model's
    architecture and sizes, so runs of the same model share it and another model's layers, the same code
    at other sizes, never read a size as varying that only varied between models."""
    described = {k: v for k, v in model_config.to_dict().items() if k not in ("_name_or_path", "dtype")}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()
    torch.compiler.config.job_id = f"molt-{digest[:16]}"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers (a vision-language model's language model's): a ModuleList, or a ModuleDict in
    AutoModel's MoE models."""
    causal_lm: Any = model  # transformers' or AutoModel's: its base model at `.model`
    layers = getattr(causal_lm.model, "language_model", causal_lm.model).layers
    return list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)


def compile_layers(model: torch.nn.Module) -> None:
    """--actor.compile: each decoder layer through torch.compile (`Module.compile`, torch's own in-place
    form: names and hooks stay).

    Only the layer's own computation is compiled: Dynamo skips FSDP2's hooks (gathering the weights,
    reducing the gradients; `torch._dynamo.config.skip_fsdp_hooks`), which run around it as before. The
    layers share one code object and, with their weights as inputs, one compiled graph; a new row length
    compiles again once, then shapes are dynamic.

    Inductor's mix-order reduction (on CUDA, the backward's norm-weight gradient fused with its row
    reduction) checks the size of a dynamic graph's first input against thresholds (rows x hidden at
    least 5 Mi elements, at least 4,096 rows) and keeps the answer as a guard, so a micro-batch on the
    other side compiled everything again: the warm-up's rows are short, a step's micro-batches long (a
    1.7B model on one H100 compiled again at 2,560 tokens in its first step). Its non-strict mode skips
    those checks, made for speed on small inputs, and with them the guards.
    """
    layers = decoder_layers(model)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(layers))
    for layer in layers:
        layer.compile(options={"triton.mix_order_reduction_non_strict_mode": True})


UNIT_BYTES = 256 * 2**20  # a one-rank FSDP unit's parameters in the compute dtype, at most (`shard_one_rank`)


def shard_one_rank(model: torch.nn.Module, strategy, device: torch.device) -> None:
    """FSDP2 over a one-rank mesh, in place: consecutive decoder layers grouped into units of at most
    `UNIT_BYTES` of parameters in the compute dtype (a larger layer is a unit alone), then the root.

    AutoModel leaves a one-rank model unsharded, and with it FSDP2's mixed precision and CPU offload:
    without this, --actor.compute_dtype and --fsdp.offload would do nothing on one device. The
    "all-gather" of one rank is a local copy that casts a unit's weights to the compute dtype; each
    unit's gradient is cast back to float32 after its backward. FSDP2 would cast a unit's weights
    again for its backward, and again at each micro-batch (on one H100, 0.05 s of a 2.6 s step of four
    16k-token micro-batches of a 1.7B model). Here a unit keeps its copy until the pass over a batch
    ends (`reshard_all`, called by `molt._rank.ModelRank`): the weights are cast once a pass, for a copy
    of the whole model in the compute dtype held through it (`holds_cast_weights`, which the token
    budget leaves room for). Offloaded, a unit holds its copy only while it runs.

    A unit's hooks cost host time whatever its size (on one H100 a 135M model's 30 one-layer units
    took 94 ms of a 180 ms step), and one rank has nothing to overlap them with, so small layers share
    a unit. A 135M model is one unit of layers, a 1.7B one units of two layers, an 8B one a unit per
    layer, as on several ranks. FSDP2 casts the floating inputs of a unit's first layer only; every
    layer casts its own (`_cast_inputs`), so each computes what it did as a unit alone (AutoModel's
    RoPE tables, float32, reach each layer in the compute dtype).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    mesh, mp_policy = init_device_mesh(device.type, (1,)), strategy.mp_policy
    policies = {"mp_policy": mp_policy, "offload_policy": strategy.offload_policy or OffloadPolicy()}
    itemsize = (mp_policy.param_dtype or next(model.parameters()).dtype).itemsize
    units: list[list[torch.nn.Module]] = []
    size = 0
    for layer in decoder_layers(model):
        layer_bytes = sum(p.numel() for p in layer.parameters()) * itemsize
        if not units or size + layer_bytes > UNIT_BYTES:
            units.append([])
            size = 0
        units[-1].append(layer)
        size += layer_bytes
    casts = mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs
    cast_inputs = functools.partial(_cast_inputs, mp_policy.param_dtype)
    hold = strategy.offload_policy is None
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=not hold, **policies)
        if casts:  # every layer, the first too (cast already: a no-op), so that all compile alike
            for layer in unit:
                layer.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    fully_shard(model, mesh=mesh, **policies)  # the root: embeddings, the final norm, the head
    model.set_reshard_after_backward(not hold)  # type: ignore[operator]  # an FSDPModule now


def holds_cast_weights(config: Config, world_size: int, on_gpu: bool) -> bool:
    """Whether a pass over a batch holds a copy of every weight in the compute dtype (`shard_one_rank`):
    one rank computing in another dtype than its parameters', not offloaded."""
    offloaded = config.fsdp.offload and on_gpu
    return world_size == 1 and compute_dtype(config) != getattr(torch, config.model.dtype) and not offloaded


def reshard_all(model: torch.nn.Module) -> None:
    """Drop the unsharded (cast) weights of every FSDP2 unit of `model` that holds them: a pass over a
    batch has ended (`shard_one_rank`). The optimizer steps the shards, so a copy held past a step would
    be stale."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch._dynamo.disable  # as FSDP2's own hooks: outside the compiled layer, not a graph of its own
def _cast_inputs(
    dtype: torch.dtype, module: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """A forward pre-hook: `args` and `kwargs` with their floating-point tensors in `dtype`, as FSDP2's
    mixed precision casts a unit's inputs, each a view: a unit's first layer gets the hidden states as
    a view (FSDP2's post-backward autograd function), and a compiled layer guards on whether an input
    is one, so layers given plain tensors built graphs of their own (the CPU's warm-up: 27 graphs for 24)."""
    from torch.utils._pytree import tree_map_only

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype).view(tensor.shape) if tensor.is_floating_point() else tensor

    return tree_map_only(torch.Tensor, cast, (args, kwargs))


def freeze_moe_routers(model: torch.nn.Module) -> None:
    """--actor.freeze_moe_router: no router (MoE gate) weight trains, so the experts a token is sent to
    move only through the rest of the model (the coarser alternative to routing replay). A dense model
    is refused."""
    import refit

    # transformers *TopKRouter or AutoModel Gate; RoutingReplay raises if there is none
    for router in refit.RoutingReplay(model).routers:
        router.requires_grad_(False)


def params_by_mesh(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters grouped by the device mesh their DTensor lives on (plain tensors: one group)."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            key = (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist())) if mesh is not None else ()
            groups.setdefault(key, []).append(param)
    return list(groups.values())


class ShardAdamW(torch.optim.AdamW):
    """torch's AdamW over the parameters' local shards: the same update, state and state dict, but its fused
    kernel gets each sharded (DTensor) parameter's local tensor, gradient and moments. AdamW is elementwise,
    so each rank's shard steps alone whatever the placement; given DTensors, each of the kernel's tensor
    lists goes through DTensor's dispatch one tensor at a time (on one H100 a 135M model's step: 8.3 ms
    given the DTensors, 2.9 ms given the shards; `bench/adamw_shards.py`). The moments stay DTensors, as
    checkpoints save them."""

    def _init_group(self, group, params, grads, *states):
        # torch's own: gathers the group's parameters with gradients and their state (made at first use)
        has_complex = super()._init_group(group, params, grads, *states)
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, _steps = states  # the steps are plain tensors already
        for tensors in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            tensors[:] = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]  # views, in place
        return has_complex


def sum_gradients_over_ranks(model: torch.nn.Module) -> None:
    """Make FSDP2 sum gradients over data-parallel ranks instead of averaging them.

    Each rank's loss is already divided by the GLOBAL token count, so the global gradient is the plain
    sum of the ranks' gradients; FSDP2's default divides it by the world size. Divide factor 1 undoes
    that; forcing a SUM collective keeps it a plain sum on gloo too, which lacks the PREMUL_SUM that
    factor 1 would otherwise select (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
    A one-rank model is not wrapped by AutoModel and has nothing to undo.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
