"""How the actor's model is loaded and sharded over its ranks (NeMo AutoModel + FSDP2), and the
FSDP2 adjustments the actor's loss normalisation and optimizer need. Used by the policy worker and the
critic (`molt._actor`, `molt._critic`)."""

from __future__ import annotations

import functools

import torch

from molt.config import Config

__all__ = [
    "compute_dtype", "distributed_setup", "freeze_moe_routers", "load_model", "logprob_head",
    "compile_layers", "params_by_mesh", "replicas", "sum_gradients_over_ranks", "use_lean_mlps",
    "use_lean_rms_norms",
]  # fmt: skip


def replicas(config: Config) -> int:
    """Ranks that share one data-parallel coordinate, hence the same rows (module docstring)."""
    return config.fsdp.tp_size * config.fsdp.cp_size


def compute_dtype(config: Config) -> torch.dtype:
    """--actor.compute_dtype: the policy's forward/backward dtype, which is also the dtype its engines run
    and a refit sends (DESIGN invariant 3); by default the parameters' own dtype (--model.dtype)."""
    name = config.actor.compute_dtype
    return getattr(torch, config.model.dtype if name == "model" else name)


def distributed_setup(config: Config, world_size: int, dtype: torch.dtype, on_gpu: bool):
    """AutoModel's FSDP2 setup over `world_size` ranks, computing in `dtype`."""
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
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
    return DistributedSetup.build(
        strategy=strategy,
        parallelism_sizes=sizes,
        activation_checkpointing=config.actor.activation_checkpointing,
        world_size=world_size,
    )


def load_model(model_dir: str, config: Config, world_size: int, device: torch.device) -> torch.nn.Module:
    """The policy, sharded over the ranks: AutoModel's own loader on GPU (it needs CUDA), a transformers
    model parallelized by AutoModel on CPU (FACTS: both shard with `parallelize_model`). A model whose
    config has a vision tower (Qwen-VL) loads as an image-text-to-text model, the class that takes
    `pixel_values` (`TrainBatch.model_inputs`); AutoModelForCausalLM refuses its config."""
    from transformers import AutoConfig

    vision = hasattr(AutoConfig.from_pretrained(model_dir), "vision_config")
    dtype = getattr(torch, config.model.dtype)
    setup = distributed_setup(config, world_size, compute_dtype(config), on_gpu=device.type == "cuda")
    if device.type == "cuda":
        from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText

        # No Liger kernels: the trainer needs the logits themselves (chunked logprobs, entropy).
        loader = NeMoAutoModelForImageTextToText if vision else NeMoAutoModelForCausalLM
        model = loader.from_pretrained(
            model_dir, dtype=dtype, distributed_setup=setup, use_liger_kernel=False
        )
    else:
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = loader.from_pretrained(model_dir, dtype=dtype)
        model = parallelize_model(model, setup.mesh_context)
    use_lean_rms_norms(model)
    if config.fsdp.tp_size == 1:  # under TP the projections' outputs may be DTensors: left as they are
        use_lean_mlps(model)
    if world_size == 1 and (compute_dtype(config) != dtype or setup.strategy_config.offload_policy):
        shard_one_rank(model, setup.strategy_config, device)
    if config.actor.compile:
        compile_layers(model)
    return model


def use_lean_rms_norms(model: torch.nn.Module) -> int:
    """Run transformers' RMSNorm layers through AutoModel's float32 RMSNorm op; returns how many.

    Same function, less memory: transformers' RMSNorm keeps a float32 copy of its input for the
    backward pass, AutoModel's op keeps the input in its own dtype and recomputes the rest (at 16k
    tokens on a Qwen3-1.7B, about 12 GiB of activations). It also rounds once, after the weight, as
    vLLM's fused RMSNorm does. AutoModel's own model classes already use the op.
    """
    import nemo_automodel.components.models.common.utils  # noqa: F401 (registers the op)

    def lean_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.nemo_automodel.float32_rms_norm(x, norm.weight, norm.variance_epsilon)

    norms = [
        m for m in model.modules() if hasattr(m, "variance_epsilon") and type(m).__name__.endswith("RMSNorm")
    ]
    for norm in norms:
        norm.forward = functools.partial(lean_forward, norm)
    return len(norms)


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up for the backward and recomputing silu(gate) there."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * torch.nn.functional.silu(gate)
        return torch.ops.aten.silu_backward(grad * up, gate), grad_up


