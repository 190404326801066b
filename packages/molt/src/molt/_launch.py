"""`molt train`'s launch: start every part of a run, hand them to `molt.loop.run_steps`, stop them all.

`train(config)` starts Ray, the vLLM engines (Ray actors), the FSDP2 policy actor (Ray actors, one per
rank), the optional reference, critic and teacher groups, the agent hosts and tito (in this process), then
runs `run_steps` on this process's event loop. Whatever happens (an error, Ctrl-C), every engine, actor
and Ray itself is stopped. It is public as `molt.train`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import torch

from asyncpool import GroupPool, PoolExhausted
from molt._attached import check_attached_serving
from molt._checkpoint import latest, restore_rng
from molt._critic import CriticGroup
from molt._data import RowStream, check_held_out, eval_rows, read_rows
from molt._engines import (
    ADAPTER,
    check_attached,
    launch_engines,
    prestart_engines,
    stop_engines,
    stop_prestarted,
)
from molt._filters import GroupFilters
from molt._group import PolicyGroup
from molt._log import RunLog, StartupClock, allow_bytecode, progress, quiet_console
from molt._metrics import sampled_tokens
from molt._mps import mps_report, mps_server, uses_mps
from molt._placement import compute_dtype_name, engine_starts_first, extra_groups
from molt._restarts import EngineRestarts
from molt._rollout import RolloutRunner, sampling
from molt._runners import launch_hosts
from molt._validate import check_cluster_gpus, start_notes, validate
from molt.agent import ChatAgent, load_agent
from molt.config import Config, with_run_dir
from molt.loop import Run, end_early, run_steps
from tito import Tito, create_app, serve_on_loop


def train(config: Config, *, resume: bool = False) -> None:
    """A run from Python (`molt.train`): every refusal before anything starts (`validate`), then `launch`."""
    launch(with_run_dir(validate(config)), resume=resume)


def launch(config: Config, *, resume: bool = False) -> None:
    """Set up, run `run_steps`, and tear everything down on any exit; `config` as `validate` returned it
    (`molt train` validates once, before it writes the run directory). `resume`: continue from the newest
    checkpoint under `--ckpt.dir` (`molt train --resume RUN_DIR`)."""
    clock = StartupClock()  # from the launch: timing/startup_* in step 1's metrics
    run_dir = Path(config.logger.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.train.seed)
    random.seed(config.train.seed)
    checkpoint, state = latest(config.ckpt.dir) if resume else (None, None)
    first_step = state.step + 1 if state else 1  # the step after the checkpoint's
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(quiet_console(run_dir / "molt.log", verbose=config.logger.verbose))
        allow_bytecode()  # before any process starts: they all inherit it
        clock.end("driver")
        mps = uses_mps(config)  # auto: decided once, where the placement was
        if mps:  # before Ray: every process it starts inherits the server's address
            mps = cleanup.enter_context(mps_server(run_dir, required=config.vllm.mps == "on"))
        if mps:
            progress(f"the engine and the actor share the GPU under MPS (its logs: {run_dir}/mps)")
        prestarted = prestart_engines(config, run_dir)  # vLLM imports in them while Ray starts
        cleanup.callback(stop_prestarted, prestarted)
        with ThreadPoolExecutor(1) as background:  # the tiny model builds while Ray starts
            building = background.submit(_model_dir, config, run_dir, clock)
            config = _start_ray(config, clock)  # placed on a joined cluster's GPUs (molt._placement)
            cleanup.callback(ray.shutdown)
            model_dir = building.result()
        lora = bool(config.actor.lora.rank)  # attached engines must serve the adapter refits swap in
        attached = check_attached(config.vllm.urls, lora=lora)  # --vllm.urls: servers running already
        logs = "" if config.logger.verbose else str(run_dir.resolve())  # where each Ray worker writes
        clock.begin("engines")
        # None for --vllm.urls; each hands its server started ahead its flags; they load meanwhile.
        engines = launch_engines(model_dir, config, run_dir, [process.pid for process in prestarted])
        progress(f"starting {len(engines)} vLLM engine(s) and {config.actor.num_ranks} actor rank(s)")
        cleanup.callback(stop_engines, engines)
        engine_urls = [engine.url.remote() for engine in engines]  # each ready once its server answers
        if engine_starts_first(config, model_dir):  # vLLM sizes its KV cache from the memory it finds free
            ray.get(engine_urls)
        clock.begin("actor")
        policy = PolicyGroup(
            model_dir, config, config.actor.num_ranks, wait=False, log_prefix=logs and f"{logs}/actor",
            engines_loading=engine_urls,  # its compile warm-up fills their loading time, no longer
        )  # fmt: skip
        cleanup.callback(policy.shutdown)
        groups = start_extra_groups(config, model_dir, clock, logs, engine_urls)  # reference, critic, teacher
        for group in groups.values():
            cleanup.callback(group.shutdown)
        clock.begin("agent_hosts")
        hosts, hosts_ready = launch_hosts(
            config.agent.module, config.agent.num_runners, log_prefix=logs and f"{logs}/agents"
        )
        # While they load (seconds: the notes import transformers): what this process says and reads.
        for note in start_notes(config):
            progress(f"note: {note}")
        agent_module = load_agent(config.agent.module)  # checked by `validate`
        rows = RowStream(read_rows(config, agent_module), skip=state.consumed_rows if state else [])
        evaluation = eval_rows(config, agent_module) if config.eval.every else []
        if evaluation and (overlap := check_held_out(evaluation, config, agent_module)):
            progress(f"note: {overlap}")
        stages = {"engines": engine_urls, "actor": policy.ready_refs(), "agent_hosts": hosts_ready}
        with ThreadPoolExecutor(1) as background:  # tito's tokenizer loads while they start
            loading = background.submit(_processor, model_dir)
            clock.wait(stages | {name: group.ready_refs() for name, group in groups.items()})  # side by side
            processor = loading.result()
        for name, group in {"actor": policy, **groups}.items():  # where each group's start went
            clock.split(name, group.startup_seconds())
        if mps:
            progress(mps_report(run_dir))
        if checkpoint is not None:
            policy.load(checkpoint)
            if groups.get("critic"):
                groups["critic"].load(checkpoint)
            assert state is not None  # saved with its checkpoint
            restore_rng(state)
            progress(f"resumed from {checkpoint} (step {state.step}, {len(state.consumed_rows)} rows done)")
        urls = attached or ray.get(engine_urls)
        if attached or checkpoint is not None:  # the engines must serve this run's weights, as its version
            policy.refit(urls, first_step - 1)
        if attached:  # trusted once they label and score their tokens as molt's own engines do
            check_attached_serving(
                urls, policy.logprobs, version=first_step - 1, temperature=config.rollout.temperature,
                compute_dtype=compute_dtype_name(config), model=ADAPTER if lora else None,
            )  # fmt: skip
        progress(f"engines ready at {', '.join(urls)}; training to step {config.train.num_steps}")
        chat = issubclass(agent_module.AgentRunner, ChatAgent)
        parts = dict(
            policy=policy,
            rows=rows,
            log=cleanup.enter_context(contextlib.closing(RunLog(config))),  # closed on any exit
            model_dir=model_dir,
            eval_rows=evaluation,
            first_step=first_step,
            startup=clock,
            filters=GroupFilters.of(config),  # --algo.filters: the pool's keep, bounded in each take
            **groups,
        )
        asyncio.run(
            _serve_and_run(config, parts, urls, hosts, chat=chat, actors=engines, processor=processor)
        )
        progress(f"done; metrics in {run_dir / 'metrics.jsonl'}")


def _processor(model_dir: Path) -> Any:
    """The model's processor for tito: its tokenizer (and a vision-language model's image processor)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def start_extra_groups(
    config: Config, model_dir: Path, clock: StartupClock, logs: str, engines_loading: list | None = None
) -> dict:
    """The optional groups placed beside the policy, by name (`Run`'s fields); none unless asked for.
    Returns once their ranks are placed (`ready_refs` are ready once they have loaded). `logs`: the
    directory their ranks write their output into (empty: Ray's worker logs); `engines_loading`: as the
    policy's (`PolicyGroup`)."""
    algo, num_ranks, groups = config.algo, config.actor.num_ranks, {}
    started = {  # name -> its model and what it is; the reference: the initial weights, frozen
        "reference": (model_dir, "the reference policy (--algo.kl.coef)"),
        "critic": (algo.critic.model or model_dir, "the critic (--algo.advantage.estimator gae)"),
        "teacher": (algo.teacher.model, f"the teacher {algo.teacher.model} (--algo.advantage.estimator opd)"),
    }
    for name in extra_groups(config):  # a resumed run reloads the frozen ones from their initial weights
        model, what = started[name]
        progress(f"starting {what}")
        critic, prefix = name == "critic", logs and f"{logs}/{name}"
        kind = CriticGroup if critic else PolicyGroup  # the critic alone trains
        groups[name] = kind(
            model, config, num_ranks, trainable=critic, wait=False, log_prefix=prefix,
            engines_loading=engines_loading,
        )  # fmt: skip
        clock.begin(name)  # its ranks are placed: they load from now on
    return groups


