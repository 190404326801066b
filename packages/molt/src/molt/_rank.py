"""One rank of a trained model's FSDP2 group: `ModelRank`, what the policy's worker (`molt._actor`) and the
critic's (`molt._critic`) share. Neither is built on the other.

A rank joins the group's process group (gloo on CPU, NCCL on GPU), loads its shard of the model (NeMo
AutoModel + FSDP2; each kind loads its own), sizes its micro-batch token budget, holds its AdamW state,
runs its rows of a `TrainBatch` through the model micro-batch by micro-batch, steps the optimizer and
writes and reads its part of a checkpoint. The group plans the rows' micro-batches for all ranks
(`molt._packing.plan_micro_batches`: a token budget, balanced by cost). Each micro-batch's rows go through
the model packed end to end (`molt._packing.packed_rows`, attention within each row) and come back as
[B, T] per-row tensors, so the loss sees the rows exactly as it would padded; a model that cannot pack
runs them padded. With --actor.shared_prefix, rows that begin alike share those tokens' computation
(`molt._prefix.SharedPrefixRows`, the same results per row; FlexAttention on CUDA, SDPA on a CPU). Every
pass counts its tokens, token slots, the slots shared prefixes saved, model FLOPs and seconds, and the
graphs torch.compile built meanwhile (`take_pass_counts`: `actor/padding_frac`, `actor/shared_prefix_frac`,
`actor/tokens_per_s`, `actor/mfu`, `actor/compiles`).

Loss normalisation (DESIGN §6, paper §3.6): a kind's loss on each micro-batch is divided by the ONE
denominator of the whole step on all ranks; with FSDP's gradient averaging undone
(`molt._sharding.sum_gradients_over_ranks`), the summed gradient is the gradient of the step's loss, so
the update does not depend on the number of ranks or micro-batches (`_micro_batch_sums`).

Parallelism (`--fsdp.*`): the ranks form AutoModel's mesh DP x CP x TP (rank = (dp * cp + c) * tp + t),
with EP groups carved out of them. Rows are sharded by the data-parallel coordinate: the TP ranks of one
DP group see the same rows, and their identical metric sums are counted once. The sizes were checked by
`molt._validate` before the run started (no context parallelism; data parallelism only on a CPU).

Legend: B sequences, T tokens, X a head's outputs.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from molt._batch import StepInputs, TrainBatch, to_device
from molt._checkpoint import load_actor, save_actor
from molt._lean import LogprobHead
from molt._log import redirect_output
from molt._packing import (
    BF16_PEAK,
    CUDA_PACK_MULTIPLE,
    attention_windows,
    auto_micro_batch_tokens,
    model_flops,
    packed_rows,
    packing_refusal,
    use_packed_attention,
)
from molt._placement import actor_free_bytes, shares_prefixes
from molt._prefix import SharedPrefixRows
from molt._sharding import (
    ShardAdamW,
    compute_dtype,
    freeze_moe_routers,
    holds_cast_weights,
    params_by_mesh,
    reshard_all,
    sum_gradients_over_ranks,
)
from molt.config import Config, LoRA


class ModelRank:
    """One rank of an FSDP2 model group; a plain class (its group wraps a kind of it with `ray.remote`).
    `trainable=False`: a frozen copy that only runs forwards (no optimizer)."""

    checkpoint_dir = ""  # the kind's directory in a checkpoint
    # The LoRA config of a kind that trains adapters only: its checkpoint holds them alone.
    lora: LoRA | None = None

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_dir: str,
        config: Config,
        trainable: bool = True,
        log_path: str = "",
        engines_loading: list | None = None,
    ) -> None:
        if log_path:  # this rank's third-party output (AutoModel's warnings, weight loading) goes there
            redirect_output(log_path)
        on_gpu = torch.cuda.is_available()
        self.rank, self.config = rank, config
        # the run's engines as they load (Ray refs, ready once each answers): a kind's set-up that only
        # fills their loading time (the policy's compile warm-up) stops once they are up; None: no engines
        self.engines_loading = engines_loading
        if on_gpu:
            torch.cuda.set_device(0)  # Ray shows each worker its one GPU as device 0
        self.device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        url = f"tcp://{master_addr}:{master_port}"
        begun = time.monotonic()
        dist.init_process_group(
            "nccl" if on_gpu else "gloo", init_method=url, rank=rank, world_size=world_size
        )
        self.model = self._load(str(model_dir), world_size, trainable)
        # --actor.pack: each micro-batch's rows end to end, attention within each (`molt._packing`); a
        # model that cannot pack runs padded micro-batches.
        self.packed = config.actor.pack and packing_refusal(self.model.config) is None
        if self.packed:
            use_packed_attention(self.model)
        # --actor.shared_prefix (`_layout`)
        self.shared_prefix = self.packed and shares_prefixes(config, on_gpu=self.device.type == "cuda")
        self.windows = attention_windows(self.model.config)  # a tree's block masks, one per window
        # since the last report; "saved": the token slots shared prefixes saved
        self.passes = dict.fromkeys(("slots", "tokens", "saved", "flops", "seconds"), 0.0)
        self.graphs_seen = compiled_graphs()
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.budget = self._token_budget(trainable)
        head = self.model.get_output_embeddings()  # a policy's, swapped in at load (`molt._lean`)
        self._logprob_head = head if isinstance(head, LogprobHead) else None
        self.optimizer = self.scheduler = None
        if trainable:
            self.model.train()
            sum_gradients_over_ranks(self.model)
            if config.actor.freeze_moe_router:
                freeze_moe_routers(self.model)
            actor, lr = config.actor, self._learning_rate()
            groups = [{"params": p} for p in params_by_mesh(self.model)]  # a fused step never mixes meshes
            # fused: one kernel over a group's tensors (CUDA and CPU), as transformers' default AdamW;
            # torch's default dispatches each of a dozen ops per step through DTensor, or on a CPU one
            # tensor at a time (333 small sharded parameters on the 2-core CPU: 105 ms, 13 ms fused), and
            # over the local shards (`ShardAdamW`), without DTensor's dispatch of every tensor.
            self.optimizer = ShardAdamW(groups, lr=lr, weight_decay=actor.weight_decay, fused=True)
            # Linear warm-up: step s (from 0) runs at lr * (s + 1) / warmup_steps until it reaches lr.
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: min(1.0, (step + 1) / max(1, actor.warmup_steps))
            )
        else:
            self.model.requires_grad_(False).eval()
        loaded = time.monotonic()
        self._ready()
        # `startup_seconds`: the group joined and the shard loaded, then the kind's own set-up
        self.startup = {"load": loaded - begun, "warm_up": time.monotonic() - loaded}

    def _ready(self) -> None:
        """A kind's own set-up, once the rank is loaded and, trainable, has its optimizer (the base: none)."""

    def startup_seconds(self) -> dict[str, float]:
        """Where this rank's start went: "load" (joining the process group, loading and sharding the model,
        the optimizer) and "warm_up" (the kind's own set-up: the policy's compile warm-up). What the group
        waited beyond them went to placing the rank, starting its process and its imports."""
        return self.startup

    def _load(self, model_dir: str, world_size: int, trainable: bool) -> Any:
        """This rank's shard of the model (each kind loads its own): a transformers or AutoModel model."""
        raise NotImplementedError

    def _learning_rate(self) -> float:
        """The optimizer's learning rate (each kind has its flag)."""
        raise NotImplementedError

    def _token_budget(self, trainable: bool) -> int:
        """--actor.micro_batch_tokens, or with 0 the tokens whose activations fit in 85% of the memory this
        rank may take once loaded (`molt._placement.actor_free_bytes`: on a shared GPU, not the engine's
        share), less its gradients and AdamW moments in float32, the weights' copy in the compute dtype
        a pass may hold (`molt._sharding.shard_one_rank`) and a 4 GiB margin (4 GiB of activations on a
        CPU). The 15% is measured: with the margin alone, a 1.7B model's multi-turn batches ran out
        of memory on one H200 in the backward (58,368 tokens, where prompt batches peaked at 133 of 140
        GiB)."""
        if self.config.actor.micro_batch_tokens:
            return self.config.actor.micro_batch_tokens
        free: float = 4 * 2**30
        if self.device.type == "cuda":
            params = [
                (p.to_local().numel() if hasattr(p, "to_local") else p.numel(), p.requires_grad)
                for p in self.model.parameters()
            ]
            trained = sum(numel for numel, grad in params if grad)
            copies = 0
            if holds_cast_weights(self.config, dist.get_world_size(), on_gpu=True):
                copies = compute_dtype(self.config).itemsize * sum(numel for numel, _ in params)
            free_now, total = torch.cuda.mem_get_info()
            held = torch.cuda.memory_reserved(self.device)
            mine = actor_free_bytes(self.config, free=free_now, total=total, held=held)
            free = 0.85 * (mine - 12 * trained * trainable - copies) - 4 * 2**30
        return auto_micro_batch_tokens(
            self.model.config,
            free_bytes=free,
            dtype_bytes=compute_dtype(self.config).itemsize,
            checkpointing=self.config.actor.activation_checkpointing,
            at_least=self.config.vllm.max_model_len,
        )

    def micro_batch_layout(self) -> tuple[int, bool, bool]:
        """This rank's micro-batch budget in tokens, whether it packs rows and whether it shares prefixes
        (the group plans by all three)."""
        return self.budget, self.packed, self.shared_prefix

    def _layout(self, mb: TrainBatch) -> SharedPrefixRows | None:
        """How `mb`'s rows go into the model: as shared-prefix trees where --actor.shared_prefix finds rows
        that begin alike (`molt._prefix`), packed end to end, or None (as they are, right padded).
        Rows of one length have no padding to save: they run as a [B, T] batch, whose SDPA kernels
        (cuDNN's on Hopper) beat varlen attention on long rows (16k rows on one H200: 2.37 s a step
        padded, 2.89 s packed, BENCHMARKS.md)."""
        cuda = self.device.type == "cuda"
        if self.shared_prefix:
            pad_to = CUDA_PACK_MULTIPLE if cuda else 1
            tree = SharedPrefixRows.of(mb.tokens_BT, mb.row_lengths, pad_to=pad_to, windows=self.windows)
            if tree.num_saved:
                return tree
        if not self.packed or len(set(mb.row_lengths)) == 1:
            return None
        return packed_rows(mb.row_lengths, cuda=cuda)

    def _model_outputs(
        self, mb: TrainBatch, *, trained_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over `mb` in its layout, back as [B, T, X] per row: from the logprob head, log p of
        each next token [B, T, 1] and the entropy of its distribution [B, T] (with `trained_only`, where
        the next token is trained alone, 0 elsewhere: the head computes no other); for a model without
        that head (`molt._lean.LogprobHead`) or the critic's, the head's outputs and None."""
        from torch.distributed.tensor import DTensor

        layout, num_cols = self._layout(mb), mb.tokens_BT.shape[1]
        if layout is None:  # right padded: causal attention never lets a real token see a pad
            tokens_BT, kwargs = to_device(mb.tokens_BT, self.device), mb.model_inputs(self.device)
            if self._needs_blank_image(mb):  # vision-language rows get their images
                tokens_BT, kwargs = self._blank_image_column(tokens_BT)
        else:
            tokens_BT, kwargs = (
                to_device(layout.pack(mb.tokens_BT), self.device),
                layout.model_kwargs(self.device),
            )
            self.passes["saved"] += layout.num_saved
        # [B, T] or [1, N]; the tokens are counted by the pass (an empty turn has none)
        self.passes["slots"] += tokens_BT.numel()
        head = self._logprob_head  # each row's last next token is another row's or a wrap: never trained
        if head is not None:
            head.check_ids(mb.tokens_BT)  # on the host: no synchronisation
        positions_N = self._trained_positions(mb, layout, tokens_BT.shape) if trained_only else None
        with (
            contextlib.nullcontext()
            if head is None
            else head.logprobs_of(tokens_BT.roll(-1, dims=1), positions_N)
        ):
            out_BTX = self.model(input_ids=tokens_BT, use_cache=False, **kwargs).logits
            entropy_BT = None if head is None else head.entropy_BT
        # Under TP, AutoModel's plans may leave the logits sharded over the vocabulary: gather them.
        out_BTX = out_BTX.full_tensor() if isinstance(out_BTX, DTensor) else out_BTX
        if layout is not None:
            out_BTX = layout.unpack(out_BTX, num_cols)
            entropy_BT = None if entropy_BT is None else layout.unpack(entropy_BT, num_cols)
        # a blank image's column, if any, dropped
        return out_BTX[:, :num_cols], None if entropy_BT is None else entropy_BT[:, :num_cols]

    @staticmethod
    def _trained_positions(
        mb: TrainBatch, layout: SharedPrefixRows | None, shape: torch.Size
    ) -> torch.Tensor:
        """The positions of the model's flattened input ([B, T], or [1, N] packed) whose next token is
        trained (loss mask 1), ascending; position 0 where none is (the head needs a row)."""
        next_trained_BT = mb.loss_mask_BT.roll(-1, dims=1) != 0  # a row's last column wraps to t = 0: 0
        if layout is not None:
            positions_N = layout.positions_of(next_trained_BT)
        else:  # as the model reads them, a blank image's column included
            padded_BT = torch.nn.functional.pad(next_trained_BT, (0, shape[1] - next_trained_BT.shape[1]))
            positions_N = padded_BT.reshape(-1).nonzero()[:, 0]
        return positions_N if len(positions_N) else torch.zeros(1, dtype=torch.int64)

    @staticmethod
    def _needs_blank_image(mb: TrainBatch) -> bool:
        """A micro-batch without images in a batch with some, on several ranks (`_blank_image_column`)."""
        return bool(mb.images) and all(row is None for row in mb.images) and dist.get_world_size() > 1

    def _blank_image_column(self, tokens_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-batch without images, in a batch with some, on several ranks: FSDP2 ranks run every
        sharded module in lock-step (each forward all-gathers its weights, each backward reduce-scatters
        its gradients), so this forward must run the vision tower too, at the same point. One blank image
        of one merged token goes in an extra last column of row 0, where causal attention hides it from
        every real token; its logits are dropped, so the gradients it sends back are zeros."""
        vision = self.model.config.vision_config  # Qwen-VL: a patch is channels x frames x pixels^2
        merge = vision.spatial_merge_size
        num_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        tokens_BT = torch.cat([tokens_BT, tokens_BT[:, -1:]], dim=1)
        tokens_BT[0, -1] = self.model.config.image_token_id
        token_type_BT = torch.zeros_like(tokens_BT)
        token_type_BT[0, -1] = 1
        return tokens_BT, {
            "pixel_values": torch.zeros(merge * merge, num_values, device=self.device),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=self.device),
            "mm_token_type_ids": token_type_BT,
        }

    def _per_micro_batch(self, batch: TrainBatch, compute) -> torch.Tensor:
        """`compute(micro-batch)` [b, t] over each planned micro-batch, back in `batch`'s rows [B, T] on
        the CPU; the pass's tokens, slots and seconds are counted (`take_pass_counts`)."""
        started = time.perf_counter()
        out_BT = torch.zeros(batch.tokens_BT.shape)
        # Each micro-batch's values stay on the device until all are queued: copying one back waits for
        # its forward, which would leave the GPU idle while the host prepares the next.
        try:
            computed = [(rows, mb.lengths_B, compute(mb).float()) for rows, mb in self._micro_batches(batch)]
        finally:
            reshard_all(self.model)  # the weights' copies in the compute dtype (`shard_one_rank`)
        for rows, lengths_B, values_BT in computed:
            if rows:  # 0 past each row's end (a shifted value lands there), whatever the split
                num_cols = values_BT.shape[1]
                out_BT[rows, :num_cols] = values_BT.cpu() * (torch.arange(num_cols) < lengths_B[:, None])
        self._count_pass(batch, started, backward=False)
        return out_BT

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[list[int], TrainBatch]]:
        """`batch`'s planned micro-batches, each as its rows and their `TrainBatch`; their tokens counted."""
        plan, lengths = batch.micro_batches(self.budget, packed=self.packed), batch.row_lengths
        self.passes["tokens"] += sum(lengths[row] for rows in plan for row in rows)
        return [(rows, batch.select(rows)) for rows in plan]

    def _count_pass(self, batch: TrainBatch, started: float, *, backward: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.passes["seconds"] += time.perf_counter() - started
        lengths = [n for n in batch.row_lengths if n]
        self.passes["flops"] += model_flops(lengths, self.model.config, self.num_params, backward=backward)

    def take_pass_counts(self) -> dict[str, float]:
        """The tokens, token slots (and those shared prefixes saved), model FLOPs and seconds of this
        rank's passes since the last call, and the graphs torch.compile built since then."""
        counts, self.passes = self.passes, dict.fromkeys(self.passes, 0.0)
        graphs = compiled_graphs()  # a step that still compiles is slow for that, not for its tokens
        counts["compiles"], self.graphs_seen = graphs - self.graphs_seen, graphs
        bf16 = compute_dtype(self.config) == torch.bfloat16 and self.device.type == "cuda"
        name = torch.cuda.get_device_name() if bf16 else ""
        return {**counts, "peak_flops": next((peak for gpu, peak in BF16_PEAK.items() if gpu in name), 0.0)}

    def _micro_batch_sums(self, batch: TrainBatch, loss_of, inputs: StepInputs) -> dict[str, float]:
        """Forward and backward of each planned micro-batch of this rank's rows through `loss_of(mb, its
        rows of inputs)`, which returns metric numerators: their sums over the micro-batches and all
        ranks. The policy's step and the critic's (`molt._critic`) both run it."""
        from torch.distributed.fsdp import FSDPModule

        started = time.perf_counter()
        micro_batches = self._micro_batches(batch)
        totals: dict[str, torch.Tensor] = {}  # metric numerators, summed over micro-batches
        one_rank = dist.get_world_size() == 1
        try:
            for index, (rows, mb) in enumerate(micro_batches):
                # Several ranks reduce-scatter once, after the last micro-batch; until then each holds its
                # unsharded gradients. One rank has nothing to communicate: its "reduce-scatter" casts
                # each micro-batch's gradients into the float32 shard at once, and holds no unsharded one.
                if isinstance(self.model, FSDPModule):
                    self.model.set_requires_gradient_sync(one_rank or index == len(micro_batches) - 1)
                for name, value in loss_of(mb, inputs.rows(rows, mb.tokens_BT.shape[1])).items():
                    totals[name] = totals[name] + value if name in totals else value
        finally:  # before the optimizer steps the shards (`molt._sharding.shard_one_rank`)
            reshard_all(self.model)
        self._count_pass(batch, started, backward=True)
        sums_K = torch.stack([value.float() for value in totals.values()])  # K numerators on this rank
        dist.all_reduce(sums_K)  # SUM over ranks
        return dict(zip(totals, sums_K.tolist(), strict=True))

    def _optimizer_step(self, prefix: str) -> dict[str, float]:
        """Clip the global gradient norm and step. `{prefix}/grad_norm` (before clipping), `{prefix}/lr` (the
        rate used) and `{prefix}/skipped_updates`: 1 where the norm was not finite. A NaN or inf gradient
        would reach every weight through clipping and Adam's moments, and a refit would send it on to the
        engines; so then the gradients are dropped and neither the optimizer nor the schedule steps: the
        weights, Adam's state and the rate stay as they were. The norm is global, so all ranks agree."""
        from torch.distributed.tensor import DTensor

        assert self.optimizer is not None and self.scheduler is not None  # a trainable rank's
        norms = []  # one per parameter group = device mesh (expert parallelism puts experts on their own)
        for group in self.optimizer.param_groups:
            # a partial norm of sharded gradients (a DTensor) is reduced over ranks
            if grads := [p.grad for p in group["params"] if p.grad is not None]:
                norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
                norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total_norm = torch.linalg.vector_norm(torch.stack(norms))
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = total_norm.item()  # read once: the check and the metric share one device wait
        finite = math.isfinite(grad_norm)
        if finite:
            for group in self.optimizer.param_groups:
                torch.nn.utils.clip_grads_with_norm_(group["params"], self.config.actor.grad_clip, total_norm)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            f"{prefix}/grad_norm": grad_norm,
            f"{prefix}/lr": lr,
            f"{prefix}/skipped_updates": float(not finite),
        }

    def save(self, path: str) -> None:
        """Write this rank's part of a checkpoint (`molt._checkpoint`); call on every rank."""
        where = Path(path) / self.checkpoint_dir
        save_actor(self.model, self.optimizer, self.scheduler, where, rank=self.rank, lora=self.lora)

    def load(self, path: str) -> None:
        """Read the model, optimizer and schedule from a checkpoint (any number of ranks wrote it)."""
        load_actor(self.model, self.optimizer, self.scheduler, Path(path) / self.checkpoint_dir)


def compiled_graphs() -> int:
    """The graphs torch.compile has built in this process (Dynamo's own count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