def use_lean_mlps(model: torch.nn.Module) -> int:
    """Run SwiGLU MLPs (`down(silu(gate(x)) * up(x))`, transformers' Qwen/Llama MLP) through one autograd
    function that keeps only silu's input and recomputes silu in the backward; returns how many.

    Same numbers (the same ops, rounded the same way), less memory: autograd would also keep silu's
    output for the product's backward, one [tokens, intermediate] tensor per layer (at 16k tokens on a
    Qwen3-1.7B, 192 MiB a layer, 5.3 GiB in all), for one more elementwise pass in the backward.
    """
    mlps = [
        m for m in model.modules()
        if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj"))
        and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    ]  # fmt: skip

    def lean_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(_SiluMul.apply(mlp.gate_proj(x), mlp.up_proj(x)))

    for mlp in mlps:
        mlp.forward = functools.partial(lean_forward, mlp)
    return len(mlps)


def logprob_head(model: torch.nn.Module, config: Config) -> dict | None:
    """Make the policy's LM head give token logprobs and entropies instead of logits; returns its request.

    While `request["next_tokens_BT"]` is set, the head maps the final hidden states [B, T, H] to [B, T, 1],
    log p(next token) at each position at the sampling temperature, and leaves the entropy there [B, T] in
    `request["entropy_BT"]` (apart, so that a detached entropy sends no gradient back), both through
    `rlestimators.lm_head_logprobs`: the [B, T, V] logits and their gradient never exist (at 16k tokens
    and a 152k vocabulary, 2 x 4.6 GiB in bf16). Without it the head gives logits as before. It runs inside
    the head's own call, where FSDP2 has gathered its weight (tied embeddings included). Not installed
    (None) under tensor parallelism, whose plans shard the head over the vocabulary, or for a head that is
    not a bias-free linear layer.
    """
    from rlestimators import lm_head_logprobs

    head = model.get_output_embeddings()
    if config.fsdp.tp_size > 1 or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    request: dict[str, torch.Tensor] = {}
    logits_forward, temperature = head.forward, config.rollout.temperature

    def forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
        if "next_tokens_BT" not in request:
            return logits_forward(hidden_BTH)
        logp_BT, request["entropy_BT"] = lm_head_logprobs(
            hidden_BTH, head.weight, request["next_tokens_BT"], temperature=temperature
        )
        return logp_BT[..., None].clone()  # not a view: FSDP2 refuses a root output that is one

    head.forward = forward
    return request


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: a ModuleList, or a ModuleDict in AutoModel's MoE models."""
    layers = model.model.layers
    return list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)


def compile_layers(model: torch.nn.Module) -> int:
    """--actor.compile: each decoder layer's forward through torch.compile; returns how many.

    Only the layer's own computation is compiled: FSDP2's hooks (gathering the weights, reducing the
    gradients) run around it as before. The layers share one code object and, with their weights as
    inputs, one compiled graph; a new row length compiles again once, then shapes are dynamic.
    """
    layers = decoder_layers(model)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(layers))
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)


def shard_one_rank(model: torch.nn.Module, strategy, device: torch.device) -> None:
    """FSDP2 over a one-rank mesh, one unit per decoder layer plus the root, in place.

    AutoModel leaves a one-rank model unsharded, and with it FSDP2's mixed precision and CPU offload:
    without this, --actor.compute_dtype and --fsdp.offload would do nothing on one device. The
    "all-gather" of one rank is a local copy that casts a layer's weights to the compute dtype just
    before its forward (and again before its backward); each layer's gradient is cast back to float32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    policies = {"mp_policy": strategy.mp_policy, "offload_policy": strategy.offload_policy or OffloadPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **policies)
    fully_shard(model, mesh=mesh, **policies)


def freeze_moe_routers(model: torch.nn.Module) -> int:
    """--actor.freeze_moe_router: no router (MoE gate) weight trains, so the experts a token is sent to
    move only through the rest of the model (the coarser alternative to routing replay). Returns the
    number of routers; a dense model is refused."""
    import refit

    routers = refit.RoutingReplay(model).routers  # transformers *TopKRouter or AutoModel Gate; raises if none
    for router in routers:
        router.requires_grad_(False)
    return len(routers)


def params_by_mesh(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters grouped by the device mesh their DTensor lives on (plain tensors: one group)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            key = (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist())) if mesh is not None else ()
            groups.setdefault(key, []).append(param)
    return list(groups.values())


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
