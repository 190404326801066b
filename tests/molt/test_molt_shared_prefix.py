"""Shared prefixes in packed micro-batches (`molt._prefix`, `--actor.shared_prefix`): the groups found, the
tree layout, its attention (SDPA with a mask per group on a CPU; FlexAttention's, CUDA's, run eagerly here),
the plan that keeps a group in one micro-batch, and the results per row equal to each row alone: a tiny
dense and a tiny MoE model's logprobs, and one step of the real policy actor.

Legend: B rows, T tokens, N packed tokens, H heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from molt._batch import StepInputs, collate
from molt._packing import attention_windows, packed_attention, plan_micro_batches, use_packed_attention
from molt._prefix import MIN_SHARED_TOKENS, SharedPrefixRows, prefix_groups, tree_mask
from molt.config import Config

# torch.compile (`molt._flex`, imported by the FlexAttention tests) imports a deprecated torch.jit API.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

PROMPT = list(range(40, 40 + MIN_SHARED_TOKENS + 4))  # a prompt longer than the shortest shared prefix


def _random(seed: int, count: int) -> list[int]:
    return torch.randint(4, 100, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rows() -> list[list[int]]:
    """Two samples of one prompt that diverge after one token, a third of it, an unrelated row, and a
    two-turn episode's segments (the second extends the first)."""
    episode = _random(5, 24)
    return [
        PROMPT + [7] + _random(1, 5),
        PROMPT + [7] + _random(2, 8),  # the same first token as the row above, then its own
        PROMPT + _random(3, 3),
        _random(4, 12),
        episode,
        episode + _random(6, 9),
    ]


def _tokens(rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    tokens_BT = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True)
    return tokens_BT, [len(r) for r in rows]


# --- the layout ---


def test_rows_that_begin_alike_are_grouped_one_token_short_of_their_common_tokens():
    groups = {tuple(sorted(rows)): shared for rows, shared in prefix_groups(*_tokens(_rows()))}
    assert groups == {
        (0, 1, 2): len(PROMPT) - 1,  # the third sample shares the prompt only
        (3,): 0,  # nothing in common
        (4, 5): 23,  # the episode's segments: the first segment's tokens less one
    }


def test_two_samples_that_diverge_after_one_token_share_it():
    rows = _rows()[:2]
    ((members, shared),) = prefix_groups(*_tokens(rows))
    assert sorted(members) == [0, 1] and shared == len(PROMPT)  # the prompt and the common first token


@pytest.mark.parametrize(
    ("rewritten", "shared"),
    [
        pytest.param(3, None, id="early-rewrite-shares-nothing"),
        pytest.param(MIN_SHARED_TOKENS + 5, MIN_SHARED_TOKENS + 4, id="shares-up-to-the-rewrite"),
    ],
)
def test_a_segment_that_rewrites_an_earlier_turn_shares_nothing_past_the_rewrite(rewritten, shared):
    first = _random(7, 30)
    second = [*first, *_random(8, 6)]
    second[rewritten] += 1  # the episode's later segment rewrote an earlier turn's token
    groups = prefix_groups(*_tokens([first, second]))
    if shared is None:
        assert sorted(groups) == [((0,), 0), ((1,), 0)]
    else:
        assert [s for _, s in groups] == [shared]  # the rewritten token and all after are each row's own


def test_the_tree_packs_each_prefix_once_with_continuing_positions_and_unpacks_each_row_whole():
    rows = [PROMPT + [1, 2, 3], PROMPT + [4, 5], [9, 8, 7]]
    tokens_BT, lengths = _tokens(rows)
    layout = SharedPrefixRows.of(tokens_BT, lengths)
    shared = len(PROMPT) - 1
    assert layout.num_saved == shared and layout.num_packed == sum(lengths) - shared
    packed = layout.pack(tokens_BT)[0].tolist()
    assert packed == [9, 8, 7, *PROMPT[:-1], PROMPT[-1], 1, 2, 3, PROMPT[-1], 4, 5]  # rows sorted by tokens
    positions = layout.model_kwargs(torch.device("cpu"))["position_ids"][0].tolist()
    assert positions == [0, 1, 2, *range(shared), *range(shared, shared + 4), *range(shared, shared + 3)]
    torch.testing.assert_close(layout.unpack(layout.pack(tokens_BT), tokens_BT.shape[1]), tokens_BT)
    # the packed next token of every position but a row's last is that row's own next token
    next_N = layout.pack(tokens_BT).roll(-1, dims=1)[0]
    unpacked_next_BT = layout.unpack(next_N[None], tokens_BT.shape[1])
    for b, row in enumerate(rows):
        assert unpacked_next_BT[b, : len(row) - 1].tolist() == row[1:]


