"""The training loop of `molt train`: `run_steps`, the whole algorithm in one function, and the step's parts.

`molt._launch` starts the parts (Ray, the vLLM engines, the FSDP2 policy actor, tito) and runs `run_steps`
over them (`molt.train`, or the `molt train` command). Rollouts run on this process's
event loop the whole time; the actor's blocking calls run in threads, so the engines keep generating while
the actor trains (asynchrony bounded by `--rollout.queue_depth` and `--rollout.max_lag`). The step's
metrics come from `molt._metrics`, its rows from `molt._data`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from asyncpool import GroupPool, PromptStarved
from molt._batch import (
    NO_INPUTS,
    StepInputs,
    TrainBatch,
    collate,
    window_rows,
    with_images,
    with_lags,
    with_routes,
)
from molt._checkpoint import step_dir, write_loop_state
from molt._critic import CriticGroup
from molt._data import RowStream
from molt._dumps import write_rollouts
from molt._filters import GroupFilters
from molt._group import EnginesLost, PolicyGroup
from molt._log import RunLog, StartupClock, progress
from molt._metrics import evaluate, pool_metrics, rollout_metrics, staleness_mean
from molt._objective import score
from molt._restarts import EngineRestarts
from molt._rollout import Rollout, RolloutRunner
from molt.config import Config
from tito import Tito

__all__ = ["Run", "run_steps"]


@dataclass
class Run:
    """The parts `run_steps` drives, started by `train`."""

    policy: PolicyGroup
    tito: Tito
    pool: GroupPool
    runner: RolloutRunner
    rows: RowStream
    log: RunLog
    model_dir: Path
    eval_rows: list[dict]
    restarts: EngineRestarts  # the engines molt started, restarted when they die (none attached)
    first_step: int = 1  # > 1 when resuming from a checkpoint
    startup: StartupClock | None = None  # the start-up stages, logged with the first step
    reference: PolicyGroup | None = None  # --algo.kl.coef != 0: the frozen initial policy
    critic: CriticGroup | None = None  # --algo.advantage.estimator gae: the value model
    teacher: PolicyGroup | None = None  # --algo.advantage.estimator opd: the frozen teacher
    filters: GroupFilters | None = None  # --algo.filters: the pool's keep


async def run_steps(config: Config, run: Run) -> None:
    """The algorithm: take groups, advantages, then one step (logprobs, correction, loss), refit, log."""
    policy, pool, runner = run.policy, run.pool, run.runner
    pad_id = run.tito.tokenizer.pad_token_id
    last = config.train.num_steps
    pool_before = pool.stats  # the per-step pool rates are over what happened since the last log
    no_update_since = None  # the first of the steps in a row whose updates were all skipped
    for step in range(run.first_step, last + 1):
        started = time.monotonic()
        taking = take(pool, config.rollout.prompts_per_step, run.tito, run.restarts, run.filters)
        if step == run.first_step:  # the compile warm-up the engines stopped goes on meanwhile
            taking = warm_up_while(taking, run.policy, run.reference, run.teacher)
        groups = await taking
        generation_s = time.monotonic() - started
        startup = run.startup if step == run.first_step else None  # timing/startup_* with this step
        if startup is not None:
            startup.seconds["first_groups"] = generation_s
        rollouts: list[Rollout] = [sample for group in groups for sample in group.samples]
        run.rows.mark_trained(groups)
        if config.train.rollout_dump_dir:
            write_rollouts(Path(config.train.rollout_dump_dir), step, groups, run.rows.positions)

        rewards_R = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        # The batch's rows: one per segment (a compacted episode has several); advantages come from `score`.
        rows = [segment for rollout in rollouts for segment in rollout.segments]
        batch = collate([(row.token_ids, row.loss_mask, row.logprobs, 0.0) for row in rows], pad_id=pad_id)
        check_token_identity(batch, rollouts)  # invariant 1: we train exactly the tokens the engine sampled
        # each token's lag behind the weights that score it: train/mismatch_kl keeps lag 0 (step_loss)
        batch = with_lags(batch, [row.versions for row in rows], trainer_version=step - 1)
        if (images := run.tito.renderer.images) is not None:  # a vision-language policy: the rows' pixels
            batch = with_images(batch, [row.images for row in rows], images.processor)
        if config.train.routing_replay:  # the engines' MoE routes, replayed in the policy's forward
            batch = with_routes(batch, [row.routes() for row in rows])

        train_started = time.monotonic()
        # Advantages, and the logprobs, values and KL they need (`molt._objective.score`); then each
        # window is one optimizer step whose loss, rollout correction included (invariant 2), is
        # `molt._objective.step_loss`, which the policy's ranks call on each micro-batch.
        rows_R = torch.tensor([len(rollout.segments) for rollout in rollouts])  # training rows per rollout
        # windows of whole rollouts, in a random order seeded by the run's seed and the step
        plan = window_rows(config.train.mini_batches, rows_R.tolist(), (config.train.seed, step))
        scored = await asyncio.to_thread(score, batch, rewards_R, rows_R, run, config, plan[0])
        score_s = time.monotonic() - train_started  # the passes advantages need, then the advantages
        windows = [(w, rows) for rows in plan if (w := scored.batch.window(rows)).num_tokens]
        steps = [asyncio.to_thread(train_windows, policy, windows, scored.policy)]
        if scored.critic is not None:  # the critic's steps run beside the policy's
            steps.append(asyncio.to_thread(train_windows, run.critic, windows, scored.critic))
        train_metrics = {name: v for metrics in await asyncio.gather(*steps) for name, v in metrics.items()}
        train_metrics |= await asyncio.to_thread(policy.pass_metrics)  # actor/padding_frac, tokens_per_s
        train_s = time.monotonic() - train_started

        broadcast_started = time.monotonic()
        async with _quiesced(pool, run.tito.router.engines, hold=not config.rollout.partial_rollout):
            # engines pause (keeping requests); a dead one is restarted (`molt._restarts`)
            refit_s = await refit_engines(policy, run.tito, step, run.restarts)
        pool.version = step  # admission lets the next batch start; --rollout.stale drop drops late groups
        broadcast_s = time.monotonic() - broadcast_started

        # --eval.every, with the new weights
        eval_metrics = await _evaluate(config, run, step) if _due(config.eval.every, step, last) else {}

        pool_now = pool.stats
        run.log.step(
            step,
            {
                **rollout_metrics(rollouts, config.rollout.group_size),
                "train/kl": 0.0,  # no reference: no KL
                **train_metrics,  # the policy's (and the critic's) step, the correction's mismatch included
                **scored.metrics,  # the estimator's own, and train/kl where the reward holds the KL
                "train/staleness_mean": staleness_mean(rollouts, trainer_version=step - 1),
                "train/advantage_abs_mean": scored.advantages.abs().mean().item(),
                "train/zero_advantage_frac": (scored.advantages == 0).float().mean().item(),
                **pool_metrics(pool_now, pool_before),
                **(run.filters.metrics() if run.filters else {}),  # pool/filtered/<name>
                **{f"agent/{kind}": float(count) for kind, count in runner.failures.items()},
                "engines/alive": float(sum(engine.alive for engine in run.tito.router.engines)),
                "engines/restarts": float(run.restarts.num_restarts),
                "timing/generation": generation_s,
                "timing/policy_train": train_s,
                "timing/score": score_s,  # of it: `score` (later windows' old logprobs, reference, values)
                "timing/broadcast": broadcast_s,
                # where it went; refit/verify_failed: engines whose refit failed its check and was redone
                **{(k if "/" in k else f"timing/refit_{k}"): float(v) for k, v in refit_s.items()},
                **eval_metrics,
                "timing/step_total": time.monotonic() - started,
                **(startup.metrics() if startup else {}),
            },
        )
        pool_before = pool_now
        # a non-finite gradient's update is skipped (`ModelRank._optimizer_step`); steps of none stop the run
        no_update_since = check_updates(step, train_metrics, len(windows), no_update_since)
        if startup is not None:
            progress(startup.line())
        if _due(config.ckpt.every, step, last):  # --ckpt.every: actor, optimizer, loop state
            await asyncio.to_thread(save_checkpoint, config, run, step)


# Steps in a row without an update (every one skipped for a non-finite gradient) before the run stops: one
# is a bad batch; several say the forward itself gives NaN or inf, and the run would go on training nothing.
NO_UPDATE_STEPS = 3


def check_updates(
    step: int, metrics: dict[str, float], updates: int, no_update_since: int | None
) -> int | None:
    """Warn of `step`'s skipped updates (a gradient norm that was NaN or inf: the weights stayed as they
    were); stop the run at the `NO_UPDATE_STEPS`-th step in a row in which the policy (or the critic)
    updated nothing, naming the step's losses. Returns the first step of the current run of such steps
    (None: this one updated each model)."""
    skipped = {name: int(metrics[name]) for name in _SKIPPED if metrics.get(name)}
    if not skipped:
        return None
    counts = ", ".join(f"{name} {count} of {updates}" for name, count in skipped.items())
    logging.getLogger("molt").warning(
        f"step {step}: {counts}: their gradient norm was not finite, so those optimizer steps changed nothing"
    )
    stuck = [_SKIPPED[name] for name, count in skipped.items() if count == updates]
    if not stuck:  # some update of each model went through
        return None
    first = step if no_update_since is None else no_update_since
    if step - first + 1 >= NO_UPDATE_STEPS:
        losses = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.endswith(("_loss", "/entropy")))
        raise RuntimeError(
            f"steps {first}..{step}: every update of the {' and the '.join(stuck)} was skipped, its gradient "
            f"norm NaN or inf ({losses}); its weights are still step {first - 1}'s. The forward gives "
            "non-finite values on these batches: lower the learning rate, or train in float32 "
            "(--model.dtype, --actor.compute_dtype); on a GPU, try --actor.compile off"
        )
    return first


async def warm_up_while[T](waiting: Awaitable[T], *groups: PolicyGroup | None) -> T:
    """`waiting`'s result; meanwhile each of `groups` (None: not in this run) runs the passes of its
    compile warm-up that the engines' start-up left (`PolicyGroup.warm_up_more`), one at a time, until
    they are done or `waiting` is: the graphs they build are not built in a step. A pass under way when
    `waiting` ends runs to its end (seconds, where its graphs would have cost the step that met them)."""
    task = asyncio.ensure_future(waiting)
    try:
        for group in groups:
            while group is not None and not task.done() and await asyncio.to_thread(group.warm_up_more) > 0:
                pass
    except BaseException:  # a pass failed: the run stops, and waits for nothing
        task.cancel()
        raise
    return await task


async def end_early(config: Config, run: Run) -> None:
    """The dataset ran out before --train.num_steps: the last step trained (the pool's version) gets the
    evaluation and the checkpoint that --eval.every and --ckpt.every give a run's last step, where its
    own were not due."""
    step = run.pool.version
    if step < run.first_step:  # nothing trained since the start (or the resumed checkpoint)
        return
    if config.eval.every and step % config.eval.every:
        run.log.evaluation(step, await _evaluate(config, run, step))
    if config.ckpt.every and step % config.ckpt.every:
        await asyncio.to_thread(save_checkpoint, config, run, step)


def _due(every: int, step: int, last: int) -> bool:
    """Whether `--eval.every` or `--ckpt.every` falls on `step`: every `every` steps, and the last; never
    with 0."""
    return every > 0 and (step % every == 0 or step == last)


# Zero in a batch's first window, whose ratio to the old policy (its value to the old values) is 1.
_CLIP_FRACS = ("train/clip_frac", "critic/value_clip_frac")
# Counted over the windows, not averaged: the step's optimizer steps dropped for a non-finite gradient.
_SKIPPED = {"train/skipped_updates": "policy", "critic/skipped_updates": "critic"}


def train_windows(
    group, windows: list[tuple[TrainBatch, list[int]]], inputs: StepInputs = NO_INPUTS
) -> dict[str, float]:
    """One optimizer step of `group` (the policy or the critic) per window of the batch, each given its
    rows of `inputs`; the first takes its old logprobs from its own forward, nothing having stepped
    before it (`molt._objective.score` gives the later windows' alone). Metrics: the windows'
    token-weighted mean; a clip fraction over the windows after the first, where the ratio can depart
    from 1 (0 with one window); the learning rate is the first step's; skipped updates are counted."""
    results = []
    for index, (window, rows) in enumerate(windows):
        given = inputs.rows(rows, window.tokens_BT.shape[1])
        results.append(group.train_step(window, replace(given, old_logp_BT=None) if index == 0 else given))
    weights = [window.num_tokens for window, _ in windows]

    def mean(name: str, first: int = 0) -> float:
        pairs = list(zip(results, weights, strict=True))[first:]
        return sum(m[name] * w for m, w in pairs) / sum(w for _, w in pairs) if pairs else 0.0

    metrics = {
        name: sum(m[name] for m in results)
        if name in _SKIPPED
        else mean(name, first=int(name in _CLIP_FRACS))
        for name in results[0]
    }
    return {**metrics, **({"train/lr": results[0]["train/lr"]} if "train/lr" in results[0] else {})}


async def take(
    pool: GroupPool,
    num_groups: int,
    tito: Tito,
    restarts: EngineRestarts,
    filters: GroupFilters | None = None,
) -> list:
    """`pool.take`, in prompt order (a step's batch, and so its windows, must not depend on which group
    finished first: a resumed or repeated run trains what the first one did), but a run fails instead of
    waiting forever when every engine has stopped answering
    (and none is being restarted: `restarts`, whose engines that are up again get the current weights here,
    while the actor is idle; a restart past --vllm.max_restarts stops the run),
    when group after group fails (an agent that always raises) or, under --algo.filters (`filters`), when
    they drop more than `filters.max_groups` groups (as verl's max_num_gen_batches), and
    stops naming the prompt when one prompt's groups keep arriving stale (a long-episode agent past
    --rollout.max_stale_requeues)."""
    before = pool.stats
    if filters is not None:
        filters.dropped.clear()  # the prompts this take drops
    taking = asyncio.ensure_future(pool.take(num_groups))
    try:
        while not (await asyncio.wait({taking}, timeout=1.0))[0]:
            problem = None
            # the weights the pool's groups are sampled with; then what is dead restarts (one that died
            # again while brought back too), and a restart past --vllm.max_restarts, or one that failed,
            # stops the run
            await restarts.bring_back(pool.version)
            stats = pool.stats
            if not any(engine.alive for engine in tito.router.engines) and not restarts.coming_back:
                problem = "no vLLM engine is answering (see engine-*.log in the run dir)"
            elif (failed := stats.failed - before.failed) >= max(8, 2 * num_groups):
                problem = (
                    f"{failed} groups failed every attempt while waiting for {num_groups}: the agent keeps "
                    "failing (its first traceback is logged above)"
                )
            elif filters is not None and (filtered := stats.filtered - before.filtered) > filters.max_groups:
                problem = (
                    f"{filtered} groups were dropped by --algo.filters while waiting for {num_groups}, more "
                    f"than {filters.max_groups} (--algo.filter_max_batches x --rollout.prompts_per_step): "
                    f"{filters.most_dropped()} Fix what the filter drops, raise --algo.filter_max_batches, "
                    "or take the filter out of --algo.filters"
                )
            if problem:
                stale = stats.dropped_stale - before.dropped_stale
                raise RuntimeError(f"{problem} ({stale} groups dropped as stale meanwhile); stopping")
    finally:
        taking.cancel()  # a no-op once it is done
    try:
        return sorted(taking.result(), key=lambda group: group.prompt_index)
    except PromptStarved as starved:
        stale = pool.stats.dropped_stale - before.dropped_stale
        raise RuntimeError(
            f"{starved}. As flags: raise --rollout.max_lag or --rollout.max_stale_requeues, or pass "
            f"--rollout.stale keep ({stale} stale drops during this take, {pool.stats.dropped_stale} in "
            "the run); stopping"
        ) from starved


async def refit_engines(
    policy: PolicyGroup, tito: Tito, version: int, restarts: EngineRestarts
) -> dict[str, float]:
    """Refit every live engine; returns the refit's seconds by phase (none when an engine failed). One
    that fails is dead: restarted if molt started it (`restarts`; it gets the weights once it is up,
    in `take`), else dropped for the rest of the run (the rollouts it was serving failed and their groups
    are retried on the others); the run stops when none is left or coming back."""
    live = [engine for engine in tito.router.engines if engine.alive]
    if not live:  # every engine is being restarted
        return {}
    try:
        return await asyncio.to_thread(policy.refit, [engine.url for engine in live], version) or {}
    except EnginesLost as lost:
        for engine in live:
            engine.alive = engine.alive and engine.url not in lost.failed
        restarts.check()
        if not lost.updated and not restarts.coming_back:
            raise RuntimeError(f"no vLLM engine took the weights of step {version}; stopping") from lost
        back = " while the dead ones restart" if restarts.coming_back else ""
        progress(f"{lost}\ntraining on with {len(lost.updated)} engine(s){back}")
        return {}


def check_token_identity(batch: TrainBatch, rollouts: list[Rollout]) -> None:
    """Every trainable token of the batch is the token the engine returned, in order, rollout by rollout;
    a step that breaks it never trains (nor logs a metric: a logged rate of held identity could only be 1).

    `rollout.sampled` is recorded apart from the segments: for an Env by the episode from each engine
    reply it receives, for a ChatAgent by tito from each engine reply it commits (its reply log, kept
    beside the segments' seal, truncate and append bookkeeping, which this checks)."""
    trainable = (batch.tokens_BT[row][batch.loss_mask_BT[row] > 0].tolist() for row in range(batch.num_rows))
    for index, rollout in enumerate(rollouts):
        trained = [token for _ in rollout.segments for token in next(trainable)]  # its segments' rows
        if trained != rollout.sampled:
            raise RuntimeError(
                f"token identity violated in rollout {index}: the batch's trainable tokens differ from "
                f"the tokens the engine sampled ({len(trained)} vs {len(rollout.sampled)}); refusing to train"
            )


async def _evaluate(config: Config, run: Run, version: int) -> dict[str, float]:
    """The evaluation (`molt._metrics.evaluate`) with the weights of `version`, while the actor is idle:
    an engine up again meanwhile gets them and serves, so the samples waiting for it (`molt._rollout`) go
    on; a restart past --vllm.max_restarts, or one that failed, stops the run. Its seconds: `timing/eval`."""
    started = time.monotonic()
    evaluating = asyncio.ensure_future(evaluate(run.runner, run.eval_rows, config))
    try:
        while not (await asyncio.wait({evaluating}, timeout=1.0))[0]:
            await run.restarts.bring_back(version)
    finally:
        evaluating.cancel()  # a no-op once it is done
    return evaluating.result() | {"timing/eval": time.monotonic() - started}


@contextlib.asynccontextmanager
async def _quiesced(pool: GroupPool, engines: list, *, hold: bool):
    """Without partial rollout, no rollout may span a refit: hold new starts and let running ones finish.
    While no engine serves, none samples: a rollout waiting for a dead engine (`molt._rollout`) re-runs
    once `take` has brought it back, with the new weights, so the refit does not wait for it."""
    with pool.paused() if hold else contextlib.nullcontext():
        while hold and pool.stats.in_flight and any(engine.alive for engine in engines):
            await asyncio.sleep(0.01)
        yield


def save_checkpoint(config: Config, run: Run, step: int) -> None:
    path = step_dir(config.ckpt.dir, step)
    run.policy.save(path)  # every rank writes its shards
    if run.critic is not None:
        run.critic.save(path)
    # last: marks the checkpoint complete
    write_loop_state(path, step, run.rows.consumed(run.pool.discarded), run.model_dir)
    progress(f"checkpoint of step {step} in {path}")
