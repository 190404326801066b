"""One optimizer step's training data as CPU tensors, and how it is split over ranks and micro-batches.

A `TrainBatch` is what the trainer hands the policy actor: right-padded token rows with each row's
length, the loss mask (1 only where the engine sampled the token, DESIGN invariant 1), the engine's
logprob of each sampled token and each token's advantage. `num_tokens` and `num_seqs` are the counts
the ONE loss denominator of the step is made of (DESIGN §6, `molt._objective`): the trainable tokens and
the sequences (rows with a trainable token) of the whole window. Splitting a batch over ranks or
micro-batches (`select`, by the plan of `molt._packing`) keeps them unchanged, which is what makes the
update independent of the split. The padding here is the driver's bookkeeping only: the actor's forward
packs each micro-batch's rows without it (`molt._packing`).

Alignment: column t of every `_BT` tensor describes `tokens_BT[:, t]`; a logprob in column t is
log p(token t | tokens before t), so column 0 is never trainable. `shifted_logprobs` computes that from
logits of the full row by shifting the token ids (not by slicing the logits, which would copy them).

Lock-step: FSDP2 ranks run their forward passes in lock-step (every forward all-gathers), so every rank
runs the same number of micro-batches; one with no rows to compute (a batch smaller than the world, say)
runs `select([])`, one all-masked token 0 that adds nothing to any loss or metric.

Images (a vision-language policy): each row may carry `RowImages`, the pixel inputs of the images in
its token trace, made by the model's processor from the image bytes the engine saw (`with_images`),
and checked there against the engine's placeholder expansion. They travel with their row through
`select`; `model_inputs` turns a (micro-)batch's into the model's keyword arguments.

MoE routes (`--train.routing_replay`): `experts_BTLK` holds, per token, the experts the engine routed it
to in each decoder layer (`with_routes`, from the segments' routes); -1 where there is no route (the
last sampled token, right padding, empty turns), which leaves those tokens to the router.

Legend: B sequences, T tokens, V vocabulary, P image patches, I images, L decoder layers, K experts
per token.
"""

from __future__ import annotations

import base64
import io
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. A CPU tensor bound for a GPU goes through pinned memory without waiting: a
    plain copy from pageable memory waits for all the work queued on the GPU so far, so that a micro-batch's
    inputs, copied before its forward, would empty the GPU's queue at every micro-batch and leave the GPU
    idle while the host prepares the next (its pinned buffer stays with torch's host allocator until the
    copy is done)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class RowImages:
    """The images of one row, in token order, as the model's processor makes them."""

    pixel_values_PC: torch.Tensor
    """float32, the flattened patches of all the row's images."""
    grid_thw_I3: torch.Tensor
    """int64, each image's (time, height, width) patch grid."""
    spans: tuple[tuple[int, int], ...]
    """Each image's placeholder tokens in the row: (offset, length)."""