def test_a_prefix_position_is_read_where_any_row_of_its_group_reads_it():
    """`positions_of`: where the logprob head computes (`molt._rank.ModelRank._trained_positions`). A
    shared token is trained in one row and history in another (an episode's earlier turn): it is read."""
    rows = [PROMPT + [1, 2, 3], PROMPT + [4, 5], [9, 8, 7]]
    tokens_BT, lengths = _tokens(rows)
    layout = SharedPrefixRows.of(tokens_BT, lengths)  # packed: row 2, the prefix, row 0's, row 1's own
    shared = len(PROMPT) - 1
    read_BT = torch.zeros(tokens_BT.shape, dtype=torch.bool)
    read_BT[1, 2] = True  # on the prefix, read by the group's second row alone
    read_BT[0, shared + 1] = True  # row 0's own second token
    read_BT[2, 0] = read_BT[1, len(rows[1])] = True  # a pad column past row 1's end is never read
    assert layout.positions_of(read_BT).tolist() == [0, 3 + 2, 3 + shared + 1]


def test_a_continuation_sees_its_prefix_and_itself_never_a_sibling():
    rows = [PROMPT + [1, 2, 3], PROMPT + [4, 5]]
    layout = SharedPrefixRows.of(*_tokens(rows))
    kwargs = layout.model_kwargs(torch.device("cpu"))
    mask_NN = tree_mask(kwargs["tree_positions"], kwargs["tree_branches"], None)
    shared, first, second = len(PROMPT) - 1, 4, 3
    expected_NN = torch.zeros(mask_NN.shape, dtype=torch.bool)
    spans = [(0, shared), (shared, shared + first), (shared + first, shared + first + second)]
    for start, stop in spans:  # causal within the prefix and within each continuation
        expected_NN[start:stop, start:stop] = torch.ones(stop - start, stop - start).tril().bool()
    expected_NN[shared:, :shared] = True  # every continuation token sees the whole prefix
    assert torch.equal(mask_NN, expected_NN)
    windowed = tree_mask(kwargs["tree_positions"], kwargs["tree_branches"], 2)
    last = shared + first - 1  # the first continuation's last token, at position shared + 3
    assert windowed[last].nonzero()[:, 0].tolist() == [last - 1, last]


@pytest.mark.parametrize("window", [pytest.param(None, id="causal"), pytest.param(3, id="sliding-window")])
def test_tree_attention_equals_each_row_alone(window):
    """q, k, v that agree on the rows' common tokens (as a model's do): each row's attention output from
    the tree equals causal SDPA over that row alone."""
    gen = torch.Generator().manual_seed(0)
    tokens_BT, lengths = _tokens(_rows())
    layout = SharedPrefixRows.of(tokens_BT, lengths)
    embed_VHD = {h: torch.randn(100, h, 8, generator=gen) for h in (4, 2)}
    q_BTHD, k_BTHD, v_BTHD = embed_VHD[4][tokens_BT], embed_VHD[2][tokens_BT], embed_VHD[2][tokens_BT] * 2
    positions_BT = torch.arange(tokens_BT.shape[1]).expand(tokens_BT.shape)  # rotary-like: by position
    q_BTHD = q_BTHD * (1 + positions_BT[..., None, None] / 10)
    q_1HND, k_1HND, v_1HND = (layout.pack(t).transpose(1, 2) for t in (q_BTHD, k_BTHD, v_BTHD))
    kwargs = layout.model_kwargs(torch.device("cpu"))
    out_1NHD, _ = packed_attention(
        torch.nn.Module(), q_1HND, k_1HND, v_1HND, None, scaling=0.3, sliding_window=window, **kwargs
    )
    out_BTHD = layout.unpack(out_1NHD, tokens_BT.shape[1])
    _assert_each_row_alone(out_BTHD, lengths, window, q_BTHD, k_BTHD, v_BTHD)


