"""--actor.compute_dtype: float32 master weights with bf16 compute, on one rank as on many.

The worker runs in this process on gloo (one rank, no Ray), as the GPU test runs it on NCCL.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from molt._batch import collate
from molt._sharding import compute_dtype
from molt.config import Actor, Config, Model
from molt.vllm_server import free_port

# Importing AutoModel in this process: megatron_fsdp warns that neither Transformer Engine nor Apex is
# installed, and some module of it still uses torch.jit.script_method.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def _config(model_dtype: str = "float32", compute: str = "model") -> Config:
    return msgspec.structs.replace(
        Config(), model=Model(dtype=model_dtype), actor=Actor(lr=1e-2, compute_dtype=compute)
    )


@pytest.mark.parametrize(
    ("model_dtype", "compute", "expected"),
    [
        pytest.param("float32", "model", torch.float32, id="default-float32"),
        pytest.param("bfloat16", "model", torch.bfloat16, id="default-bfloat16"),
        pytest.param("float32", "bfloat16", torch.bfloat16, id="fp32-master-bf16-compute"),
    ],
)
def test_compute_dtype_defaults_to_the_parameters_dtype(model_dtype, compute, expected):
    assert compute_dtype(_config(model_dtype, compute)) == expected


def test_cuda_engines_run_the_trainers_compute_dtype(monkeypatch):
    from molt._engines import engine_extra_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = engine_extra_args(_config("float32", "bfloat16"))
    assert args[args.index("--dtype") + 1] == "bfloat16"
    args = engine_extra_args(_config("float32"))
    assert args[args.index("--dtype") + 1] == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--dtype" not in engine_extra_args(_config("float32", "bfloat16"))  # the CPU engine: float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rms_norms_compute_what_transformers_computes(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from molt._lean import use_lean_rms_norms

    torch.manual_seed(0)
    norms = [Qwen3RMSNorm(64, eps=1e-6) for _ in range(2)]
    norms[0].weight.data.uniform_(0.5, 1.5)
    norms[1].load_state_dict(norms[0].state_dict())
    assert use_lean_rms_norms(torch.nn.Sequential(norms[1])) == 1
    x = torch.randn(3, 5, 64, dtype=dtype)
    outs, grads = [], []
    for norm in norms:
        x_ = x.clone().requires_grad_()
        out = norm.to(dtype)(x_)
        out.pow(2).sum().backward()
        outs.append(out)
        grads.append((x_.grad, norm.weight.grad))
    assert outs[1].dtype == dtype
    # bf16: transformers rounds the normalised input before the weight, the op rounds once after it.
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(outs[1], outs[0], **tolerance)
    for lean, reference in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(lean.float(), reference.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_mlps_compute_what_transformers_computes_and_keep_less(dtype):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from molt._lean import use_lean_mlps

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=16, intermediate_size=48, hidden_act="silu")
    mlps = [Qwen3MLP(config).to(dtype) for _ in range(2)]
    mlps[1].load_state_dict(mlps[0].state_dict())
    assert use_lean_mlps(torch.nn.Sequential(mlps[1])) == 1
    x = torch.randn(3, 5, 16, dtype=dtype)
    outs, grads, saved = [], [], []
    for mlp in mlps:
        x_ = x.clone().requires_grad_()
        kept: list[int] = []  # the bytes autograd keeps for the backward

        def keep(tensor: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            kept.append(tensor.nbytes)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = mlp(x_)
        out.pow(2).sum().backward()
        outs.append(out)
        grads.append((x_.grad, *(p.grad for p in mlp.parameters())))
        saved.append(sum(kept))
    # The same ops in the same order: equal to the last bit, forward and backward.
    assert torch.equal(outs[1], outs[0])
    for lean, reference in zip(grads[1], grads[0], strict=True):
        assert torch.equal(lean, reference)
    activation = 3 * 5 * 48 * x.element_size()  # silu(gate): the one tensor no longer kept
    assert saved[1] == saved[0] - activation


# two rows of a one-rank worker's train step: tokens, loss mask, sampling logprobs, advantage
ROWS = [([1, 5, 9, 11, 12, 7], [0, 0, 0, 1, 1, 1], [-4.0] * 6, 1.0),
        ([1, 6, 7, 13, 8, 9], [0, 0, 1, 1, 1, 1], [-4.0] * 6, -1.0)]  # fmt: skip


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's full value: FSDP2 holds a DTensor shard, except while a module is unsharded."""
    from torch.distributed.tensor import DTensor

    return param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()


