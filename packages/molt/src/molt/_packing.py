"""Packed micro-batches: the actor's rows laid end to end without padding, attention kept inside each row.

Agent batches hold rows of very different lengths (a 40-token refusal beside a 15k-token tool episode);
right-padded to the longest, most of the actor's token slots would be padding. Every pass over a batch
(the old logprobs, the reference, the teacher, the critic's values, the step) instead runs micro-batches
planned here:

- `plan_micro_batches` puts rows into micro-batches of at most `--actor.micro_batch_tokens` tokens and
  deals them to the data-parallel ranks: every rank gets the same number (FSDP2 runs them in lock-step),
  and the micro-batches that run side by side cost about the same (length plus the quadratic attention
  term, `row_cost`).
- `packed_rows` lays one micro-batch's rows end to end as one row of N tokens: positions restart at 0 for
  each row, and `packed_attention` (registered with transformers' attention interface as "molt_packed")
  attends within each row only: `torch.nn.attention.varlen.varlen_attn` (flash varlen) on CUDA in 16-bit,
  causal SDPA per row otherwise (a CPU, float32). No [N, N] mask is built. The per-token results come
  back as [rows, T] tensors (`unpack`), so the loss, the correction and every metric see exactly the rows
  they saw padded. With --actor.shared_prefix, `molt._prefix.SharedPrefixRows` lays rows that begin
  alike out as trees, and `packed_attention` attends by their masks: FlexAttention on CUDA, SDPA with a
  boolean mask per group on a CPU.
- A model whose layers would mix packed rows (recurrent and linear-attention hybrids carry state from one
  token to the next across the boundary) or whose positions are not one row's 0..n-1 (a vision-language
  model's M-RoPE) is not packed (`packing_refusal`): its micro-batches are padded, grouped by length
  under the same token budget (padded slots counted), and the run says why once.

On CUDA the packed length is rounded up (a padding row no real row attends to) to a multiple of
`CUDA_PACK_MULTIPLE`, or of less for a short micro-batch (`molt._prefix.pad_multiple`: padding stays under
1/32 of its slots), and the longest row up to a power of two, so compiled layers see few distinct shapes.

Legend: B rows, T tokens (columns), N packed tokens, H heads, D head dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from molt._prefix import SharedPrefixRows, pad_multiple, tree_mask

ATTENTION = "molt_packed"  # its name in transformers' AttentionInterface
CUDA_PACK_MULTIPLE = 256
Together = Sequence[tuple[Sequence[int], int]]
"""Groups of rows that share a prefix, each with the tokens its prefix holds: (rows, S)
(`molt._prefix.prefix_groups`)."""
ATTENTION_TOKENS = 8192
"""`row_cost`'s quadratic scale: at about this length a row's attention costs what its linear layers do
(a 1-2B model: 2 x layers x hidden x n attention FLOPs per token against 2 x parameters)."""


def row_cost(length: int) -> float:
    """The compute a row of `length` tokens costs, in tokens: its linear layers plus its attention."""
    return length + length * length / ATTENTION_TOKENS


class _Unit(NamedTuple):
    """Rows a micro-batch takes whole: their token slots (a shared prefix once) and compute cost."""

    rows: list[int]
    tokens: int
    cost: float


def _unit(rows: list[int], lengths: Sequence[int], shared: int = 0) -> _Unit:
    """`rows` as one unit; `shared`: the prefix tokens they all begin with, computed once (`molt._prefix`),
    which saves every row but the first its prefix's tokens and their cost."""
    saved = len(rows) - 1
    tokens = sum(lengths[r] for r in rows) - saved * shared
    return _Unit(rows, tokens, sum(row_cost(lengths[r]) for r in rows) - saved * row_cost(shared))


