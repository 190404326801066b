"""One rank of the FSDP2 policy actor: `PolicyWorker`, a Ray actor that `molt._group.PolicyGroup` drives.

A `molt._rank.ModelRank` (process group, shard, micro-batch plan and loop, optimizer step, checkpoint,
shared with the critic's worker) plus the policy's own: its logprobs and entropies at the sampling
temperature (DESIGN invariant 3, through `molt._lean.LogprobHead`), its optimizer step over the loss of
`molt._objective.step_loss` on each micro-batch (divided by the ONE denominator of `--algo.loss.agg`,
the whole step's counts on all ranks, DESIGN §6), its LoRA adapters (`--actor.lora.*`), MoE routing
replay (`--train.routing_replay`) and the refit of vLLM engines.

The same workers, built with `trainable=False`, are the frozen groups' ranks: the reference policy of
`--algo.kl.coef` and the teacher of on-policy distillation (no optimizer, logprobs only).

Legend: B sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

import refit
from molt._batch import NO_INPUTS, StepInputs, TrainBatch, collate, shifted_logprobs, to_device
from molt._objective import step_loss
from molt._placement import compiles
from molt._rank import ModelRank, compiled_graphs
from molt._sharding import adapter_config, compute_dtype, load_model, replicas
from rlestimators import entropy_from_logits


def _warm_up_batches(vocab_size: int, budget: int, *, trees: bool) -> dict[str, list[TrainBatch]]:
    """`PolicyWorker._warm_up`'s rows, by layout, most likely first: with `trees`, rows that begin alike
    (shared-prefix trees, `molt._prefix`: a group's replies to one prompt), then rows of their own (packed
    end to end) and rows of one length (a [B, T] batch); each layout at two sizes whose packed lengths, row
    counts and longest rows all differ; seeded random tokens, every row within the micro-batch budget.
    Advantages 0: the loss, and so every gradient, is 0."""
    gen, cap = torch.Generator().manual_seed(0), min(budget, 1024)

    def batch(rows: list[list[int]]) -> TrainBatch:
        return collate([(row, [0] + [1] * (len(row) - 1), [0.0] * len(row), 0.0) for row in rows], pad_id=0)

    def rows(*lengths: int) -> list[list[int]]:  # distinct first tokens: these rows share no prefix
        draw = [torch.randint(vocab_size, (max(1, n - 1),), generator=gen).tolist() for n in lengths]
        return [[b, *row] for b, row in enumerate(draw)]

    sizes = [(cap // 8, cap // 4, cap // 6), (cap // 2, cap // 3, cap // 5, cap // 7)]
    layouts = {"packed": [batch(rows(*lengths)) for lengths in sizes]}
    # rows of one length run unpacked, as a [B, T] batch (`ModelRank._layout`): two sizes of those too
    layouts["one length"] = [batch(rows(*lengths)) for lengths in [(cap // 4,) * 2, (cap // 3,) * 3]]
    if not trees:
        return layouts
    shared_rows = []  # the same rows after a prefix they share, of 1/8 and then 1/4 of the cap
    for prefix, lengths in zip((cap // 8, cap // 4), sizes, strict=True):
        shared = rows(prefix)[0]
        shared_rows.append(batch([shared + row for row in rows(*lengths)]))
    return {"trees": shared_rows, **layouts}


def engines_up(engines: list) -> bool:
    """Whether every one of `engines` (Ray refs, each ready once its engine's server answers) is ready now,
    without waiting."""
    import ray

    if not engines:  # attached ones (--vllm.urls) answered before the run began
        return True
    ready, _ = ray.wait(engines, num_returns=len(engines), timeout=0)
    return len(ready) == len(engines)


class PolicyWorker(ModelRank):
    """One rank of the policy actor (`molt._rank.ModelRank` plus the policy's passes, step and refit).
    `trainable=False`: a frozen copy (reference or teacher) that only computes logprobs."""

    checkpoint_dir = "actor"

    def _ready(self) -> None:
        """The policy's own: its engines' transfer handles, routing replay and the compile warm-up."""
        self.engines: dict = {}  # url -> refit.Engine, built on first use and kept (its transfer group)
        self.replay = None
        self.warm_up_left: list[tuple[str, Callable[[], object]]] = []  # `_warm_up`'s passes not yet run
        # --train.routing_replay: a trainable policy's tokens go to the engine's experts
        if self.optimizer is not None and self.config.train.routing_replay:
            self.replay = refit.RoutingReplay(self.model)
        on_gpu = self.device.type == "cuda"
        # shared prefixes attend through compiled FlexAttention, compiled layers or not
        if compiles(self.config, on_gpu=on_gpu) or (self.shared_prefix and on_gpu):
            self._warm_up()

    def _warm_up(self) -> None:
        """Compiled layers (--actor.compile) and FlexAttention's compiled functions (shared prefixes)
        build their graphs here, while the engines start, not in the first steps (on one H200 a 135M
        model's first step spent 28 s compiling, a 1.7B model's first two about 24 s; without compiled
        layers, FlexAttention's took 7.4 s of a 135M model's second step): the passes a step runs
        (`_warm_up_passes`) over dummy rows (`_warm_up_batches`) of each layout a step may use, at two
        sizes, so that the second builds the graph with dynamic shapes that torch.compile keeps for
        later sizes. Its gradients are dropped and nothing steps: the weights and the optimizer are as
        loaded.

        At start-up the warm-up only fills the engines' loading time (`self.engines_loading`, their refs;
        None: a rank on its own warms every layout): once they are up it stops, before the next pass
        (stopping between layouts instead, one run on one H100 started a layout 2 s before its engine
        was up and began its first step 10 s later). The passes it did not run are kept
        (`warm_up_left`): the trainer runs them one by one while it waits for its first groups
        (`warm_up_more`), and what is still left then compiles in the first step that meets it."""
        vocab_size = self.model.get_input_embeddings().weight.shape[0]  # a vision-language model's LLM's too
        layouts = _warm_up_batches(vocab_size, self.budget, trees=self.shared_prefix)
        # (layout, pass) in the order they run
        self.warm_up_left = [
            (name, p) for name, batches in layouts.items() for p in self._warm_up_passes(batches)
        ]
        ran: dict[str, list[tuple[float, int]]] = {}  # by layout: each pass's seconds and graphs
        while self.warm_up_left and not self._engines_up():
            layout, seconds, graphs = self._next_warm_up_pass()
            ran.setdefault(layout, []).append((seconds, graphs))
        left = [layout for layout, _ in self.warm_up_left]
        parts = []  # into the rank's log: what each layout's graphs cost
        for layout, passes in ran.items():
            part = f"{layout} {sum(s for s, _ in passes):.1f} s, {sum(g for _, g in passes)} graphs"
            if layout in left:
                part += f" ({len(passes)} of {len(passes) + left.count(layout)} passes)"
            parts.append(part)
        if left:
            layouts_left = ", ".join(dict.fromkeys(left))
            parts.append(f"stopped, the engines are up ({layouts_left}: built while the first groups come)")
        print(f"compile warm-up: {'; '.join(parts)}", flush=True)
        self.take_pass_counts()  # dropped: the steps' counts and `actor/compiles` start at the first step

    def warm_up_more(self) -> int:
        """One more pass of the compile warm-up that the engines stopped (`_warm_up`), run while the
        trainer waits for its first groups (`molt.loop.warm_up_while`); its graphs and passes are no
        step's. Returns the passes still left (0: the warm-up is done, or none was needed)."""
        if self.warm_up_left:
            layout, seconds, graphs = self._next_warm_up_pass()
            left = len(self.warm_up_left)
            said = f"{layout} {seconds:.1f} s, {graphs} graphs ({left} passes left)"
            print(f"compile warm-up, while the first groups come: {said}", flush=True)
            self.take_pass_counts()
        return len(self.warm_up_left)

    def _next_warm_up_pass(self) -> tuple[str, float, int]:
        """Run the warm-up's next pass: its layout, seconds and the graphs it built."""
        layout, warm_up_pass = self.warm_up_left.pop(0)
        started, graphs = time.perf_counter(), compiled_graphs()
        warm_up_pass()
        return layout, time.perf_counter() - started, compiled_graphs() - graphs

    def _warm_up_passes(self, batches: list[TrainBatch]) -> list[Callable[[], object]]:
        """The passes a step runs over each of `batches` in turn: the logprobs' and, trainable, the train
        step's forward and backward, whose gradients are dropped."""
        optimizer = self.optimizer

        def train_pass(batch: TrainBatch) -> None:
            assert optimizer is not None
            self._micro_batch_sums(batch, self._forward_backward, NO_INPUTS)
            optimizer.zero_grad(set_to_none=True)

        passes: list[Callable[[], object]] = []
        for batch in batches:
            passes.append(functools.partial(self.logprobs, batch))
            if optimizer is not None:
                passes.append(functools.partial(train_pass, batch))
        return passes

    def _engines_up(self) -> bool:
        """Whether the run's engines are up (`engines_up`) as the ranks see it together: one rank's yes
        is every rank's, so they all stop their warm-up before the same pass (FSDP2's collectives run in
        lock-step: a rank that went on alone would wait for the others forever)."""
        if self.engines_loading is None:
            return False
        up = engines_up(self.engines_loading)
        if dist.get_world_size() == 1:
            return up
        flag = torch.tensor([int(up)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _load(self, model_dir: str, world_size: int, trainable: bool) -> torch.nn.Module:
        # --actor.lora.*: the policy trains adapters only; a frozen copy (reference, teacher) has none.
        self.lora = self.config.actor.lora if trainable and self.config.actor.lora.rank else None
        return load_model(model_dir, self.config, world_size, self.device, lora=self.lora)

    def _learning_rate(self) -> float:
        return self.config.actor.lr

    def _token_stats(
        self, mb: TrainBatch, *, entropy: str = "none", trained_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per token t of `mb`: log p(token t | tokens before t) at the sampling temperature, and with
        `entropy` "detached" or "grad" the entropy of that distribution; both [B, T], column 0 = 0. With
        `trained_only`, only the trained tokens' (loss mask 1) are sure to be there: the logprob head
        computes those alone and gives 0 for the rest."""
        temperature = self.config.rollout.temperature
        out_BTX, entropy_next_BT = self._model_outputs(mb, trained_only=trained_only)
        if entropy_next_BT is not None:  # the head gave them: no [B, T, V] logits exist
            logp_BT = torch.nn.functional.pad(out_BTX[:, :-1, 0], (1, 0))
        else:
            logp_BT = shifted_logprobs(out_BTX, mb.tokens_BT.to(self.device), temperature=temperature)
        if entropy == "none":
            return logp_BT, None
        if entropy_next_BT is None:  # no head: from the logits, detached unless a bonus trains it
            logits_BTV = out_BTX if entropy == "grad" else out_BTX.detach()
            entropy_next_BT = entropy_from_logits(logits_BTV, temperature=temperature)
        entropy_next_BT = entropy_next_BT if entropy == "grad" else entropy_next_BT.detach()
        return logp_BT, torch.nn.functional.pad(entropy_next_BT[:, :-1], (1, 0))

    @contextlib.contextmanager
    def _routes(self, mb: TrainBatch) -> Iterator[refit.RoutingReplay | None]:
        """`--train.routing_replay`: within the block, the policy's routers send each token of `mb` to
        the experts the engine used (`mb.experts_BTLK`, -1: the router's own choice). The block spans
        the backward too, which recomputes the forward under activation checkpointing."""
        if self.replay is None or mb.experts_BTLK is None:
            yield None
            return
        experts_BTLK, layout = mb.experts_BTLK, self._layout(mb)
        if layout is not None:  # the routers see the packed tokens
            experts_BTLK = layout.pack(experts_BTLK, fill=-1)
        elif self._needs_blank_image(mb):  # its extra column is routed by the router
            experts_BTLK = torch.nn.functional.pad(experts_BTLK, (0, 0, 0, 0, 0, 1), value=-1)
        with self.replay.replay(to_device(experts_BTLK, self.device)):
            yield self.replay

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, trained_only: bool = False) -> torch.Tensor:
        """log p(token t | tokens before t) at the sampling temperature, [B, T] float32 on the CPU; with
        `trained_only`, at the trained tokens (loss mask 1), 0 elsewhere (`_token_stats`)."""
        training = self.model.training
        self.model.eval()  # no --actor.lora.dropout: these are the policy's own logprobs
        logp_BT = self._per_micro_batch(
            batch, functools.partial(self._logprobs_of, trained_only=trained_only)
        )
        self.model.train(training)
        return logp_BT

    def _logprobs_of(self, mb: TrainBatch, *, trained_only: bool) -> torch.Tensor:
        with self._routes(mb):
            return self._token_stats(mb, trained_only=trained_only)[0]

    def _forward_backward(self, mb: TrainBatch, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """One micro-batch: the policy's logprobs and entropies, its loss (`molt._objective.step_loss`)
        and the backward. Returns the loss's metric numerators and, under routing replay, the (token,
        router) pairs it compared and those the router would have routed elsewhere."""
        algo, device = self.config.algo, self.device
        with self._routes(mb) as replay:
            # The entropy of the distribution each token was sampled from; a bonus trains it.
            # The loss reads the trained tokens' alone (`step_loss`: every term is masked).
            entropy = "grad" if algo.entropy_coef else "detached"
            logp_BT, entropy_BT = self._token_stats(mb, entropy=entropy, trained_only=True)
            assert entropy_BT is not None  # asked for
            loss, sums = step_loss(
                logp_BT,
                entropy_BT,
                None if inputs.old_logp_BT is None else to_device(inputs.old_logp_BT, device),
                to_device(mb.rollout_logp_BT, device),
                to_device(mb.advantages_BT, device),
                to_device(mb.loss_mask_BT, device),
                num_tokens=mb.num_tokens,
                num_seqs=mb.num_seqs,
                algo=algo,
                ref_logp_BT=None if inputs.ref_logp_BT is None else to_device(inputs.ref_logp_BT, device),
                lag_BT=None if mb.lag_BT is None else to_device(mb.lag_BT, device),
            )
            loss.backward()
        if replay is not None:
            differed, compared = (torch.as_tensor(count, device=self.device) for count in replay.mismatch)
            sums.update(routes_differed=differed, routes_compared=compared)
        return sums

    def train_step(self, batch: TrainBatch, inputs: StepInputs = NO_INPUTS) -> dict[str, float]:
        """One optimizer step over this rank's rows; metrics are global (all ranks, all micro-batches).

        `inputs.old_logp_BT`: the logprobs of the policy the surrogate's ratio is taken against (the
        trainer's old policy: before the first of the batch's `--train.mini_batches` steps), computed once
        by the caller. None takes them from this step's own forward, detached: right for a batch that is
        one optimizer step, where those are the same numbers, and a separate logprob pass is saved. The
        rollout correction (`--algo.correction.*`) weighs each token by the ratio of `old_logp` to the
        engine's `batch.rollout_logp_BT`. `inputs.ref_logp_BT`: reference logprobs, which add the KL
        loss term (`molt._objective.score` gives them whenever --algo.kl.coef puts it in the loss).
        """
        if self.optimizer is None:
            raise RuntimeError("this group is frozen (trainable=False): it gives logprobs, it does not train")
        sums = self._micro_batch_sums(batch, self._forward_backward, inputs)
        counted = batch.num_tokens * replicas(self.config)  # the TP ranks of a DP group hold equal sums
        # "train/" numerators are per token; the counts beside them (also counted `replicas` times) are not
        metrics = {name: value / counted for name, value in sums.items() if name.startswith("train/")}
        lag0, lagged = sums["lag0_tokens"], sums["lagged_tokens"]
        metrics["train/seq_masked_frac"] = sums["rows_rejected"] / sums["rows"]
        # the engine-vs-trainer mismatch over lag-0 tokens, lag's share apart (`step_loss`); 0 with none
        metrics["train/mismatch_kl"] = sums["train/mismatch_kl"] / max(lag0, 1)
        metrics["train/staleness_kl"] = sums["train/staleness_kl"] / max(lagged, 1)
        metrics["train/lag0_frac"] = lag0 / (lag0 + lagged)
        if self.replay is not None:  # how often the policy's own routers disagree with the engine's
            metrics["train/routing_mismatch_frac"] = sums["routes_differed"] / max(sums["routes_compared"], 1)
        metrics.update(self._optimizer_step("train"))
        return metrics

    def refit(self, engine_urls: list[str], backend: str, version: int, trainer_host: str) -> dict | None:
        """Send the current weights to the engines (call on every rank). Rank 0 returns the phase
        seconds and, under "failed", each engine that failed and why (it is forgotten here)."""
        for url in engine_urls:
            if url not in self.engines:
                self.engines[url] = refit.Engine(url, backend=backend, trainer_host=trainer_host)
        engines = [self.engines[url] for url in engine_urls]
        try:
            # In the dtype the trainer computes in, which its engines run (molt._sharding.compute_dtype).
            # A LoRA policy sends its adapters alone: the engines serve them on the frozen base.
            dtype, lora = compute_dtype(self.config), adapter_config(self.lora) if self.lora else None
            params = (refit.adapter_params if lora else refit.full_params)(self.model, dtype=dtype)
            stats = refit.update_weights(
                engines, params, version=version, delta=self.config.refit.delta, lora=lora
            )
        except refit.RefitError as error:  # rank 0 only: the others have joined every gather
            for url in error.failures:
                self.engines.pop(url, None)
            failed = {url: f"{phase}: {type(e).__name__}: {e}" for url, (phase, e) in error.failures.items()}
            return {"failed": failed}
        if stats is None:
            return None
        counts = {"refit/verify_failed": len(stats.verify_failed), "refit/bytes_sent": stats.bytes_sent}
        return {**stats.seconds, **counts, "failed": {}}

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Full (gathered) parameters on rank 0 (None elsewhere); call on every rank."""
        params = refit.full_params(self.model)  # gathers are collectives: every rank iterates
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in params if self.rank == 0}
        return state if self.rank == 0 else None