@pytest.fixture
def eager_flex(monkeypatch):
    """`molt._flex`'s functions uncompiled: on a CPU, FlexAttention runs forward only, eagerly (it
    materialises the scores, and says so) or compiled for one shape (torch 2.11's CPU kernel fails to
    build for dynamic shapes). The CUDA actor's compiled path is tests/molt/test_molt_actor_gpu.py's."""
    from torch.nn.attention import flex_attention

    import molt._flex

    monkeypatch.setattr(molt._flex, "flex_attention", flex_attention.flex_attention)
    monkeypatch.setattr(molt._flex, "create_block_mask", flex_attention.create_block_mask)


def _cuda_kwargs(layout: SharedPrefixRows) -> dict:
    """The forward's keyword arguments as a CUDA rank passes them (block masks, no per-group masks),
    built on the CPU."""
    kwargs = layout.model_kwargs(torch.device("cpu"))
    del kwargs["tree_positions"], kwargs["tree_branches"]
    return kwargs | {"tree_block_masks": layout.block_masks(torch.device("cpu"))}


def test_the_block_mask_is_each_spans_tree_mask_and_nothing_across_spans(eager_flex):
    """FlexAttention's mask, evaluated densely, against `tree_mask` per group span (a row that shares
    nothing: causal) and causal within the padding span, with and without a sliding window."""
    from torch.nn.attention.flex_attention import create_mask

    tokens_BT, lengths = _tokens(_rows())
    layout = SharedPrefixRows.of(tokens_BT, lengths, pad_to=32, windows=(None, 3))
    assert layout.num_padding and layout.num_packed % 8 == 0  # 86 tokens: padded to a multiple of 8
    kwargs = layout.model_kwargs(torch.device("cpu"))
    bounds = kwargs["cu_seq_lens_q"].tolist()
    assert len(bounds) == len(layout.groups) + 2  # the groups, then the padding span
    n = layout.num_packed
    for window, block_mask in layout.block_masks(torch.device("cpu")).items():
        expected_NN = torch.zeros(n, n, dtype=torch.bool)
        for start, stop in itertools.pairwise(bounds):
            positions, branches = kwargs["tree_positions"][start:stop], kwargs["tree_branches"][start:stop]
            expected_NN[start:stop, start:stop] = tree_mask(positions, branches, window)
        assert torch.equal(create_mask(block_mask.mask_mod, 1, 1, n, n, "cpu")[0, 0], expected_NN), window


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [pytest.param(None, id="causal"), pytest.param(3, id="sliding-window")])
def test_flex_attention_equals_the_sdpa_tree_and_each_row_alone(window, eager_flex):
    """The CUDA path's attention (FlexAttention by the block masks, a padding span at the end) over the
    packed rows of `test_tree_attention_equals_each_row_alone`: the same output as the CPU path's SDPA
    with a mask per group, and as causal SDPA over each row alone."""
    gen = torch.Generator().manual_seed(0)
    tokens_BT, lengths = _tokens(_rows())
    layout = SharedPrefixRows.of(tokens_BT, lengths, pad_to=32, windows=(None, 3))
    embed_VHD = {h: torch.randn(100, h, 8, generator=gen) for h in (4, 2)}
    q_BTHD, k_BTHD, v_BTHD = embed_VHD[4][tokens_BT], embed_VHD[2][tokens_BT], embed_VHD[2][tokens_BT] * 2
    positions_BT = torch.arange(tokens_BT.shape[1]).expand(tokens_BT.shape)
    q_BTHD = q_BTHD * (1 + positions_BT[..., None, None] / 10)
    q_1HND, k_1HND, v_1HND = (layout.pack(t).transpose(1, 2) for t in (q_BTHD, k_BTHD, v_BTHD))
    outs_1NHD = [
        packed_attention(
            torch.nn.Module(), q_1HND, k_1HND, v_1HND, None, scaling=0.3, sliding_window=window, **kwargs
        )[0]
        for kwargs in (_cuda_kwargs(layout), layout.model_kwargs(torch.device("cpu")))
    ]
    flex_1NHD, sdpa_1NHD = outs_1NHD
    torch.testing.assert_close(flex_1NHD, sdpa_1NHD)
    out_BTHD = layout.unpack(flex_1NHD, tokens_BT.shape[1])
    _assert_each_row_alone(out_BTHD, lengths, window, q_BTHD, k_BTHD, v_BTHD)


