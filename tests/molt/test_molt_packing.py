"""Packed micro-batches (`molt._packing`): the plan over ranks and budgets, the packed layout, attention
that stays inside each row, and the models that must not be packed.

The actor's update under packing (padded against packed, one rank against two, one budget against
another) is pinned in test_molt_actor.py and test_molt_critic.py, on real FSDP2 ranks.

Legend: B rows, T tokens, N packed tokens, H heads, D head dim.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from molt._packing import (
    CUDA_PACK_MULTIPLE,
    auto_micro_batch_tokens,
    model_flops,
    packed_attention,
    packed_rows,
    packing_refusal,
    plan_micro_batches,
    row_cost,
)
from molt._prefix import pad_multiple


def _agentic_lengths(seed: int, count: int) -> list[int]:
    """Lognormal row lengths, a few tokens to a few thousand, as agent episodes have."""
    gen = torch.Generator().manual_seed(seed)
    return [max(2, min(4096, int(n))) for n in torch.empty(count).log_normal_(6.0, 1.2, generator=gen)]


@pytest.mark.parametrize(
    ("num_ranks", "budget", "packed"),
    [
        pytest.param(1, 4096, True, id="one-rank"),
        pytest.param(2, 4096, True, id="two-ranks"),
        pytest.param(3, 8192, True, id="three-ranks"),
        pytest.param(4, 4096, False, id="padded-four-ranks"),
    ],
)
def test_the_plan_places_every_row_once_within_the_budget_on_equal_counts(num_ranks, budget, packed):
    lengths = _agentic_lengths(0, 64)
    plan = plan_micro_batches(lengths, num_ranks=num_ranks, budget=budget, packed=packed)
    assert len(plan) == num_ranks and len({len(rank) for rank in plan}) == 1  # lock-step
    placed = sorted(row for rank in plan for mb in rank for row in mb)
    assert placed == list(range(len(lengths)))
    for mb in itertools.chain.from_iterable(plan):
        slots = sum(lengths[r] for r in mb) if packed else len(mb) * max((lengths[r] for r in mb), default=0)
        assert slots <= budget
    if packed:  # no more micro-batches than the fewest the budget allows, plus the ranks' rounding
        assert len(plan[0]) <= -(-sum(lengths) // budget) + 1


def test_ranks_get_costs_balanced_not_row_counts():
    """One long row and many short ones over two ranks: the busiest rank costs no more than the lower
    bound (the long row alone, or half of all), where an even split of the rows would cost a third more."""
    lengths = [6000] + [100] * 60
    plan = plan_micro_batches(lengths, num_ranks=2, budget=8192)
    costs = [sum(row_cost(lengths[r]) for mb in rank for r in mb) for rank in plan]
    bound = max(row_cost(6000), sum(map(row_cost, lengths)) / 2)
    assert max(costs) <= bound * 1.01
    assert [sum(len(mb) for mb in rank) for rank in plan] in ([1, 60], [60, 1])
    by_count = sum(row_cost(n) for n in lengths[:31])  # the long row and 30 short ones
    assert by_count > 1.25 * bound


def test_the_plan_gives_every_rank_a_turn_when_rows_are_fewer_than_ranks():
    plan = plan_micro_batches([5, 0, 7], num_ranks=4, budget=16)  # a zero-length row is left out
    assert [len(rank) for rank in plan] == [1] * 4
    assert sorted(row for rank in plan for mb in rank for row in mb) == [0, 2]
    assert sum(1 for rank in plan if rank == [[]]) == 2  # empty turns, run on a dummy row


def test_a_row_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="rows of 300 tokens do not fit a micro-batch budget of 256"):
        plan_micro_batches([10, 300], num_ranks=1, budget=256)


def test_packed_rows_lay_rows_end_to_end_with_their_own_positions():
    tokens_BT = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    layout = packed_rows([3, 2, 4], cuda=False)
    assert layout.pack(tokens_BT).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    kwargs = layout.model_kwargs(torch.device("cpu"))
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 9]
    values_1N = torch.arange(1.0, 10.0)[None]
    assert layout.unpack(values_1N, 4).tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]


def test_cuda_layouts_round_the_packed_length_and_longest_row():
    layout = packed_rows([5000, 4000], cuda=True)
    assert layout.num_packed == 9216 and layout.max_length == 8192  # a multiple of 256; a power of two
    kwargs = layout.model_kwargs(torch.device("cpu"))  # the row bounds alone: varlen attention, no tree
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 5000, 9000, 9216]  # a padding row nobody attends to
    assert kwargs["position_ids"][0, 9000:].tolist() == list(range(216))
    assert layout.pack(torch.ones(2, 5000, dtype=torch.int64))[0, 9000:].eq(0).all()
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 8192
    assert set(kwargs) == {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    short = packed_rows([300, 200], cuda=True)  # 500 tokens: to a multiple of 8, not of 256
    assert short.num_packed == 504 and short.max_length == 512


def test_cuda_rounding_pads_at_most_a_32nd_of_a_micro_batch():
    """However short the micro-batch, from 256 tokens on its padding takes at most 1/32 of its slots (a
    multiple of 256 from 8,192 tokens on; below 256 tokens, at most 7 tokens)."""
    for n in [*range(1, 9000), *range(9000, 70000, 97)]:
        multiple = pad_multiple(n, CUDA_PACK_MULTIPLE)
        padding = -n % multiple
        assert multiple & (multiple - 1) == 0 and 8 <= multiple <= CUDA_PACK_MULTIPLE, n
        assert padding <= (n + padding) / 32 if n >= 256 else padding <= 7, (n, multiple)
        assert multiple == CUDA_PACK_MULTIPLE or n < 32 * CUDA_PACK_MULTIPLE, n
    assert pad_multiple(10_000, 1) == 1  # a CPU: no rounding


def test_packed_attention_attends_within_each_row_only():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7]
    q, k, v = (torch.randn(1, heads, sum(lengths), 8, generator=gen) for heads in (4, 2, 2))  # GQA
    cu_seqlens = packed_rows(lengths, cuda=False).model_kwargs(torch.device("cpu"))["cu_seq_lens_q"]
    module = torch.nn.Module()
    out_1NHD, _ = packed_attention(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu_seqlens)
    for start, stop in itertools.pairwise(cu_seqlens.tolist()):  # each row alone, causal
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:stop],
            k[:, :, start:stop],
            v[:, :, start:stop],
            is_causal=True,
            scale=0.3,
            enable_gqa=True,
        )
        torch.testing.assert_close(out_1NHD[:, start:stop], expected.transpose(1, 2))


def test_a_packed_forward_of_the_tiny_model_equals_each_row_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from molt._packing import use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    use_packed_attention(model)
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 100, (n,), generator=gen) for n in (6, 9, 3)]
    layout = packed_rows([len(r) for r in rows], cuda=False)
    tokens_BT = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    with torch.no_grad():
        packed_BTV = layout.unpack(
            model(layout.pack(tokens_BT), **layout.model_kwargs(torch.device("cpu"))).logits, 9
        )
        for b, row in enumerate(rows):
            alone_TV = model(row[None]).logits[0]
            torch.testing.assert_close(packed_BTV[b, : len(row)], alone_TV, atol=1e-5, rtol=1e-5)


def _tiny_qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).eval()


@pytest.mark.filterwarnings("ignore:.*falling back to its reference PyTorch implementation")
def test_a_linear_attention_hybrid_would_mix_packed_rows_so_it_is_refused():
    """transformers' tiny Qwen3-Next: packed with positions restarting at 0 (full-attention layers then
    mask each row), the second row still differs from its forward alone, through the linear-attention
    layer's state; `packing_refusal` names it."""
    model = _tiny_qwen3_next()
    first, second = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        alone = model(input_ids=second).logits
        positions = torch.cat([torch.arange(5), torch.arange(6)])[None]
        packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions).logits[:, 5:]
    assert (alone - packed).abs().max() > 1e-2  # mixed
    reason = packing_refusal(model.config)
    assert reason is not None and "linear_attention" in reason and "state" in reason