@dataclass(frozen=True)
class TrainBatch:
    """Rows of one optimizer step (or one rank's / micro-batch's share of them), all on the CPU."""

    tokens_BT: torch.Tensor
    """int64 token ids, right padded."""
    loss_mask_BT: torch.Tensor
    """float32, 1 where the engine sampled the token and it is trained; 0 at t = 0, on prompts and pads."""
    rollout_logp_BT: torch.Tensor
    """float32, the engine's logprob of token t when it sampled it; 0 where not trainable."""
    advantages_BT: torch.Tensor
    """float32, the rollout's advantage on each of its trainable tokens; 0 elsewhere."""
    num_tokens: int
    """Trainable tokens in the whole optimizer-step window (all ranks): token-mean's denominator."""
    num_seqs: int
    """Rows with a trainable token in the whole window (all ranks): the sequence means' denominator."""
    lengths_B: torch.Tensor
    """int64, each row's tokens (the rest of its columns are padding)."""
    images: tuple[RowImages | None, ...] = ()
    """Per row, its images (None: a row without any); empty for a text-only batch."""
    experts_BTLK: torch.Tensor | None = None
    """int16, the engine's MoE route of each token (module docstring); None without routing replay."""
    plan: tuple[tuple[int, ...], ...] = ()
    """This rank's micro-batches as row indices (`molt._packing.plan_micro_batches`, made by the group
    for all ranks at once); empty: planned by `micro_batches` for one rank."""
    lag_BT: torch.Tensor | None = None
    """float32, how many versions older than the trainer's (the weights that compute the old logprobs)
    were the weights that sampled token t (`with_lags`); 0 where not trainable. None: all 0. It splits
    the engine-vs-trainer mismatch from policy lag (`molt._objective.step_loss`)."""

    def __post_init__(self) -> None:
        shape = tuple(self.tokens_BT.shape)
        if self.tokens_BT.dim() != 2 or self.tokens_BT.dtype != torch.int64:
            raise ValueError(f"tokens_BT must be an int64 [B, T] tensor, got {self.tokens_BT.dtype} {shape}")
        for name in ("loss_mask_BT", "rollout_logp_BT", "advantages_BT", "lag_BT"):
            tensor = getattr(self, name)
            if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        if self.images and len(self.images) != shape[0]:
            raise ValueError(f"images must hold one entry per row ({shape[0]}), got {len(self.images)}")
        experts = self.experts_BTLK
        if experts is not None and (experts.dim() != 4 or tuple(experts.shape[:2]) != shape):
            raise ValueError(
                f"experts_BTLK must be [{shape[0]}, {shape[1]}, L, K], got {tuple(experts.shape)}"
            )
        if self.lengths_B.shape != (shape[0],) or bool((self.lengths_B > shape[1]).any()):
            raise ValueError(f"lengths_B must hold one length <= {shape[1]} per row ({shape[0]})")

    @property
    def num_rows(self) -> int:
        return self.tokens_BT.shape[0]

    @property
    def row_lengths(self) -> list[int]:
        """Each row's number of tokens."""
        return self.lengths_B.tolist()

    def select(self, rows: Sequence[int]) -> TrainBatch:
        """Rows `rows`, in that order, with the columns their longest needs (no plan, the same
        `num_tokens` and `num_seqs`). No rows: one row of one all-masked token 0, which adds nothing to any
        loss or metric, for a rank or micro-batch that must run a forward in lock-step with the others."""
        lengths = self.lengths_B[list(rows)].tolist() or [1]
        num_cols = max(lengths)
        tensors: dict[str, Any] = {  # by field name (mypy cannot check a ** dict against each field)
            f.name: _cut(tensor, rows, num_cols)
            for f in fields(self)
            if f.name.endswith("_BT") and (tensor := getattr(self, f.name)) is not None
        }
        return TrainBatch(
            **tensors,
            num_tokens=self.num_tokens,
            num_seqs=self.num_seqs,
            images=(tuple(self.images[row] for row in rows) or (None,)) if self.images else (),
            experts_BTLK=None if self.experts_BTLK is None else _cut(self.experts_BTLK, rows, num_cols, -1),
            lengths_B=torch.tensor(lengths, dtype=torch.int64),
        )

    def check_step(self, inputs: StepInputs) -> None:
        """Refuse an optimizer step over these rows that has no trainable token, or is given a per-row
        input of another shape than theirs; the policy's and the critic's groups check here, before the
        rows are split over ranks."""
        for name, tensor in inputs.given().items():
            if tensor.shape != self.tokens_BT.shape:
                raise ValueError(f"{name} must be {tuple(self.tokens_BT.shape)}, got {tuple(tensor.shape)}")
        if self.num_tokens < 1:
            raise ValueError("train_step needs a batch with at least one trainable token (num_tokens >= 1)")

    def micro_batches(self, budget: int, *, packed: bool = True) -> list[list[int]]:
        """This batch's micro-batches as row indices: its `plan`, or planned here for one rank within
        `budget` tokens (`molt._packing.plan_micro_batches`)."""
        from molt._packing import plan_micro_batches

        if self.plan:
            return [list(rows) for rows in self.plan]
        return plan_micro_batches(self.row_lengths, num_ranks=1, budget=budget, packed=packed)[0]

    def windows(
        self, count: int, rows_per_rollout: Sequence[int], seed: Sequence[int]
    ) -> list[tuple[TrainBatch, list[int]]]:
        """The batch as `count` optimizer-step windows (`window_rows`), each with its rows."""
        return [(self.window(rows), rows) for rows in window_rows(count, rows_per_rollout, seed)]

    def window(self, rows: Sequence[int]) -> TrainBatch:
        """Rows `rows` as one optimizer step's batch, with its OWN counts (its trainable tokens and
        sequences: each window is one step's mean)."""
        window = self.select(rows)
        trainable_B = (window.loss_mask_BT != 0).any(dim=1)
        num_tokens, num_seqs = int((window.loss_mask_BT != 0).sum()), int(trainable_B.sum())
        return replace(window, num_tokens=num_tokens, num_seqs=num_seqs)

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The vision-language model's extra forward arguments for these rows ({} without images):
        the patches and grids of every image in row order, and `mm_token_type_ids` (1 on the image
        placeholders) from which transformers' Qwen-VL models compute their M-RoPE positions."""
        rows = [(row, images) for row, images in enumerate(self.images) if images is not None]
        if not rows:
            return {}
        token_type_BT = torch.zeros_like(self.tokens_BT)
        for row, images in rows:
            for offset, length in images.spans:
                token_type_BT[row, offset : offset + length] = 1
        return {
            "pixel_values": to_device(torch.cat([images.pixel_values_PC for _, images in rows]), device),
            "image_grid_thw": to_device(torch.cat([images.grid_thw_I3 for _, images in rows]), device),
            "mm_token_type_ids": to_device(token_type_BT, device),
        }