def test_a_block_mask_is_built_for_each_window_the_models_layers_pass():
    from transformers import Qwen3Config

    assert attention_windows(Qwen3Config()) == (None,)  # no sliding layer: the config's window is None
    assert attention_windows(Qwen3Config(use_sliding_window=True, sliding_window=512)) == (None, 512)


def test_the_plan_keeps_each_shared_prefix_group_in_one_micro_batch():
    lengths = [30, 5, 30, 5, 30, 5, 30, 5]
    together = [([0, 2, 4], 0), ([1, 3, 5], 0)]
    plan = plan_micro_batches(lengths, num_ranks=2, budget=100, together=together)
    assert len({len(rank) for rank in plan}) == 1  # lock-step
    placed = sorted(row for rank in plan for mb in rank for row in mb)
    assert placed == list(range(8))
    micro_batches = list(itertools.chain.from_iterable(plan))
    assert all(sum(lengths[r] for r in mb) <= 100 for mb in micro_batches)
    for rows, _ in together:
        assert any(set(rows) <= set(mb) for mb in micro_batches), rows
    split = plan_micro_batches(lengths, num_ranks=1, budget=60, together=together)[0]  # 90 tokens: split
    assert all(sum(lengths[r] for r in mb) <= 60 for mb in split)
    assert sorted(row for mb in split for row in mb) == list(range(8))


def test_the_budget_counts_a_shared_prefix_once():
    """8 rows of 100 tokens sharing 80: 100 + 7 x 20 = 240 token slots laid out shared, not 800; a group
    split over micro-batches holds its prefix once in each."""
    lengths, group = [100] * 8, [(range(8), 80)]
    assert plan_micro_batches(lengths, num_ranks=1, budget=256, together=group) == [[list(range(8))]]
    split = plan_micro_batches(lengths, num_ranks=1, budget=160, together=group)[0]
    assert sorted(row for mb in split for row in mb) == list(range(8))
    assert [100 + (len(mb) - 1) * 20 for mb in split] == [160, 160]  # 4 rows a micro-batch


def test_sharing_fills_no_micro_batch_fuller_than_packing_alone_where_that_costs_none():
    """Rows 3-5 share 40 tokens. Packed alone (budget 100) they take 4 micro-batches, the fullest 90
    tokens; shared, 3, and the group laid out whole would fill one to 100 (40 + 3 x 20): placed as if the
    budget were 90, they still take 3, none fuller than 90, so sharing raises no peak. Where the lower
    bound would cost micro-batches (the test above: 8 rows of 100 sharing 80), the budget stands."""
    lengths, group = [50, 40, 20, 60, 60, 60], [([3, 4, 5], 40)]

    def slots(rows):
        shared = len(set(rows) & {3, 4, 5})
        return sum(lengths[r] for r in rows) - max(shared - 1, 0) * 40

    (alone,) = plan_micro_batches(lengths, num_ranks=1, budget=100)
    assert len(alone) == 4 and max(sum(lengths[r] for r in mb) for mb in alone) == 90
    (shared,) = plan_micro_batches(lengths, num_ranks=1, budget=100, together=group)
    assert len(shared) == 3 and max(map(slots, shared)) == 90
    assert sorted(row for mb in shared for row in mb) == list(range(6))


# --- a real model's logprobs ---