def _start_ray(config: Config, clock: StartupClock) -> Config:
    """Join `--ray.address`, or start a fresh local Ray (never one found running here); returns the config
    placed on the joined cluster's GPUs. Ray workers' own output reaches the console only with
    --logger.verbose (each worker writes into the run directory)."""
    progress("starting Ray")
    clock.begin("ray")
    quiet: dict[str, Any] = dict(include_dashboard=False, log_to_driver=config.logger.verbose)
    # --ray.num_cpus is none where --ray.address joins a cluster (`molt._checks.check_paths`)
    ray.init(address=config.ray.address or "local", num_cpus=config.ray.num_cpus, **quiet)
    if config.ray.address:
        config = check_cluster_gpus(config)  # Ray would wait forever for GPUs the cluster does not have
    clock.end("ray")
    return config


async def _serve_and_run(
    config: Config, parts: dict, engine_urls: list[str], hosts, *, chat: bool, actors: list, processor: Any
) -> None:
    """tito in this process (and on loopback HTTP for a ChatAgent), the pool, then `run_steps` over `parts`
    (the `Run` fields started by `train`). `actors`: the engines' actors, which restart them (none for
    attached engines); `processor`: the model's, loaded already."""

    parts["startup"].begin("tito")
    tito = Tito(
        engine_urls,
        parts["model_dir"],
        served_model_name="policy",
        fixed_sampling=sampling(config),  # every turn, whatever an SDK agent asks
        # every request samples from the refitted adapter
        engine_model=ADAPTER if config.actor.lora.rank else None,
        # the engines molt starts send each reply in chunks (attached ones keep their own flags)
        stream_replies=config.vllm.stream_interval > 0 and not config.vllm.urls,
        compact_stream=True,  # every engine of a run runs refit's middleware, attached ones too
        processor=processor,
    )
    restarts = EngineRestarts(tito.router, actors, parts["policy"], max_restarts=config.vllm.max_restarts)
    api_key = secrets.token_hex(16)  # the loopback server answers only this run's agents
    try:
        async with serve_on_loop(create_app(tito, api_key=api_key)) as chat_url:
            parts["startup"].end("tito")
            runner = RolloutRunner(
                tito, config, hosts, chat_url=chat_url if chat else "", api_key=api_key, restarts=restarts
            )
            pool = prompt_pool(config, runner, parts["rows"], keep=parts["filters"])
            pool.version = parts["first_step"] - 1  # the engines' weights, pushed before the pool starts
            run = Run(tito=tito, pool=pool, runner=runner, restarts=restarts, **parts)
            async with pool:
                try:
                    await run_steps(config, run)
                except PoolExhausted as end:
                    if (cause := end.__cause__) is not None:  # the dataset itself failed
                        raise RuntimeError(f"reading the dataset failed: {cause!r}") from cause
                    progress("the dataset is used up; stopping early")
                    await end_early(config, run)
    finally:
        restarts.cancel()
        await tito.aclose()


def prompt_pool(config: Config, runner, rows, *, keep: GroupFilters | None = None) -> GroupPool:
    """The pool of prompt groups of `--rollout.*`: `runner` samples each group of `rows`; `keep`: the
    filters of --algo.filters (`GroupFilters.of`)."""
    rollout = config.rollout
    return GroupPool(
        runner,
        rows,
        group_size=rollout.group_size,
        depth=rollout.queue_depth,
        max_lag=rollout.max_lag,
        keep=keep,
        retry_delay=0.5,
        stale=rollout.stale,
        max_requeues=rollout.max_stale_requeues,
        cost=sampled_tokens,  # pool/wasted_frac counts generated tokens
        batch=rollout.prompts_per_step,  # admission bounds even the first fill by --rollout.max_lag
    )


def _model_dir(config: Config, run_dir: Path, clock: StartupClock) -> Path:
    if config.model.path:
        return Path(config.model.path)
    from molt.tiny import build_tiny_model

    progress("no --model.path: building the seeded tiny model into the run directory")
    clock.begin("model")
    model_dir = build_tiny_model(run_dir / "model", seed=config.train.seed)
    clock.end("model")
    return model_dir