def window_rows(count: int, rows_per_rollout: Sequence[int], seed: Sequence[int]) -> list[list[int]]:
    """A batch's rows as `count` optimizer-step windows (`--train.mini_batches`), to cut [B, T] tensors by.

    A window holds whole rollouts (`rows_per_rollout`: consecutive rows per rollout, a compacted episode's
    segments), drawn by a permutation seeded by `seed` (the run's seed and the step): not in completion
    order, where window 1 (ratio 1, never clipped) would always hold the groups that finished first, the
    short ones, and the trust region would act on the long ones only. A batch of fewer rollouts than
    `count` (a used-up dataset's last) gets one window per rollout."""
    num_rollouts = len(rows_per_rollout)
    count = min(count, num_rollouts)
    starts = [0, *itertools.accumulate(rows_per_rollout)]
    order = random.Random(repr(tuple(seed))).sample(range(num_rollouts), num_rollouts)
    bounds = [round(i * num_rollouts / count) for i in range(count + 1)]
    return [
        [row for r in order[start:stop] for row in range(starts[r], starts[r + 1])]
        for start, stop in itertools.pairwise(bounds)
    ]


@dataclass(frozen=True)
class StepInputs:
    """The [B, T] tensors an optimizer step reads beside its `TrainBatch`, by name; None where the run has
    none. Adding an input is a field here and the loss code that reads it: the groups, the loop and the
    workers cut and pass the whole structure."""

    old_logp_BT: torch.Tensor | None = None  # the policy before the batch's first step (the ratio's base)
    ref_logp_BT: torch.Tensor | None = None  # the frozen reference policy's (the KL loss term)
    old_values_BT: torch.Tensor | None = None  # the critic's values before its step (value clipping)
    returns_BT: torch.Tensor | None = None  # the critic's targets (gae)

    def given(self) -> dict[str, torch.Tensor]:
        """The inputs that are set, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def rows(self, rows: Sequence[int], num_cols: int) -> StepInputs:
        """These inputs for `rows` of the batch, cut to `num_cols` columns, as `TrainBatch.select` cuts the
        batch's own; no rows: one zero row (its empty turn)."""
        return StepInputs(**{name: _cut(t, rows, num_cols) for name, t in self.given().items()})


def _cut(tensor: torch.Tensor, rows: Sequence[int], num_cols: int, fill: int = 0) -> torch.Tensor:
    """`rows` of a [B, T, ...] tensor, `num_cols` columns; no rows: one token of `fill` (an empty turn)."""
    return tensor[list(rows), :num_cols] if rows else tensor.new_full((1, 1, *tensor.shape[2:]), fill)


NO_INPUTS = StepInputs()  # a step that reads none (frozen: one shared default)


def collate(sequences: Sequence[tuple[list[int], list[int], list[float], float]], pad_id: int) -> TrainBatch:
    """A right-padded `TrainBatch` from `(token_ids, loss_mask, logprobs, advantage)` per sequence.

    `loss_mask[t]` is 1 where the engine sampled `token_ids[t]`, and `logprobs[t]` is the engine's
    logprob of it (ignored where the mask is 0). The advantage is broadcast to the sequence's trainable
    tokens. The first token of a sequence has no prefix to be sampled from, so it cannot be trainable.
    """
    if not sequences:
        raise ValueError("collate needs at least one sequence")
    num_cols = max(len(token_ids) for token_ids, *_ in sequences)
    tokens_BT = torch.full((len(sequences), num_cols), pad_id, dtype=torch.int64)
    mask_BT, logp_BT, adv_BT = (torch.zeros(len(sequences), num_cols) for _ in range(3))
    for row, (token_ids, loss_mask, logprobs, advantage) in enumerate(sequences):
        if not len(token_ids) == len(loss_mask) == len(logprobs):
            raise ValueError(
                f"sequence {row}: token_ids, loss_mask and logprobs must have one entry per token, got "
                f"{len(token_ids)}, {len(loss_mask)} and {len(logprobs)}"
            )
        if loss_mask and loss_mask[0]:
            raise ValueError(f"sequence {row}: the first token has no prefix, so loss_mask[0] must be 0")
        num = len(token_ids)
        tokens_BT[row, :num] = torch.tensor(token_ids, dtype=torch.int64)
        mask_BT[row, :num] = torch.tensor(loss_mask, dtype=torch.float32) != 0
        logp_BT[row, :num] = torch.tensor(logprobs, dtype=torch.float32) * mask_BT[row, :num]
        adv_BT[row, :num] = float(advantage) * mask_BT[row, :num]
    lengths_B = torch.tensor([len(token_ids) for token_ids, *_ in sequences], dtype=torch.int64)
    num_tokens, num_seqs = int(mask_BT.sum()), int((mask_BT != 0).any(dim=1).sum())
    return TrainBatch(tokens_BT, mask_BT, logp_BT, adv_BT, num_tokens, num_seqs, lengths_B)