def _tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_models_shared_prefix_logprobs_equal_each_row_alone(kind, attention, tiny_model_dir, eager_flex):
    """The packed forward's next tokens are the packed tokens shifted by one, as `molt._rank` gives the
    logprob head: every row's logprob of every token equals its forward alone, the first token after the
    shared prefix (the samples' own, or the one two samples share) included. "flex": the keyword
    arguments a CUDA rank passes (transformers hands the block masks to every layer's attention)."""
    from transformers import AutoModelForCausalLM

    if kind == "dense":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    else:
        model = _tiny_moe()
    use_packed_attention(model)
    rows = _rows()
    tokens_BT, lengths = _tokens(rows)
    layout = SharedPrefixRows.of(tokens_BT, lengths, pad_to=32 if attention == "flex" else 1)
    assert layout.num_saved > 0
    kwargs = _cuda_kwargs(layout) if attention == "flex" else layout.model_kwargs(torch.device("cpu"))
    with torch.no_grad():
        packed_1N = layout.pack(tokens_BT)
        logits_1NV = model(packed_1N, **kwargs).logits / 0.7
        logp_1N = torch.log_softmax(logits_1NV, -1).gather(-1, packed_1N.roll(-1, dims=1)[..., None])[..., 0]
        logp_BT = torch.nn.functional.pad(layout.unpack(logp_1N, tokens_BT.shape[1])[:, :-1], (1, 0))
        for b, row in enumerate(rows):
            ids_1T = torch.tensor([row])
            alone_TV = torch.log_softmax(model(ids_1T).logits[0, :-1] / 0.7, -1)
            alone_T = alone_TV.gather(-1, ids_1T[0, 1:, None])[:, 0]
            torch.testing.assert_close(logp_BT[b, 1 : len(row)], alone_T, atol=1e-5, rtol=0)


# --- the policy actor, shared against unshared ---


def _config(shared: bool) -> Config:
    config = Config()
    actor = msgspec.structs.replace(
        config.actor, lr=1e-3, micro_batch_tokens=4096, shared_prefix="on" if shared else "off"
    )
    rollout = msgspec.structs.replace(config.rollout, temperature=0.7)
    return msgspec.structs.replace(config, actor=actor, rollout=rollout)


@pytest.mark.slow
def test_the_actor_gives_the_same_logprobs_and_update_with_shared_prefixes(tiny_model_dir):
    """Two one-rank groups from the same weights, one with --actor.shared_prefix: the same logprobs, step
    metrics and parameters after one step (old logprobs off-policy, so that clipping and the correction
    act), and `actor/shared_prefix_frac` the tokens the layout saved."""
    import ray

    from molt._group import PolicyGroup

    rows = _rows()
    prompt_lengths = [len(PROMPT)] * 3 + [4, 10, 24]
    gen = torch.Generator().manual_seed(9)
    sequences = [
        (row, [0] * p + [1] * (len(row) - p), (-3 * torch.rand(len(row), generator=gen)).tolist(), adv)
        for row, p, adv in zip(rows, prompt_lengths, [1.5, -1.0, 0.5, -0.25, 2.0, -0.5], strict=True)
    ]
    batch = collate(sequences, pad_id=0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with ThreadPoolExecutor(2) as pool:
            starts = [pool.submit(PolicyGroup, tiny_model_dir, _config(on), 1) for on in (False, True)]
            plain, shared = (start.result() for start in starts)
        logp_BT = plain.logprobs(batch)
        torch.testing.assert_close(shared.logprobs(batch), logp_BT, atol=1e-5, rtol=0)
        saved = SharedPrefixRows.of(batch.tokens_BT, batch.row_lengths).num_saved
        frac = shared.pass_metrics()["actor/shared_prefix_frac"]
        assert frac == pytest.approx(saved / sum(batch.row_lengths))
        assert plain.pass_metrics()["actor/shared_prefix_frac"] == 0.0

        old_logp_BT = logp_BT + 0.3 * torch.randn(logp_BT.shape, generator=gen) * batch.loss_mask_BT
        before = plain.full_state()
        metrics = [group.train_step(batch, StepInputs(old_logp_BT=old_logp_BT)) for group in (plain, shared)]
        for key, value in metrics[0].items():
            assert metrics[1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        after_plain, after_shared = plain.full_state(), shared.full_state()
        metrics_shared = shared.pass_metrics()
        assert metrics_shared["actor/shared_prefix_frac"] > 0 and metrics_shared["actor/padding_frac"] == 0
    finally:
        ray.shutdown()
    # Adam's first step moves a weight by lr (1e-3) whatever its gradient's size g, except where g is near
    # Adam's eps (1e-8): there the step is lr * g / (|g| + eps), and the float32 summation-order noise of g
    # (a sum of much larger terms) shows, amplified: a few weights of 100k, each moved by less than lr,
    # differ by up to 1.1e-5 on one CPU and 6e-6 on another. The weights that moved by lr agree to 1e-6;
    # the gradient's size is compared through train/grad_norm above.
    for name, tensor in after_plain.items():
        assert not torch.equal(tensor, before[name]), f"{name} did not move"
        full_step = (tensor - before[name]).abs() > 0.9e-3
        torch.testing.assert_close(
            after_shared[name][full_step], tensor[full_step], atol=1e-6, rtol=0, msg=name
        )
        torch.testing.assert_close(after_shared[name], tensor, atol=5e-5, rtol=0, msg=name)


# --- refusals ---


@pytest.mark.parametrize(
    ("args", "on_gpu", "says"),
    [
        pytest.param(["--actor.pack", "false"], False, "--actor.pack false pads them", id="padded"),
        pytest.param(["--train.routing_replay"], True, "one route", id="routing-replay"),
    ],
)
def test_shared_prefixes_are_refused_unpacked_or_with_routing_replay(monkeypatch, args, on_gpu, says):
    import molt._validate
    from molt._flags import resolve
    from molt.config import ConfigError

    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: on_gpu)
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 8)
    with pytest.raises(ConfigError, match=says):
        resolve(["--actor.shared_prefix", "on", *args])


