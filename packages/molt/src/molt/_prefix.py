"""Shared prefixes in a packed micro-batch (`--actor.shared_prefix`): the tokens that several rows begin with
(a group's prompt, the earlier turns of a multi-turn episode's segments) go through the model once.

`prefix_groups` finds the rows of a micro-batch that begin with the same `MIN_SHARED_TOKENS` tokens or more;
`SharedPrefixRows` lays each such group out as a one-level tree, [prefix | row 1's continuation | row 2's
continuation | ...], and each row that shares nothing end to end, as `molt._packing.packed_rows` does.
Positions continue from the prefix in every continuation (the prefix 0..S-1, row b's continuation
S..n_b-1: a token's position is its column in its row), and `molt._packing.packed_attention` lets a
continuation see the prefix and its own earlier tokens, never a sibling's (`visible`: by position and
branch, -1 on the prefix, the row on its continuation). `unpack` reads row b's column j from the prefix
for j < S and from its continuation past it, so every per-token result is the row's alone.

The attention. On CUDA, one FlexAttention call over the whole packed row (`molt._flex`): the block masks
(`SharedPrefixRows.block_masks`, one per sliding window the model's layers use) are built once per
forward and travel to every layer's attention as a keyword argument, as the row bounds do; N is rounded
up as `packed_rows` rounds it, with a padding span that attends to itself only. On a CPU, where
FlexAttention has no backward, each group's span runs SDPA with a boolean [n, n] `tree_mask`.

The next token. A logprob in column j is read at position j - 1 with the row's own token j as target,
and the packed forward takes its targets from the packed tokens shifted by one (`tokens.roll(-1)` in
`molt._rank.ModelRank._model_outputs`, for `molt._lean.LogprobHead` and `shifted_logprobs` alike). The
shared prefix therefore stops ONE token short of the rows' common tokens: the token after it is the last
common one, the same in every row, and each continuation starts with it (repeated once per row). Every
position's packed next token is then each row's own next token, but at a continuation's last token (past
the row's end, never trained), and the first token a row has of its own is scored at its continuation's
first position, which sees the whole prefix.

Exact: each token is computed from the same tokens at the same positions as in its row alone, and the
gradient of a shared position is the sum of its rows' (computed once instead of once per row), so the
logprobs, entropies, values and the update equal the unshared ones to float rounding.

Not done: nested trees (rows that share more among a subset of a group share the group's prefix only).
Refused (`molt._validate`): routing replay, where the engine may have routed one prefix token differently
in each row, and a shared token has one route.

Legend: B rows, T tokens (columns), N packed tokens.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from molt._batch import to_device

MIN_SHARED_TOKENS = 16
"""Rows share a prefix only when it saves at least this many tokens a row: shorter common beginnings (a
chat template's first tokens) are not worth a tree mask."""


def prefix_groups(tokens_BT: torch.Tensor, lengths: Sequence[int]) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The rows as groups that share a prefix, each with the tokens its prefix holds: (rows, S), every row
    in one group; a row that shares nothing is a group of one with S = 0.

    Rows sorted by their tokens put those with a common beginning side by side; each joins the group
    before it when the group then still shares at least `MIN_SHARED_TOKENS` tokens and saves no fewer tokens
    than without it. S is the common tokens less one (module docstring: the next token)."""
    rows = [tokens_BT[b, :n].tolist() for b, n in enumerate(lengths)]
    groups: list[tuple[list[int], int]] = []  # (rows, the tokens they all begin with)
    for b in sorted(range(len(rows)), key=lambda b: rows[b]):
        if groups:
            members, common = groups[-1]
            # os.path.commonprefix compares lists element by element, as it does strings
            joined = min(common, len(os.path.commonprefix([rows[members[-1]], rows[b]])))
            saved = (len(members) - 1) * (common - 1)
            if joined - 1 >= MIN_SHARED_TOKENS and len(members) * (joined - 1) >= saved:
                groups[-1] = ([*members, b], joined)
                continue
        groups.append(([b], lengths[b]))
    return tuple((tuple(members), common - 1 if len(members) > 1 else 0) for members, common in groups)


def pad_multiple(num_tokens: int, most: int) -> int:
    """What a packed length of `num_tokens` is rounded up to a multiple of, `most` (a power of two) at the
    most: for a micro-batch of 32 x `most` tokens or more, `most`; for a shorter one, the largest power of
    two within 1/32 of its tokens (8 at least), so that the padding never takes more than 1/32 of the
    slots of a micro-batch of 256 tokens or more."""
    return min(most, 1 << max(3, (num_tokens // 32).bit_length() - 1))


@dataclass(frozen=True)
class SharedPrefixRows:
    """One micro-batch's rows as shared-prefix trees, end to end (module docstring). With groups of one
    row only, nothing is shared: the rows packed end to end (`molt._packing.packed_rows`)."""

    lengths: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], int], ...]
    """`prefix_groups`: (rows, S) per group, in packed order."""
    max_length: int
    """The longest span (group or padding): varlen attention's bound (`packed_rows` rounds it up)."""
    num_padding: int = 0
    """A padding span's tokens after the groups (on CUDA, to round N up as `packed_rows` does): it attends
    to itself only, and no row reads it."""
    windows: tuple[int | None, ...] = (None,)
    """The `sliding_window`s the model's attention layers pass (None: full attention): on CUDA, one
    block mask each (`block_masks`)."""

    @classmethod
    def of(
        cls,
        tokens_BT: torch.Tensor,
        lengths: Sequence[int],
        *,
        pad_to: int = 1,
        windows: Sequence[int | None] = (None,),
    ) -> SharedPrefixRows:
        """The layout of these rows, N rounded up to a multiple of `pad_multiple(N, pad_to)` (on CUDA,
        `pad_to` is `molt._packing.CUDA_PACK_MULTIPLE`)."""
        groups = prefix_groups(tokens_BT, lengths)
        spans = [sum(lengths[b] for b in members) - (len(members) - 1) * shared for members, shared in groups]
        num_padding = -sum(spans) % pad_multiple(sum(spans), pad_to)
        return cls(tuple(lengths), groups, max(*spans, num_padding), num_padding, tuple(windows))

    @functools.cached_property
    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Per packed token: its row (a prefix token: its group's first row; none for the padding, so
        N - num_padding of them), its position (its column in that row; 0.. on the padding), its branch
        (-1 on a prefix and on the padding, a prefix of its own; the row on a continuation); and where
        each span (a group, then the padding) starts, then N."""
        # Runs of consecutive packed tokens, (row, first column, column past the last, branch) each: a
        # group's prefix, each of its rows' continuations, then the padding (row -1, dropped below). Built
        # per run, not per token: a micro-batch holds tens of thousands of tokens, packed every step.
        runs, bounds = [], [0]
        for members, shared in self.groups:
            runs += [(members[0], 0, shared, -1), *((b, shared, self.lengths[b], b) for b in members)]
            bounds.append(bounds[-1] + shared + sum(self.lengths[b] - shared for b in members))
        if self.num_padding:
            runs.append((-1, 0, self.num_padding, -1))
            bounds.append(bounds[-1] + self.num_padding)
        row_R, start_R, stop_R, branch_R = torch.tensor(runs, dtype=torch.int64).reshape(-1, 4).unbind(1)
        sizes_R = stop_R - start_R
        offsets_R = torch.cumsum(sizes_R, 0) - sizes_R  # where each run begins in the packed row
        positions_N = torch.arange(bounds[-1]) - (offsets_R - start_R).repeat_interleave(sizes_R)
        rows_N = row_R.repeat_interleave(sizes_R)[: bounds[-1] - self.num_padding]
        return rows_N, positions_N, branch_R.repeat_interleave(sizes_R), bounds

    @property
    def num_packed(self) -> int:
        """N, the packed length, padding included."""
        return self._tokens[3][-1]

    @property
    def num_saved(self) -> int:
        """Token slots the shared prefixes saved: the rows' tokens less the packed ones."""
        return sum(self.lengths) - len(self._tokens[0])

    def pack(self, values_BT: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """[1, N, ...]: each group's prefix (from its first row), then each row's continuation, then
        `fill` on the padding."""
        rows_N, positions_N, _, _ = self._tokens
        padding = values_BT.new_full((self.num_padding, *values_BT.shape[2:]), fill)
        return torch.cat([values_BT[rows_N, positions_N[: len(rows_N)]], padding])[None]

    def model_kwargs(self, device: torch.device) -> dict:
        """The forward's keyword arguments: positions, the spans' bounds (attention never crosses one)
        and, where a prefix is shared, the tree within each, which `packed_attention` reads: on CUDA the
        block masks of `block_masks` (FlexAttention), on a CPU the positions and branches (`tree_mask`,
        SDPA). Rows that share nothing pass the bounds alone: varlen attention on CUDA. transformers passes
        them all to the attention function unchanged."""
        _, positions_N, branches_N, bounds = self._tokens
        cu_seqlens = to_device(torch.tensor(bounds, dtype=torch.int32), device)  # each span's start, then N
        kwargs = {
            "position_ids": to_device(positions_N[None], device),
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }
        if not self.num_saved:
            return kwargs
        if device.type == "cuda":
            return kwargs | {"tree_block_masks": self.block_masks(device)}
        return kwargs | {"tree_positions": positions_N.to(device), "tree_branches": branches_N.to(device)}

    def block_masks(self, device: torch.device) -> dict:
        """FlexAttention's block mask over the whole packed row for each of `windows`, by window: query q
        sees key k of its own span that `visible` allows. Built once a forward, before the layers (each
        layer's attention takes its window's); blocks of 128 x 128 that no query sees are skipped."""
        from molt._flex import create_block_mask

        _, positions_N, branches_N, bounds = self._tokens
        sizes = torch.tensor(bounds).diff()
        spans_N = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)
        positions_N, branches_N = positions_N.to(device), branches_N.to(device)

        def mask_mod_of(window: int | None):
            def mask_mod(b, h, q, k):
                seen = visible(positions_N[q], positions_N[k], branches_N[q], branches_N[k], window)
                return seen & (spans_N[q] == spans_N[k])

            return mask_mod

        n = self.num_packed
        return {w: create_block_mask(mask_mod_of(w), None, None, n, n, device=device) for w in self.windows}

    def _packed_index(self, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's column j's packed position [B, num_cols] (from its prefix, j < S, or its continuation),
        and whether the row has that column (j < n_b)."""
        rows_N, positions_N, _, _ = self._tokens  # a prefix's tokens are its group's first row's
        index_BT = torch.zeros(len(self.lengths), num_cols, dtype=torch.int64)
        index_BT[rows_N, positions_N[: len(rows_N)]] = torch.arange(len(rows_N))
        for members, shared in self.groups:
            index_BT[list(members[1:]), :shared] = index_BT[members[0], :shared]
        return index_BT, torch.arange(num_cols) < torch.tensor(self.lengths)[:, None]

    def positions_of(self, flags_BT: torch.Tensor) -> torch.Tensor:
        """The packed positions, ascending, that hold a column where `flags_BT` [B, T] is true: a prefix's
        where any row of its group is."""
        index_BT, valid_BT = self._packed_index(flags_BT.shape[1])
        return index_BT[flags_BT.bool() & valid_BT].unique()

    def unpack(self, values_1N: torch.Tensor, num_cols: int) -> torch.Tensor:
        """[B, num_cols, ...] from [1, N, ...]: row b's column j from its prefix (j < S) or its
        continuation, 0 past its n_b columns. A prefix value goes to every row of its group."""
        index_BT, valid_BT = self._packed_index(num_cols)
        gathered = values_1N[0][to_device(index_BT, values_1N.device)]
        valid = to_device(valid_BT.reshape(*valid_BT.shape, *([1] * (gathered.dim() - 2))), values_1N.device)
        return torch.where(valid, gathered, 0)


def visible(
    position_q: torch.Tensor,
    position_k: torch.Tensor,
    branch_q: torch.Tensor,
    branch_k: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """Whether query q sees key k of its own group: k is on the prefix or on q's own branch and not
    after q (by position), within the sliding window if any. Elementwise; `tree_mask` and FlexAttention's
    mask (`SharedPrefixRows.block_masks`) both ask it."""
    seen = (position_k <= position_q) & ((branch_k < 0) | (branch_k == branch_q))
    if sliding_window is not None:
        seen = seen & (position_k > position_q - sliding_window)
    return seen


def tree_mask(
    positions_n: torch.Tensor, branches_n: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[n, n] bool over one group's packed tokens, query by key: `visible`."""
    return visible(
        positions_n[:, None], positions_n[None], branches_n[:, None], branches_n[None], sliding_window
    )
