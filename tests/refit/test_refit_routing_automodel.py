"""Routing replay in NeMo AutoModel's own MoE models (its `Gate`), on CPU.

AutoModel's Qwen3-MoE class cannot be built without CUDA (its rotary embedding is placed on
`cuda:{current_device()}` in `__init__`), so the whole-model tests use its DeepSeek-V3 class, which
builds, runs and back-propagates on CPU with the torch backends. Qwen3-MoE's routing (softmax before
top-k, renormalised) is covered on AutoModel's `Gate` alone, which is the same module in both models.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DeepseekV3Config

from refit import RoutingReplay

# AutoModel's imports warn (inductor's torch.jit use, no Transformer Engine on CPU): not ours to fix.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from nemo_automodel.components.models.common.utils import BackendConfig
    from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import Gate
    from nemo_automodel.components.moe.router_replay import RouterReplay

# fmt: off
CPU_BACKEND = dict(
    attn="sdpa", linear="torch", rms_norm="torch", rope="torch", experts="torch", dispatcher="torch",
    enable_hf_state_dict_adapter=False,
)
# fmt: on


def _tiny_deepseek(*, enable_routing_replay: bool = False):
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, norm_topk_prob=True,
        dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config, backend=BackendConfig(**CPU_BACKEND))
    if enable_routing_replay:  # what MoEConfig.enable_routing_replay gives each gate
        for gate in _gates(model):
            gate.router_replay = RouterReplay()
    model.initialize_weights(buffer_device=torch.device("cpu"))  # parameters start as torch.empty
    return model


def _gates(model):
    return [m for m in model.modules() if type(m).__name__ == "Gate"]


def _experts_used(model, run):
    """The expert indices each routed-experts module actually received, per layer: `[N, L, K]`."""
    seen = []
    blocks = [m.experts for m in model.modules() if type(m).__name__ == "MoE"]
    hooks = [b.register_forward_pre_hook(lambda _m, args: seen.append(args[3].clone())) for b in blocks]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(seen, dim=1)


# Dynamo, compiling AutoModel's weighted SwiGLU under autograd, reads `.grad` of a non-leaf and warns.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_replay_reproduces_the_recorded_experts_after_the_gates_drift():
    model = _tiny_deepseek()
    ids_BT = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    replay = RoutingReplay(model)
    assert replay.routers == _gates(model) and len(replay.routers) == 2
    with torch.no_grad(), replay.record():
        recorded_logits = model(ids_BT).logits
    experts_NLK = replay.recorded
    assert experts_NLK.shape == (18, 2, 2)
    with torch.no_grad(), replay.replay(experts_NLK):  # unchanged gates: replay is the identity
        torch.testing.assert_close(model(ids_BT).logits, recorded_logits, rtol=0, atol=0)

    with torch.no_grad():  # the trainer's gates drift away from the engine's
        for gate in replay.routers:
            gate.weight.add_(torch.randn_like(gate.weight) * 3)
    drifted = _experts_used(model, lambda: model(ids_BT))
    assert not torch.equal(drifted, experts_NLK)

    def train_forward():
        with replay.replay(experts_NLK.reshape(2, 9, 2, 2)):  # the [B, T, L, K] form
            model(ids_BT).logits.square().mean().backward()

    assert torch.equal(_experts_used(model, train_forward), experts_NLK)
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in replay.routers)


def test_replay_keeps_the_gates_own_router_replay_handle_and_the_registry():
    model = _tiny_deepseek(enable_routing_replay=True)
    handles = [gate.router_replay for gate in _gates(model)]
    registry = list(RouterReplay.instances())
    replay = RoutingReplay(model)
    ids_BT = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), replay.record():
        model(ids_BT)
    with torch.no_grad(), replay.replay(replay.recorded):
        model(ids_BT)
    assert [gate.router_replay for gate in _gates(model)] == handles
    assert RouterReplay.instances() == registry


def _gate(score_func: str, softmax_before_topk: bool):
    config = MoEConfig(
        n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=0, n_limited_groups=0,
        train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func=score_func,
        route_scale=1.0, dim=16, inter_dim=32, moe_inter_dim=8, norm_topk_prob=True,
        softmax_before_topk=softmax_before_topk, dtype=torch.float32,
    )  # fmt: skip
    gate = Gate(config)
    torch.nn.init.normal_(gate.weight, generator=torch.Generator().manual_seed(3))
    return gate


class _OneGate(torch.nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.gate = gate

    def forward(self, x_ND):
        return self.gate(x_ND, torch.ones(x_ND.shape[0], dtype=torch.bool), None)


@pytest.mark.parametrize(
    ("score_func", "softmax_before_topk"),
    [
        pytest.param("softmax", True, id="qwen3-moe"),
        pytest.param("softmax", False, id="softmax-after-topk"),
        pytest.param("sigmoid", False, id="deepseek-v3"),
    ],
)
def test_gate_alone_replays_exactly_and_weights_follow_the_live_scores(score_func, softmax_before_topk):
    model = _OneGate(_gate(score_func, softmax_before_topk))
    x_ND = torch.randn(12, 16, generator=torch.Generator().manual_seed(4))
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        model(x_ND)
    experts_NLK = replay.recorded.clone()
    with torch.no_grad():
        drift = torch.randn(model.gate.weight.shape, generator=torch.Generator().manual_seed(5))
        model.gate.weight.add_(drift * 3)  # seeded: not the tests run before
    experts_NLK[0] = -1  # row 0 is left to the gate
    with replay.replay(experts_NLK):
        weights_NK, indices_NK, _ = model(x_ND)
    assert torch.equal(indices_NK[1:], experts_NLK[1:, 0])
    with torch.no_grad():
        _, own_NK, _ = model(x_ND)
    assert torch.equal(indices_NK[0], own_NK[0])
    assert not torch.equal(own_NK, replay.recorded[:, 0])  # the drift did change the gate's choice
    torch.testing.assert_close(weights_NK.detach().sum(-1), torch.ones(12))  # renormalised over the replayed
    weights_NK[:, 0].sum().backward()
    assert model.gate.weight.grad.abs().sum() > 0


def test_gate_refuses_a_misaligned_replay():
    model = _OneGate(_gate("softmax", True))
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match="align"), replay.replay(torch.zeros(5, 1, 2, dtype=torch.long)):
        model(torch.randn(4, 16))