def test_one_rank_keeps_float32_weights_and_computes_in_bf16(tiny_model_dir, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    import refit
    from molt._actor import PolicyWorker

    batch = collate(ROWS, pad_id=0)
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), _config("float32", "bfloat16"))
    try:
        assert isinstance(worker.model, FSDPModule)  # AutoModel leaves one rank unsharded: molt shards it
        before = {name: _full(p).clone() for name, p in worker.model.named_parameters()}
        logp_BT = worker.logprobs(batch)

        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            logits_BTV = reference(batch.tokens_BT).logits[:, :-1]
        expected_BT = torch.log_softmax(logits_BTV, -1).gather(-1, batch.tokens_BT[:, 1:, None])[..., 0]
        error = (logp_BT[:, 1:] - expected_BT).abs().max().item()
        assert 1e-4 < error < 5e-2, f"bf16 compute differs from float32 by bf16 rounding, got {error}"

        worker.train_step(batch)
        for name, param in worker.model.named_parameters():  # resharded after the backward pass
            assert param.dtype == torch.float32, f"{name}: master weights stay float32"
            assert not torch.equal(_full(param), before[name]), f"{name} did not move"

        # A refit sends the weights in the compute dtype, which the engines run (engine_extra_args).
        sent = {}

        def capture(engines, params, *, version, delta=False, lora=None):
            sent.update(specs=params.specs, tensors=dict(params))

        monkeypatch.setattr(refit, "update_weights", capture)
        assert worker.refit(["http://127.0.0.1:1"], refit.GLOO_BACKEND, 1, "127.0.0.1") is None
        assert {spec.dtype for spec in sent["specs"]} == {torch.bfloat16}
        for name, param in worker.model.named_parameters():
            assert torch.equal(sent["tensors"][name], _full(param).to(torch.bfloat16)), name
    finally:
        torch.distributed.destroy_process_group()


def _one_rank_train_step(model_dir, monkeypatch, unit_bytes: int) -> tuple[int, dict[str, torch.Tensor]]:
    """(FSDP units, parameters after one step) of a one-rank bf16-compute worker whose units hold at
    most `unit_bytes` of layers."""
    from torch.distributed.fsdp import FSDPModule

    from molt import _sharding
    from molt._actor import PolicyWorker

    monkeypatch.setattr(_sharding, "UNIT_BYTES", unit_bytes)
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(model_dir), _config("float32", "bfloat16"))
    try:
        states = {id(m._get_fsdp_state()) for m in worker.model.modules() if isinstance(m, FSDPModule)}
        worker.train_step(collate(ROWS, pad_id=0))
        return len(states), {name: _full(p).clone() for name, p in worker.model.named_parameters()}
    finally:
        torch.distributed.destroy_process_group()


def test_one_rank_casts_its_weights_once_a_pass_and_drops_them_before_the_step(tiny_model_dir, monkeypatch):
    """FSDP2 casts a unit's weights at each micro-batch's forward and again for its backward; one rank
    keeps the cast copies through a pass instead (`shard_one_rank`), and drops them when it ends: the
    optimizer steps the float32 shards, and a copy held past the step would be stale."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor

    from molt._actor import PolicyWorker

    casts: dict[str, int] = {}
    to_unsharded = FSDPParamGroup._to_unsharded

    def counted(group: FSDPParamGroup) -> None:  # FSDP2's unshard: on one rank, a cast copy
        if not group.is_unsharded:
            casts[group._module_fqn] = casts.get(group._module_fqn, 0) + 1
        to_unsharded(group)

    monkeypatch.setattr(FSDPParamGroup, "_to_unsharded", counted)
    rows = [*ROWS, ([1, 6, 7, 13, 8, 9, 4], [0, 0, 1, 1, 1, 1, 1], [-4.0] * 7, -1.0)]
    batch = collate(rows, pad_id=0)
    config = _config("float32", "bfloat16")
    actor = msgspec.structs.replace(config.actor, micro_batch_tokens=8)  # a micro-batch a row
    config = msgspec.structs.replace(config, actor=actor)
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
    try:
        assert len(batch.micro_batches(worker.budget, packed=worker.packed)) == 3
        units = {"", "model.layers.0, model.layers.1"}  # the root, and the layers' unit
        casts.clear()
        before_BT = worker.logprobs(batch)
        assert casts == dict.fromkeys(units, 1)
        casts.clear()
        worker.train_step(batch)
        assert casts == dict.fromkeys(units, 1)  # three forwards and three backwards
        for name, param in worker.model.named_parameters():
            assert isinstance(param, DTensor), f"{name}: the pass ended, its cast copy dropped"
        after_BT = worker.logprobs(batch)  # cast again, from the stepped weights
        assert not torch.equal(after_BT, before_BT)
    finally:
        torch.distributed.destroy_process_group()


def test_one_rank_groups_small_layers_into_one_unit_with_the_same_update(tiny_model_dir, monkeypatch):
    from molt._sharding import UNIT_BYTES

    # the tiny model's two layers: one unit with the root by default, a unit each when a unit holds none
    grouped, after_grouped = _one_rank_train_step(tiny_model_dir, monkeypatch, UNIT_BYTES)
    alone, after_alone = _one_rank_train_step(tiny_model_dir, monkeypatch, 0)
    assert (grouped, alone) == (2, 3)
    for name, param in after_grouped.items():
        assert torch.equal(param, after_alone[name]), f"{name}: a unit's layers step as they do alone"


class _ScaledLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * scale


class _Stack(torch.nn.Module):
    """Three layers that each take a float32 tensor the root computes once, as AutoModel's models pass
    their float32 RoPE tables to every decoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_ScaledLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.linspace(1 / 3, 3, 8)  # float32 values that bf16 rounds
        for layer in self.model.layers:
            x = layer(x, scale=scale)
        return x