def _fill(units: list[_Unit], lengths: Sequence[int], num_bins: int, budget: int, packed: bool):
    """Units of rows (longest first) into `num_bins` micro-batches: each unit into the cheapest one it
    fits in; None if one fits nowhere. Returns each micro-batch's rows and cost."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    tokens, costs = [0] * num_bins, [0.0] * num_bins
    for unit in units:
        if packed:
            fitting = [b for b in range(num_bins) if tokens[b] + unit.tokens <= budget]
        else:  # padded: a micro-batch's token slots are its rows x the longest
            joined = [[lengths[r] for r in (*bins[b], *unit.rows)] for b in range(num_bins)]
            fitting = [b for b in range(num_bins) if len(joined[b]) * max(joined[b]) <= budget]
        if not fitting:
            return None
        best = min(fitting, key=lambda b: costs[b])
        bins[best] += unit.rows
        tokens[best] += unit.tokens
        costs[best] += unit.cost
    return list(zip(bins, costs, strict=True))


def _fewest_bins(
    lengths: Sequence[int], together: Together, num_ranks: int, budget: int, packed: bool
) -> list[tuple[list[int], float]]:
    """The rows in the fewest micro-batches per rank (a multiple of `num_ranks` in all) that `_fill`
    places them in within `budget`: each micro-batch's rows and cost.

    `_fill` takes the rows as units a micro-batch takes whole, largest first: each of `together` (rows,
    the prefix tokens they share) in pieces that fit the budget, each piece with its prefix once, and
    every other row alone; rows of zero length left out."""
    grouped = {row for rows, _ in together for row in rows}
    units = [_unit([row], lengths) for row, n in enumerate(lengths) if n > 0 and row not in grouped]
    for rows, shared in together:
        piece: list[int] = []
        for row in rows:
            if piece and _unit([*piece, row], lengths, shared).tokens > budget:
                units.append(_unit(piece, lengths, shared))
                piece = []
            piece.append(row)
        units += [_unit(piece, lengths, shared)] if piece else []
    units.sort(key=lambda unit: -unit.tokens)
    per_rank = max(1, -(-sum(unit.tokens for unit in units) // (budget * num_ranks)))  # the fewest possible
    while (bins := _fill(units, lengths, per_rank * num_ranks, budget, packed)) is None:
        per_rank += 1
    return bins


def plan_micro_batches(
    lengths: Sequence[int], *, num_ranks: int, budget: int, packed: bool = True, together: Together = ()
) -> list[list[list[int]]]:
    """Row indices per rank, per micro-batch: every rank the same number of micro-batches (some may be
    empty), each within `budget` (packed: the rows' tokens; padded: rows x the longest), as few as the
    budget allows, the ones each rank runs at the same point of about the same cost.

    Rows are placed longest first into the cheapest micro-batch they fit in, over the fewest micro-batches
    per rank for which that places every row; the micro-batches, by cost, are then dealt to the ranks in
    snake order (0, 1, .., R-1, R-1, .., 0), so the i-th micro-batches of the ranks are neighbours by cost.
    Each group of rows in `together` (rows, S: rows that share a prefix of S tokens, `molt._prefix`) is
    placed as one, its prefix's tokens counted once, and split only where it passes the budget (each
    piece then holds the prefix once). Peak memory follows the fullest micro-batch's token slots, so where
    it takes no more micro-batches, the rows are placed as if the budget were the fullest micro-batch that
    packing them without sharing would fill: sharing then never raises the peak. Rows of zero length (none
    to compute) are left out. A row longer than `budget` is refused: the run checks the budget against
    --vllm.max_model_len before it starts.
    """
    if max(lengths, default=0) > budget:
        raise ValueError(f"rows of {max(lengths)} tokens do not fit a micro-batch budget of {budget} tokens")
    bins = _fewest_bins(lengths, together, num_ranks, budget, packed)
    if together:
        alone = _fewest_bins(lengths, (), num_ranks, budget, packed)
        fullest = max(sum(lengths[row] for row in rows) for rows, _ in alone)
        if 0 < fullest < budget:
            capped = _fewest_bins(lengths, together, num_ranks, fullest, packed)
            bins = capped if len(capped) <= len(bins) else bins
    bins.sort(key=lambda placed: -placed[1])
    plan: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    for index, (rows, _) in enumerate(bins):
        lap, seat = divmod(index, num_ranks)
        plan[seat if lap % 2 == 0 else num_ranks - 1 - seat].append(sorted(rows))
    return plan


def packed_rows(lengths: Sequence[int], *, cuda: bool) -> SharedPrefixRows:
    """One micro-batch's rows end to end, sharing nothing (`SharedPrefixRows` of one-row groups): row b's
    tokens at packed positions starts[b] .. starts[b] + n_b, then (on CUDA) a padding row to a multiple
    of `pad_multiple(N, CUDA_PACK_MULTIPLE)`, and the longest row, varlen attention's bound, rounded up to
    a power of two (module docstring)."""
    groups = tuple(((b,), 0) for b in range(len(lengths)))
    if not cuda:
        return SharedPrefixRows(tuple(lengths), groups, max(lengths))
    num_padding = -sum(lengths) % pad_multiple(sum(lengths), CUDA_PACK_MULTIPLE)
    max_length = max(1 << (max(lengths) - 1).bit_length(), num_padding)
    return SharedPrefixRows(tuple(lengths), groups, max_length, num_padding)


def packed_attention(
    module: torch.nn.Module,
    q_1HND: torch.Tensor,
    k_1HND: torch.Tensor,
    v_1HND: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    tree_positions: torch.Tensor | None = None,
    tree_branches: torch.Tensor | None = None,
    tree_block_masks: dict | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract ([B, H, N, D] in, [B, N, H, D] out) over one packed row:
    causal attention within each row of `cu_seq_lens_q`, never across. Shared prefixes (`molt._prefix`):
    with `tree_block_masks` (CUDA), one compiled FlexAttention call over the whole row by this layer's
    window's block mask; with `tree_branches` (a CPU), a span that holds a tree attends by its mask, SDPA.
    Without row bounds (an unpacked forward of the same model) it is transformers' SDPA, causal over
    right-padded rows."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, q_1HND, k_1HND, v_1HND, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    assert q_1HND.shape[0] == 1 and dropout == 0.0, "packed attention runs one row, without dropout"
    if tree_block_masks is not None:
        from molt._flex import flex_attention

        assert sliding_window in tree_block_masks, f"no block mask for a window of {sliding_window}"
        block_mask = tree_block_masks[sliding_window]
        out_1HND = flex_attention(
            q_1HND, k_1HND, v_1HND, block_mask=block_mask, scale=scaling, enable_gqa=True
        )
        assert isinstance(out_1HND, torch.Tensor)  # no auxiliary outputs asked for
        return out_1HND.transpose(1, 2).contiguous(), None
    if q_1HND.is_cuda and q_1HND.dtype in (torch.bfloat16, torch.float16):  # flash takes 16-bit only
        from torch.nn.attention.varlen import varlen_attn

        q_NHD, k_NHD, v_NHD = (t[0].transpose(0, 1) for t in (q_1HND, k_1HND, v_1HND))
        window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
        assert max_length_q is not None  # the packed rows' kwargs carry it with the row bounds
        # the rows' bounds (int32, `SharedPrefixRows.model_kwargs`) and the longest row, of the queries and
        # of the keys: the same rows
        bounds = (cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q)
        out_NHD = varlen_attn(q_NHD, k_NHD, v_NHD, *bounds, scale=scaling, window_size=window)
        assert isinstance(out_NHD, torch.Tensor)  # no logsumexp asked for
        return out_NHD[None], None
    outs, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    for start, stop in itertools.pairwise(cu_seq_lens_q.tolist()):
        q, k, v = (t[:, :, start:stop] for t in (q_1HND, k_1HND, v_1HND))
        mask = None
        if tree_branches is not None and bool((tree_branches[start:stop] < 0).any()):  # a prefix, its rows
            assert tree_positions is not None  # `SharedPrefixRows.model_kwargs` gives both
            mask = tree_mask(tree_positions[start:stop], tree_branches[start:stop], sliding_window)
        elif sliding_window is not None:  # causal in the window: a tree of one branch, without a prefix
            span = torch.arange(stop - start)
            mask = tree_mask(span, torch.zeros_like(span), sliding_window).to(q.device)
        outs.append(sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


# Model types whose layers carry state from token to token (state-space, recurrent and linear-attention
# layers): packed, a row would start from the state the previous row left.
_RECURRENT = (
    "mamba", "jamba", "zamba", "bamba", "falcon_h1", "lfm2", "rwkv", "recurrent_gemma", "next", "hybrid",
)  # fmt: skip
_RECURRENT_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "ssm")


def packing_refusal(model_config) -> str | None:
    """Why rows of this model (a transformers config) cannot be packed, or None if they can."""
    model_type = getattr(model_config, "model_type", "")
    if hasattr(model_config, "vision_config"):
        return (
            f"{model_type} is a vision-language model: its M-RoPE positions follow each row's images, "
            "which packed positions would not"
        )
    text = getattr(model_config, "text_config", None) or model_config
    layer_types = set(getattr(text, "layer_types", None) or ())
    recurrent = sorted(t for t in layer_types if any(word in t for word in _RECURRENT_LAYERS))
    if recurrent or any(word in model_type for word in _RECURRENT):
        layers = f" ({', '.join(recurrent)} layers)" if recurrent else ""
        return (
            f"{model_type}{layers} carries state from token to token: a packed row would start from the "
            "state its neighbour left"
        )
    return None


def attention_windows(model_config) -> tuple[int | None, ...]:
    """The `sliding_window`s this model's attention layers may pass `packed_attention`: None (full
    attention), and the config's window where it sets one (transformers' configs leave it None when no
    layer slides, as Qwen3's does without `use_sliding_window`)."""
    text = getattr(model_config, "text_config", None) or model_config
    window = getattr(text, "sliding_window", None)
    return (None,) if window is None else (None, window)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Register `packed_attention` with transformers and make `model` use it (its unpacked forwards
    stay SDPA's); called once a model that packs is loaded."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    config: Any = model.config  # a transformers config
    config._attn_implementation = ATTENTION  # the attention layers read it at each call


def auto_micro_batch_tokens(
    model_config, *, free_bytes: float, dtype_bytes: int, checkpointing: bool, at_least: int
) -> int:
    """--actor.micro_batch_tokens 0: the tokens whose activations fit in `free_bytes`, a multiple of
    1024, at least `at_least` (the longest row) and at most 65,536.

    A token keeps, per decoder layer, about 3 x intermediate + 8 x hidden values for the backward (the
    attention's inputs and outputs, the MLP's two projections that `molt._lean.LeanMLP` keeps, its down
    projection's input): 1.7 MiB a token for a Qwen3-1.7B in bfloat16, as measured. With activation
    checkpointing, a layer's input alone (one layer's full set is rebuilt at a time).
    """
    text = getattr(model_config, "text_config", None) or model_config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    per_layer = 3 * intermediate + 8 * hidden
    values = hidden * layers + per_layer if checkpointing else per_layer * layers
    tokens = int(free_bytes // (values * dtype_bytes)) // 1024 * 1024
    return max(at_least, min(tokens, 65536))


# Dense bfloat16 peak of the GPUs `actor/mfu` is reported for (the vendors' figures, FLOP/s).
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def model_flops(lengths: Sequence[int], model_config, num_params: int, *, backward: bool) -> float:
    """Model FLOPs of a pass over rows of `lengths`: per token 2 x the matmul parameters, plus causal
    attention's 2 x n x (heads x head dim) per layer for a row of n; x 3 with the backward."""
    text = getattr(model_config, "text_config", None) or model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    q_dim = text.num_attention_heads * head_dim
    forward = sum(n * (2 * num_params + 2 * text.num_hidden_layers * n * q_dim) for n in lengths)
    return 3 * forward if backward else forward
