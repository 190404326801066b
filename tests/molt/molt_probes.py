"""What a run builds from its config, observed cheaply: one function per part of a run, each called with a
resolved `Config` and a fresh working directory (the current one: where a run writes), returning what
that part did with the config: the arguments of the processes it starts, the tensors a step sees, the
metrics and files it writes, never the config itself. `test_molt_flags_act.py` runs every flag through one.

The production code runs as a run runs it; these stand in for what this machine cannot start cheaply:
Ray (`fake_ray`: what `ray.remote(...)(cls).remote(...)` would start), an engine (`FakeEngine`, behind
tito's httpx transport), W&B's service process, NVIDIA's MPS control daemon (`fake_mps_control`), and in
`loop_run` the actor groups (they record what each step gives them). Legend: B sequences, T tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import os
import subprocess
import zlib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import httpx
import msgspec
import torch

import molt._log
import molt._mps
from molt._batch import NO_INPUTS, StepInputs, collate
from molt._data import RowStream, eval_rows, read_rows
from molt._engines import launch_engines
from molt._filters import GroupFilters
from molt._launch import _model_dir, _start_ray, prompt_pool, start_extra_groups
from molt._log import RunLog, StartupClock
from molt._metrics import evaluate
from molt._mps import mps_server, uses_mps
from molt._objective import step_loss
from molt._placement import compiles, extra_groups
from molt._restarts import EngineRestarts
from molt._rollout import Rollout, RolloutRunner, sampling
from molt._runners import launch_hosts
from molt._sharding import compute_dtype, distributed_settings
from molt.agent import load_agent
from molt.config import Config, with_run_dir
from molt.tiny import TINY_SHAPE
from molt.vllm_server import free_port
from tito import Segment, Tito

NOW = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)  # the default run directory's timestamp


def files(where: Path) -> list[str]:
    """The files under `where`, relative, each name cut at its first dot (TensorBoard names its event
    files after the clock and the host)."""
    found = [path for path in where.rglob("*") if path.is_file()]
    return sorted(str(path.relative_to(where).parent / path.name.split(".")[0]) for path in found)


@contextlib.contextmanager
def fake_ray():
    """Ray as far as starting actors goes; yields the list of what was started: (class name, GPUs asked
    for, the constructor's arguments)."""
    import ray

    started = []

    class Actors:
        def __init__(self, cls, options: dict) -> None:
            self.cls, self.opts = cls, options

        def options(self, **more) -> Actors:
            return Actors(self.cls, {**self.opts, **more})

        def remote(self, *args):
            started.append((self.cls.__name__, self.opts.get("num_gpus", 0), args))
            return SimpleNamespace(__ray_ready__=SimpleNamespace(remote=lambda: "ready"))

    node = SimpleNamespace(get_node_id=lambda: "0" * 56)
    with (
        mock.patch.object(ray, "remote", lambda **options: lambda cls: Actors(cls, options)),
        mock.patch.object(ray.util, "get_node_ip_address", lambda: "127.0.0.1"),
        mock.patch.object(ray, "get_runtime_context", lambda: node),
    ):
        yield started


# --- processes a run starts ---


def engines(config: Config, where: Path) -> list:
    """The vLLM engine actors `launch_engines` starts: GPUs, model, command-line flags, environment. The
    tiny model's config stands for the model directory the run would build (its KV cache is sized from
    it)."""
    model_dir = Path(config.model.path) if config.model.path else where / "model"
    if not config.model.path:
        model_dir.mkdir(exist_ok=True)
        shape = {"num_hidden_layers": 2, "hidden_size": 64, **TINY_SHAPE}
        (model_dir / "config.json").write_text(json.dumps(shape))
    with fake_ray() as started:
        launch_engines(model_dir, config, Path("run"))
    return [
        (name, gpus, (str(args[0]).replace(str(where), "<tmp>"), *args[1:])) for name, gpus, args in started
    ]


def groups(config: Config, where: Path) -> list:
    """The reference, critic and teacher ranks started beside the policy: GPUs, rank, world size, model,
    trainable (the port and the config they are handed left out)."""
    with fake_ray() as started:
        start_extra_groups(config, Path(config.model.path or "model"), StartupClock(), "")
    return [(name, gpus, args[0], args[1], args[4], args[6]) for name, gpus, args in started]


def hosts(config: Config, where: Path) -> list:
    """The agent hosts: Ray actors started with their arguments, or one host in this process."""
    with fake_ray() as started:
        made, _ = launch_hosts(config.agent.module, config.agent.num_runners)
    return [type(host).__name__ for host in made] + started


def ray_init(config: Config, where: Path) -> list[dict]:
    """What `ray.init` is asked for: the cluster to join, the CPUs of a local one, the workers' output."""
    import ray

    asked = []
    with mock.patch.object(ray, "init", lambda **kwargs: asked.append(kwargs)):
        _start_ray(config, StartupClock())
    return asked


def restarts(config: Config, where: Path) -> tuple:
    """An engine molt started, found dead: restarted (how many times so far), or the run stops."""
    engine = SimpleNamespace(url="http://engine", alive=False)

    async def restart() -> str:
        return "http://engine-restarted"

    actor = SimpleNamespace(restart=SimpleNamespace(remote=restart), log_report=SimpleNamespace(remote=str))

    async def notice() -> tuple:
        router = SimpleNamespace(engines=[engine], replace=lambda old, url: None)
        found = EngineRestarts(router, [actor], None, max_restarts=config.vllm.max_restarts)
        with mock.patch("ray.get", lambda ref, timeout=None: "its log"):
            found.notice()
        found.cancel()
        return found.restarts, found.failure is not None

    return asyncio.run(notice())


FAKE_MPS_CONTROL = """#!/bin/sh
# What the run asks NVIDIA's MPS control daemon, written into its log directory: start (-d), or the
# command it reads (quit, get_server_list, get_client_list SERVER), answered from FAKE_MPS_SERVERS and
# FAKE_MPS_CLIENTS. The environment says which daemon (its pipe directory).
if [ "$1" = "-d" ]; then
  echo "-d $CUDA_MPS_PIPE_DIRECTORY" >> "$CUDA_MPS_LOG_DIRECTORY/calls"
  exit ${FAKE_MPS_EXIT:-0}
fi
command=$(cat)
echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$CUDA_MPS_LOG_DIRECTORY/calls"
case "$command" in
  get_server_list) for pid in ${FAKE_MPS_SERVERS-4242}; do echo $pid; done ;;
  get_client_list*) for pid in ${FAKE_MPS_CLIENTS-101 102}; do echo $pid; done ;;
esac
"""


def fake_mps_control(monkeypatch, directory: Path) -> Path:
    """A stand-in for `nvidia-cuda-mps-control` (the real one needs NVIDIA's driver) in `directory`, put
    first on PATH, on a machine whose processes no MPS server serves yet (none named by the environment,
    no daemon at CUDA's default pipe directory); `FAKE_MPS_EXIT` sets what its start (-d) exits with."""
    directory.mkdir(parents=True, exist_ok=True)
    control = directory / "nvidia-cuda-mps-control"
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(molt._mps, "DEFAULT_PIPE", str(directory / "no-mps"))
    return directory


def mps(config: Config, where: Path) -> list[str]:
    """What a run asks the MPS control daemon (`fake_mps_control` on PATH) before Ray and after it, and
    the MPS variables a process started in between inherits; nothing where it starts no MPS server."""
    if not uses_mps(config):
        return []
    with mps_server(where):
        inherited = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout.splitlines()
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    lines = [line for line in inherited if line.startswith("CUDA_MPS_")]
    lines += (where / "mps" / "calls").read_text().splitlines()
    return sorted(line.replace(pipe, "<pipe>").replace(str(where.resolve()), "<run>") for line in lines)


# --- what a run reads and writes ---


def model_dir(config: Config, where: Path) -> str:
    """The policy's model directory: --model.path, or the tiny model built into the run directory."""
    built = _model_dir(config, where, StartupClock())
    return str(built.relative_to(where) if built.is_relative_to(where) else built)


def rows(config: Config, where: Path) -> list[dict]:
    """The first training rows, from --data.path or the agent module's dataset."""
    return list(itertools.islice(read_rows(config, load_agent(config.agent.module)), 6))


def eval_rows_of(config: Config, where: Path) -> list[dict]:
    """The evaluation rows, from --eval.path or the agent module's eval_dataset."""
    return eval_rows(config, load_agent(config.agent.module))


def log_files(config: Config, where: Path) -> dict:
    """The files one logged step writes, and the W&B project a run starts (W&B itself does not start)."""
    projects = []
    with mock.patch.object(molt._log, "start_wandb", lambda run_dir, project, cfg: projects.append(project)):
        config = with_run_dir(config, now=NOW)
        Path(config.logger.run_dir).mkdir(parents=True)
        log = RunLog(config)
        log.step(1, {name: 0.5 for name in _CONSOLE})
        log.close()
    return {"files": files(where), "wandb": projects}


# What the console line of a step reads.
_CONSOLE = ["rollout/reward_mean", "rollout/response_len_mean", "train/policy_loss", "train/mismatch_kl",
            "train/staleness_mean", "timing/generation", "timing/policy_train", "timing/broadcast",
            "timing/step_total"]  # fmt: skip


# --- the rollouts ---


class FakeEngine:
    """vLLM's generate endpoint as tito calls it (an httpx transport's handler): records each request and
    samples up to three fixed tokens."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": 512}]})
        body = json.loads(request.content)
        self.requests.append(body)
        tokens = [7, 8, 9][: body["sampling_params"]["max_tokens"]]
        logprobs = {"content": [{"token_id": token, "logprob": -0.5} for token in tokens]}
        choice = {"index": 0, "token_ids": tokens, "logprobs": logprobs, "finish_reason": "length"}
        return httpx.Response(200, json={"choices": [choice]})


def episode(config: Config, where: Path) -> dict:
    """One rollout of the first row through real tito and an in-process agent host: what the engine was
    asked (prompt tokens, sampling), and how the rollout ended."""
    engine = FakeEngine()
    transport = httpx.MockTransport(engine)
    # the run's fixed sampling, as `molt train` gives its tito (`RolloutRunner` asks for none of its own)
    tito = Tito(
        ["http://engine"], config.model.path, engine_transport=transport, fixed_sampling=sampling(config)
    )
    (host,), _ = launch_hosts(config.agent.module, 0)
    runner = RolloutRunner(tito, config, [host])
    row = next(read_rows(config, load_agent(config.agent.module)))

    async def run():
        try:
            return (await runner(row, 0)).reward
        except Exception as error:  # how it failed is what is observed
            return type(error).__name__
        finally:
            await tito.aclose()

    outcome = asyncio.run(run())
    host.threads.shutdown()
    return {"outcome": outcome, "failures": runner.failures, "requests": engine.requests}


def pool(config: Config, where: Path) -> dict:
    """The prompt-group pool's settings."""
    made = prompt_pool(config, None, iter([]))
    return {name: getattr(made, name) for name in ("group_size", "depth", "max_lag", "stale", "max_requeues")}


def filters(config: Config, where: Path) -> tuple | None:
    """The pool's filters: None, or their bound and whether they keep a group of equal rewards and one with
    a truncated sample."""
    keep = GroupFilters.of(config)
    equal = SimpleNamespace(prompt="p", samples=[SimpleNamespace(reward=1.0, truncated=False)] * 2)
    samples = [SimpleNamespace(reward=0.0, truncated=False), SimpleNamespace(reward=1.0, truncated=True)]
    cut = SimpleNamespace(prompt="p", samples=samples)
    return None if keep is None else (keep.max_groups, keep(equal), keep(cut))


def eval_scores(config: Config, where: Path) -> dict[str, float]:
    """eval/* of two rows whose i-th sample earns i / 2."""

    async def runner(row: dict, index: int) -> Rollout:
        segment = Segment([1, 2], [0, 1], [0.0, -1.0], [-1, 0])
        return Rollout([segment], index / 2, [2], truncated=False)

    return asyncio.run(evaluate(runner, [{"id": 0}, {"id": 1}], config))


# --- the actor ---

# Two rows of the tiny model's tokens, the second's reply longer.
ROWS = [([1, 5, 9, 11, 12, 7], [0, 0, 0, 1, 1, 1], [-4.0] * 6, 1.0),
        ([1, 6, 7, 13, 8, 9], [0, 0, 1, 1, 1, 1], [-4.0] * 6, -1.0)]  # fmt: skip


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.detach().full_tensor() if isinstance(param, DTensor) else param.detach().clone()


@contextlib.contextmanager
def _rank(worker_class: type, config: Config):
    """One rank of `worker_class` in this process (gloo), on one thread as a CPU rank is (`PolicyGroup`
    starts each with OMP_NUM_THREADS=1: on a busy machine two threads per op wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield worker_class(0, 1, "127.0.0.1", free_port(), config.model.path, config)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)


def parallelism(config: Config, where: Path) -> dict:
    """What AutoModel is asked to build the actor's ranks with (strategy, sizes, checkpointing)."""
    on_gpu = torch.cuda.is_available()
    return distributed_settings(config, config.actor.num_ranks, compute_dtype(config), on_gpu=on_gpu)


def compiled(config: Config, where: Path) -> bool:
    """Whether the actor compiles its decoder layers."""
    return compiles(config, on_gpu=torch.cuda.is_available())


def policy_step(config: Config, where: Path) -> dict:
    """One policy rank in this process (gloo): its micro-batch budget, the parameters it trains, two
    optimizer steps' metrics, the weights after them and what a refit then sends."""
    import refit
    from molt._actor import PolicyWorker

    torch.manual_seed(0)  # LoRA's initial adapters
    sent = {}

    def update_weights(engines, params, **kwargs) -> None:
        sent.update(kwargs, dtypes={spec.dtype for spec in params.specs})

    with _rank(PolicyWorker, config) as worker:
        steps = [worker.train_step(collate(ROWS, pad_id=0)) for _ in range(2)]
        with mock.patch.object(refit, "update_weights", update_weights):
            worker.refit(["http://127.0.0.1:1"], refit.GLOO_BACKEND, 1, "127.0.0.1")
        weights = {name: _full(param) for name, param in worker.model.named_parameters()}
        trained = [name for name, param in worker.model.named_parameters() if param.requires_grad]
    return {"budget": worker.micro_batch_layout()[:2], "trained": trained, "steps": steps, "weights": weights,
            "refit": sent}  # fmt: skip


PROMPT = [1, *range(20, 40)]  # 21 tokens: more than molt._prefix.MIN_SHARED_TOKENS
SHARED_ROWS = [(PROMPT + [5, 6], [0] * 21 + [1, 1], [-4.0] * 23, 1.0),
               (PROMPT + [7, 8, 9], [0] * 21 + [1, 1, 1], [-4.0] * 24, -1.0)]  # fmt: skip


def prefix_pass(config: Config, where: Path) -> dict:
    """One policy rank's logprob pass over two rows that share a 21-token prompt: the token slots it ran
    and those a shared prefix saved."""
    from molt._actor import PolicyWorker

    with _rank(PolicyWorker, config) as worker:
        worker.logprobs(collate(SHARED_ROWS, pad_id=0))
        counts = worker.take_pass_counts()
    return {"slots": counts["slots"], "saved": counts["saved"]}


def critic_step(config: Config, where: Path) -> dict:
    """One critic rank in this process (gloo): one step's metrics, against values of 1 and returns of -1
    (the new head's values, 0, are 1 away: the clipped loss is the larger)."""
    from molt._critic import CriticWorker, data_parallel_only

    batch = collate(ROWS, pad_id=0)
    old_values_BT = torch.ones_like(batch.loss_mask_BT)
    with _rank(CriticWorker, data_parallel_only(config)) as worker:
        return worker.train_step(batch, StepInputs(old_values_BT=old_values_BT, returns_BT=-old_values_BT))


def loss(config: Config, where: Path) -> dict:
    """`step_loss` of a fixed synthetic micro-batch whose ratios (trainer to old, old to engine) spread
    over e^-1.5 .. e^1.5, with advantages of both signs: the loss, its gradient and its metric sums."""
    gen = torch.Generator().manual_seed(0)
    mask_BT = torch.ones(4, 6)
    mask_BT[:, 0] = 0
    mask_BT[1, 4:] = mask_BT[2, 3:] = 0  # rows of 5, 3, 2 and 5 trainable tokens

    def spread() -> torch.Tensor:
        return (torch.rand(4, 6, generator=gen) - 0.5) * 3

    logp_BT = (-2 * torch.rand(4, 6, generator=gen)).requires_grad_()
    old_logp_BT = logp_BT.detach() + spread()
    rollout_logp_BT, ref_logp_BT = old_logp_BT + spread(), old_logp_BT + spread()
    advantages_BT = torch.tensor([[1.0], [-1.0], [2.0], [-0.5]]) * mask_BT
    entropy_BT = torch.rand(4, 6, generator=gen).requires_grad_()
    total, sums = step_loss(
        logp_BT, entropy_BT, old_logp_BT, rollout_logp_BT, advantages_BT, mask_BT,
        num_tokens=int(mask_BT.sum()), num_seqs=4, algo=config.algo, ref_logp_BT=ref_logp_BT,
    )  # fmt: skip
    total.backward()
    return {"loss": total.detach(), "grad": logp_BT.grad, "entropy_grad": entropy_BT.grad, **sums}


# --- the loop ---


class _Rollouts:
    """The pool's (and evaluation's) rollout: a fixed 3-token reply to each row and sample, sampled at the
    pool's version, rewarded 0, 0.5 or 1 by the row and the sample."""

    def __init__(self) -> None:
        self.pool = None
        self.restarts: EngineRestarts | None = None  # the run's, set by `loop_run`
        self.failures: dict[str, int] = {}

    async def __call__(self, row: dict, index: int) -> Rollout:
        key = zlib.crc32(json.dumps(row, sort_keys=True).encode())
        sampled = [10 + (key + index) % 7, 20 + index % 3, 30]
        version = self.pool.version
        segment = Segment([1, 2, 3 + key % 5, *sampled], [0, 0, 0, 1, 1, 1], [0, 0, 0, -0.5, -1.0, -1.5],
                          [-1, -1, -1, version, version, version])  # fmt: skip
        return Rollout([segment], ((key + index) % 3) / 2, sampled, truncated=False)


class _Group:
    """An actor group that records what each optimizer step is given: the policy (a logprob is 0.9 of
    the engine's), a frozen reference or teacher (1.1 of it), or the critic (a value of 0.25 a token)."""

    def __init__(self, rollouts: _Rollouts, scale: float = 0.9) -> None:
        self.rollouts, self.scale = rollouts, scale
        self.steps: list[tuple] = []
        self.refits: list[bool] = []  # whether the pool held new groups back during each refit
        self.warm_ups: list[int] = []  # the optimizer steps taken before each compile warm-up pass

    def warm_up_more(self) -> int:
        """One pass of a compile warm-up two passes long; the passes left."""
        self.warm_ups.append(len(self.steps))
        return max(0, 2 - len(self.warm_ups))

    def logprobs(self, batch, *, trained_only=False):
        return batch.rollout_logp_BT * self.scale

    def values(self, batch):
        return batch.loss_mask_BT * 0.25

    def train_step(self, batch, inputs: StepInputs = NO_INPUTS) -> dict[str, float]:
        self.steps.append((batch.advantages_BT, batch.num_tokens, inputs.given()))
        return {"train/policy_loss": 0.0, "train/mismatch_kl": 0.0, "train/lr": 1.0}

    def pass_metrics(self) -> dict[str, float]:
        return {}

    def refit(self, urls: list[str], version: int) -> dict:
        self.refits.append(self.rollouts.pool._pauses > 0)
        return {}

    def save(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


def loop_run(
    config: Config,
    where: Path,
    rollouts: _Rollouts | None = None,
    skip: list[int] | None = None,
    *,
    warm_ups: bool = False,
) -> dict:
    """`run_steps`, the loop itself, over a real pool of stand-in rollouts (`rollouts`, default
    `_Rollouts`), real rows (less those in `skip`, as a resumed run's) and a real metrics log, with
    recording actor groups: what each optimizer step was given, whether refits held the pool, the logged
    metrics (timings and waits left out) and the files written; with `warm_ups`, the optimizer steps
    each group had taken at each compile warm-up pass. A run that hangs raises TimeoutError after a
    minute."""
    from molt.loop import Run, run_steps

    config = with_run_dir(config, now=NOW)
    run_dir = Path(config.logger.run_dir)
    run_dir.mkdir(parents=True)
    (where / "model").mkdir()
    agent = load_agent(config.agent.module)
    rows, rollouts = RowStream(read_rows(config, agent), skip=skip or []), rollouts or _Rollouts()
    policy = _Group(rollouts)
    extra = {name: _Group(rollouts, scale=1.1) for name in extra_groups(config)}
    engine = SimpleNamespace(url="http://engine", alive=True)
    tito = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0), renderer=SimpleNamespace(images=None),
                           router=SimpleNamespace(engines=[engine]))  # fmt: skip
    no_events = msgspec.structs.replace(config.logger, tensorboard=False)
    log = RunLog(msgspec.structs.replace(config, logger=no_events))
    parts = dict(policy=policy, tito=tito, runner=rollouts, rows=rows, log=log, model_dir=where / "model",
                 eval_rows=eval_rows(config, agent) if config.eval.every else [], **extra)  # fmt: skip

    async def run() -> None:
        keep = GroupFilters.of(config)
        rollouts.pool = prompt_pool(config, rollouts, rows, keep=keep)
        async with rollouts.pool:
            rollouts.restarts = EngineRestarts(tito.router, [], policy, max_restarts=0)  # none to restart
            run = Run(pool=rollouts.pool, filters=keep, restarts=rollouts.restarts, **parts)
            await asyncio.wait_for(run_steps(config, run), timeout=60)

    try:
        asyncio.run(run())
    finally:
        log.close()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timed = lambda name: name.startswith("timing/") or name.endswith("_s")  # noqa: E731
    metrics = [{k: v for k, v in json.loads(line).items() if not timed(k)} for line in lines]
    steps = {name: group.steps for name, group in {"policy": policy, **extra}.items()}
    result = {"steps": steps, "refits": policy.refits, "metrics": metrics, "files": files(where)}
    if warm_ups:  # how many passes ran depends on when the first groups came: not the run's own doing
        result["warm_ups"] = {name: group.warm_ups for name, group in {"policy": policy, **extra}.items()}
    return result