def row_images(spans: list, processor) -> RowImages | None:
    """One row's pixel inputs from its trajectory's image spans (tito `ImageSpan`s: offset, length,
    data URL), made by the model's image processor from the bytes the engine was sent.

    The trainer-side expansion check: each image's patch grid must give exactly the number of
    placeholder tokens the engine expanded it to (recorded in the span); a difference would feed the
    model a different token layout from the one the engine sampled with.
    """
    if not spans:
        return None
    from PIL import Image

    # tito records every image as a base64 data URL of the bytes it sent the engine.
    data = [base64.b64decode(span.data_url.split(",", 1)[1]) for span in spans]
    pictures = [Image.open(io.BytesIO(image)).convert("RGB") for image in data]
    processed = processor.image_processor(images=pictures, return_tensors="pt")
    grid_thw_I3 = processed["image_grid_thw"].to(torch.int64)
    ours = (grid_thw_I3.prod(dim=-1) // processor.image_processor.merge_size**2).tolist()
    engines = [span.length for span in spans]
    if ours != engines:
        raise RuntimeError(
            f"the trainer's processor expands these images to {ours} tokens, the engine expanded them to "
            f"{engines}: the trainer and the engines must load the same model directory"
        )
    spans_tuple = tuple((span.offset, span.length) for span in spans)
    return RowImages(processed["pixel_values"].to(torch.float32), grid_thw_I3, spans_tuple)


def with_images(batch: TrainBatch, images_per_row: list[list], processor) -> TrainBatch:
    """`batch` with each row's `RowImages` (`row_images`); `images_per_row` holds each row's spans."""
    return replace(batch, images=tuple(row_images(spans, processor) for spans in images_per_row))


def with_lags(batch: TrainBatch, versions_per_row: list[list[int]], trainer_version: int) -> TrainBatch:
    """`batch` with `lag_BT`: `trainer_version` minus the weight version that sampled each trainable token
    (`versions_per_row`: each row's per-token versions, tito's `Segment.versions`), 0 elsewhere."""
    lag_BT = torch.zeros(batch.tokens_BT.shape)
    for row, versions in enumerate(versions_per_row):
        lag_BT[row, : len(versions)] = trainer_version - torch.tensor(versions, dtype=torch.float32)
    return replace(batch, lag_BT=lag_BT * (batch.loss_mask_BT != 0))


def with_routes(batch: TrainBatch, routes_per_row: list) -> TrainBatch:
    """`batch` with `experts_BTLK` from each row's routes (`tito.Segment.routes()`: the experts of the
    row's first n tokens, `(n, L, K)`); -1 past them."""
    if missing := [row for row, routes in enumerate(routes_per_row) if routes is None]:
        raise RuntimeError(
            f"rows {missing} have no MoE routes: their engine returned none (vLLM returns them when started "
            "with --enable-return-routed-experts, as molt starts its engines under --train.routing_replay; "
            "engines given by --vllm.urls need that flag)"
        )
    shapes = {tuple(routes.shape[1:]) for routes in routes_per_row}
    if len(shapes) != 1:
        raise ValueError(f"the rows' routes differ in (layers, top_k): {sorted(shapes)}")
    experts_BTLK = torch.full((*batch.tokens_BT.shape, *shapes.pop()), -1, dtype=torch.int16)
    for row, routes in enumerate(routes_per_row):  # a row's routes are of its tokens: never past its columns
        experts_BTLK[row, : len(routes)] = torch.from_numpy(routes.astype("int16"))
    return replace(batch, experts_BTLK=experts_BTLK)


def shifted_logprobs(
    logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """log softmax(logits / temperature) of token t given the tokens before it, in column t: [B, T] float32.

    `logits_BTV[:, t]` predicts token t + 1, so the token ids are shifted left (a [B, T] copy) rather than
    the logits sliced (a [B, T, V] copy, see `rlestimators.token_logprobs`); the [B, T] result is then
    shifted right. Column 0 has no prediction and holds 0.
    """
    from rlestimators import token_logprobs

    next_tokens_BT = tokens_BT.roll(-1, dims=1)  # the last column wraps around; its result is dropped
    logp_next_BT = token_logprobs(logits_BTV, next_tokens_BT, temperature=temperature)
    return torch.nn.functional.pad(logp_next_BT[:, :-1], (1, 0))