@pytest.mark.parametrize(
    ("actor", "train", "on_gpu", "shares"),
    [
        pytest.param({}, {}, True, True, id="cuda"),
        pytest.param({}, {}, False, False, id="cpu"),
        pytest.param({"shared_prefix": "on"}, {}, False, True, id="on-cpu"),
        pytest.param({"shared_prefix": "off"}, {}, True, False, id="off-cuda"),
        pytest.param({"pack": False}, {}, True, False, id="auto-padded"),
        pytest.param({}, {"routing_replay": True}, True, False, id="auto-routing-replay"),
    ],
)
def test_shared_prefixes_are_on_by_default_on_cuda_where_they_apply(actor, train, on_gpu, shares):
    from molt._placement import shares_prefixes
    from molt.config import Config

    config = Config()
    config = msgspec.structs.replace(
        config,
        actor=msgspec.structs.replace(config.actor, **actor),
        train=msgspec.structs.replace(config.train, **train),
    )
    assert shares_prefixes(config, on_gpu=on_gpu) is shares


def test_shared_prefixes_are_refused_for_a_model_that_cannot_pack(tmp_path, tiny_model_dir):
    from transformers import Qwen3NextConfig

    from molt._checks_model import check_model
    from molt.config import ConfigError

    Qwen3NextConfig(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2).save_pretrained(
        tmp_path
    )
    config = _config(shared=True)
    with pytest.raises(ConfigError, match=r"--actor.shared_prefix .* cannot pack \(qwen3_next"):
        check_model(config, tmp_path)
    check_model(config, tiny_model_dir)  # a dense model packs


def _assert_each_row_alone(out_BTHD, lengths, window, q_BTHD, k_BTHD, v_BTHD) -> None:
    """Each row's attention output is what SDPA gives the row laid out alone (causal, in the window)."""
    for b, n in enumerate(lengths):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        mask = (j <= i) & (j > i - (window or n))
        q, k, v = (t[b : b + 1, :n].transpose(1, 2) for t in (q_BTHD, k_BTHD, v_BTHD))
        alone = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True
        )
        torch.testing.assert_close(out_BTHD[b, :n], alone[0].transpose(0, 1))