def test_dense_models_pack_and_vision_language_models_do_not(tiny_model_dir):
    from transformers import AutoConfig, Qwen2VLConfig

    assert packing_refusal(AutoConfig.from_pretrained(tiny_model_dir)) is None
    assert "M-RoPE" in packing_refusal(Qwen2VLConfig())


def test_the_automatic_budget_follows_free_memory_and_never_undercuts_the_longest_row():
    from transformers import Qwen3Config

    qwen3_1_7b = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28)
    per_token = 28 * (3 * 6144 + 8 * 2048) * 2  # bfloat16 values kept for the backward
    budget = auto_micro_batch_tokens(
        qwen3_1_7b, free_bytes=40 * 2**30, dtype_bytes=2, checkpointing=False, at_least=2048
    )
    assert budget == 40 * 2**30 // per_token // 1024 * 1024
    checkpointed = auto_micro_batch_tokens(
        qwen3_1_7b, free_bytes=40 * 2**30, dtype_bytes=2, checkpointing=True, at_least=2048
    )
    assert checkpointed == 65536  # capped
    starved = auto_micro_batch_tokens(
        qwen3_1_7b, free_bytes=2**30, dtype_bytes=2, checkpointing=False, at_least=4096
    )
    assert starved == 4096


def test_model_flops_count_the_matmuls_and_causal_attention():
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
    flops = model_flops([10, 20], config, 1000, backward=True)
    assert flops == 3 * sum(n * (2 * 1000 + 2 * 2 * n * 64) for n in (10, 20))
    assert model_flops([10], config, 1000, backward=False) * 3 == model_flops(
        [10], config, 1000, backward=True
    )