def test_every_layer_of_a_one_rank_unit_gets_its_inputs_in_the_compute_dtype(monkeypatch):
    from types import SimpleNamespace

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from molt import _sharding

    strategy = SimpleNamespace(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=None,
    )
    port = free_port()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        outs = []
        for unit_bytes in (_sharding.UNIT_BYTES, 0):  # the three layers one unit; then each a unit alone
            monkeypatch.setattr(_sharding, "UNIT_BYTES", unit_bytes)
            torch.manual_seed(0)
            stack = _Stack()
            _sharding.shard_one_rank(stack, strategy, torch.device("cpu"))
            outs.append(stack(torch.randn(4, 8)))
        grouped, alone = outs
        assert alone.dtype == torch.bfloat16
        assert grouped.dtype == alone.dtype and torch.equal(grouped, alone)
    finally:
        torch.distributed.destroy_process_group()


def test_shard_adamw_steps_the_local_shards_as_torchs_adamw_steps_the_sharded_parameters(monkeypatch):
    """`ShardAdamW` against torch's AdamW over the same FSDP2-sharded parameters (matrices and vectors):
    after steps with weight decay, the same parameters and state dict, bit for bit, its moments still
    DTensors (what checkpoints save); and the fused kernel is given the local tensors, not DTensors."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from molt._sharding import ShardAdamW

    kernel = torch._fused_adamw_
    given = []  # the types of each kernel call's parameters

    def recorded(params, *args, **kwargs):
        given.append({type(p) for p in params})
        return kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", recorded)
    port = free_port()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        results = []
        for optimizer_class in (torch.optim.AdamW, ShardAdamW):
            torch.manual_seed(0)
            stack = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
            for layer in stack:
                fully_shard(layer)
            fully_shard(stack)
            params = list(stack.parameters())
            optimizer = optimizer_class(params, lr=1e-2, weight_decay=0.1, fused=True)
            gen = torch.Generator().manual_seed(1)
            given.clear()
            for _ in range(3):
                for p in params:
                    grad = torch.randn(p.to_local().shape, generator=gen)
                    p.grad = DTensor.from_local(grad, p.device_mesh, p.placements)
                optimizer.step()
            moments = {type(v) for state in optimizer.state.values() for k, v in state.items() if k != "step"}
            results.append(([p.full_tensor() for p in params], optimizer.state_dict(), set().union(*given)))
            assert moments == {DTensor}
        (torch_params, torch_state, torch_given), (params, state, shard_given) = results
        assert torch_given == {DTensor} and shard_given == {torch.Tensor}
        for expected, got in zip(torch_params, params, strict=True):
            assert torch.equal(got, expected)

        def full(t: torch.Tensor) -> torch.Tensor:  # a moment (DTensor) or a step count (plain)
            return t.full_tensor() if isinstance(t, DTensor) else t

        for index, expected in torch_state["state"].items():
            for name, value in expected.items():
                assert torch.equal(full(state["state"][index][name]), full(value))
    finally:
        torch.distributed.destroy_process_group()
