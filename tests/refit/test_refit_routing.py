"""Routing replay: vLLM's routed-experts format, and exact replay in transformers' Qwen3-MoE."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from refit import RoutingReplay, decode_routed_experts


def _encode(array: np.ndarray) -> str:
    """What vLLM sends (vllm.utils.serial_utils.numpy2base64: base64 of the `.npy` bytes)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_decode_aligns_rows_with_the_token_trace():
    rows = np.arange(4 * 2 * 3, dtype=np.uint8).reshape(4, 2, 3)  # 5 tokens: the last was never forwarded
    experts = decode_routed_experts(_encode(rows), num_tokens=5)
    assert experts.shape == (5, 2, 3) and experts.dtype == torch.int64
    assert torch.equal(experts[:4], torch.from_numpy(rows).long())
    assert (experts[4] == -1).all()


def test_decode_with_skipped_prompt_tokens_pads_the_front():
    rows = np.ones((3, 1, 2), dtype=np.int32)
    experts = decode_routed_experts(_encode(rows), num_tokens=6, prompt_start=2)
    assert (experts[:2] == -1).all() and (experts[2:5] == 1).all() and (experts[5] == -1).all()


def test_decode_refuses_a_trace_of_the_wrong_length():
    with pytest.raises(ValueError, match="routing rows"):
        decode_routed_experts(_encode(np.zeros((4, 1, 2), dtype=np.uint16)), num_tokens=9)


def _tiny_moe(num_layers: int = 2, dense_layers: tuple[int, ...] = ()):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=list(dense_layers),
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def _experts_used(model, run):
    """The expert indices each experts module actually received (forward pre-hook), per layer."""
    seen = []
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    hooks = [b.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone())) for b in blocks]
    try:
        out = run()
    finally:
        for hook in hooks:
            hook.remove()
    return out, torch.stack(seen, dim=1)


@torch.no_grad()
def test_replay_uses_the_recorded_experts_after_the_router_changed():
    model = _tiny_moe()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    replay = RoutingReplay(model)
    assert len(replay.routers) == 2
    with replay.record():
        recorded_logits = model(ids).logits
    experts_NLK = replay.recorded
    assert experts_NLK.shape == (18, 2, 2)

    with replay.replay(experts_NLK):  # unchanged router: replay is the identity
        torch.testing.assert_close(model(ids).logits, recorded_logits, rtol=0, atol=0)
    assert [int(n) for n in replay.mismatch] == [0, 18 * 2]  # no (token, layer) routed elsewhere

    for router in replay.routers:  # the "trainer" router drifts away from the "engine" one
        router.weight.add_(torch.randn_like(router.weight) * 3)
    _, drifted = _experts_used(model, lambda: model(ids))
    assert not torch.equal(drifted, experts_NLK)

    _, replayed = _experts_used(model, lambda: replay_forward(replay, experts_NLK, model, ids))
    assert torch.equal(replayed, experts_NLK)
    differed = sum(  # the (token, layer) pairs whose drifted router picks another set of experts
        not torch.equal(a.sort().values, b.sort().values)
        for a, b in zip(drifted.flatten(0, 1), experts_NLK.flatten(0, 1), strict=True)
    )
    assert differed > 0 and [int(n) for n in replay.mismatch] == [differed, 36]


def replay_forward(replay, experts, model, ids, shape=(2, 9)):
    with replay.replay(experts.reshape(*shape, *experts.shape[-2:])):  # the [B, T, L, K] form works too
        return model(ids)


def test_replay_weights_come_from_the_current_router_and_carry_gradient():
    model = _tiny_moe()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        model(ids)
    experts = replay.recorded.clone()
    experts[0] = -1  # row 0 is left to the router
    with replay.replay(experts):
        model(ids).logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in replay.routers)


def test_replay_refuses_a_model_without_routers_and_misaligned_tokens():
    with pytest.raises(ValueError, match="TopKRouter"):
        RoutingReplay(torch.nn.Linear(2, 2))
    model = _tiny_moe()
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match="align"), replay.replay(torch.zeros(5, 2, 2, dtype=torch.long)):
        model(torch.zeros(1, 4, dtype=torch.long))


@torch.no_grad()
def test_routes_with_a_column_per_decoder_layer_replay_on_the_moe_layers_only():
    """vLLM reports a column for every decoder layer; with a dense layer 1 of 3, the routers are those of
    layers 0 and 2, and they must get columns 0 and 2."""
    model = _tiny_moe(num_layers=3, dense_layers=(1,))
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    replay = RoutingReplay(model)
    assert replay.layer_ids == [0, 2]
    with replay.record():
        model(ids)
    engine_NLK = torch.full((7, 3, 2), 5, dtype=torch.long)  # the dense layer's column: never read
    engine_NLK[:, [0, 2]] = replay.recorded
    for router in replay.routers:
        router.weight.add_(torch.randn_like(router.weight) * 3)
    _, replayed = _experts_used(model, lambda: replay_forward(replay, engine_NLK, model, ids, shape=(1, 7)))
    assert torch.equal(replayed, replay.recorded)
    bad = replay.replay(engine_NLK[:, :1])
    with pytest.raises(ValueError, match="one column per router or one per decoder layer"), bad:
        pass


@torch.no_grad()
def test_replaying_its_own_choice_leaves_a_router_that_always_normalises_unchanged():
    """Mixtral's router renormalises its top-k weights without a `norm_topk_prob` flag."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    replay = RoutingReplay(model)
    with replay.record():
        recorded_logits = model(ids).logits
    with replay.replay(replay.recorded):
        torch.testing.assert_close(model(ids).logits, recorded_logits, rtol=0, atol=0)
