"""verifiers 0.4 environments train as they are: the taskset gives the rows, the environment runs each
episode, its rewards are the reward and its named rewards and metrics are logged as `rollout/*`.

    molt train --agent.module molt.integrations.verifiers:my_taskset        # an importable taskset module
    molt train --agent.module molt.integrations.verifiers:path/to/taskset.py

The module is what verifiers itself loads as a taskset id: it exports a `vf.Taskset` subclass (and, for
a multi-turn environment, a `vf.Env` subclass) in `__all__`. Each rollout is one verifiers episode whose
model calls go to the tito session molt opens for it (one session per rollout, so every turn of it is
captured token by token). Nothing reaches the network: every seat of the environment runs molt's harness
(`molt.integrations._verifiers_harness`: the chat in process, or verifiers' chat program under this
interpreter when the task has MCP tool servers) in a local subprocess runtime, not verifiers' defaults
(a remote sandbox, and harnesses that fetch their program from PyPI on every rollout).

Rows: the taskset's tasks in order (a finite taskset is reshuffled with the seed each pass). An episode
that records an error, or that ends without a score, raises: the rollout is lost and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import itertools
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from molt.agent import ChatAgent, Context, Result
from molt.integrations import require

__all__ = ["load"]

API_KEY_VAR = "MOLT_VERIFIERS_API_KEY"  # verifiers reads the endpoint's key from an environment variable
HARNESS_ID = "molt_verifiers_harness"  # verifiers resolves a harness id as a top-level module name
_SERVED: dict[tuple[str, int], asyncio.Task] = {}  # (taskset id, event loop) -> the serving environment


def _vf():
    vf = require("verifiers.v1", "verifiers")
    if HARNESS_ID not in sys.modules:
        sys.modules[HARNESS_ID] = importlib.import_module("molt.integrations._verifiers_harness")
    return vf


def _taskset_id(env: str) -> str:
    """A `.py` file is imported under its stem, which verifiers then finds as a taskset id."""
    if not env.endswith(".py"):
        return env
    path = Path(env).resolve()
    if not path.is_file():
        raise ValueError(f"verifiers taskset {env!r}: no such file")
    if path.stem not in sys.modules:
        # its tool servers run as `python -m STEM` in subprocesses, which find it through PYTHONPATH
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(path.parent), os.environ.get("PYTHONPATH")])
        )
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a file's spec, with its source loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    return path.stem


@functools.cache
def environment(taskset_id: str):
    """The verifiers environment of a taskset, each of its seats on molt's harness in a local runtime."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import environment_class

    env_class = environment_class(taskset_id)
    config_class = concrete_type(env_class, vf.EnvConfig)
    seats = [
        name for name, field in config_class.model_fields.items() if isinstance(field.default, vf.AgentConfig)
    ]
    offline = {"harness": {"id": HARNESS_ID}, "runtime": vf.SubprocessConfig()}
    config = config_class.model_validate({"taskset": {"id": taskset_id}, **dict.fromkeys(seats, offline)})
    return vf.load_environment(config)


async def _served(taskset_id: str):
    """The environment serving on this event loop (verifiers' interception server lives on it)."""
    key = (taskset_id, id(asyncio.get_running_loop()))
    if key not in _SERVED:

        async def start():
            env, stack = environment(taskset_id), contextlib.AsyncExitStack()
            await stack.enter_async_context(env.serving())  # held for the process's life
            return env

        _SERVED[key] = asyncio.ensure_future(start())
    return await asyncio.shield(_SERVED[key])


def _task(env, row: dict):
    task_class = type(env.taskset).task_type()
    return task_class(task_class.data_type().model_validate(row["task"]), env.taskset.config.task)


def result_of(episode) -> Result:
    """The episode's reward (the sum over its traces' weighted rewards) and its named rewards and metrics;
    an episode that failed or was never scored raises."""
    errors = [error for trace in episode.traces for error in trace.errors] + list(episode.errors)
    if errors or not episode.ok:
        raise RuntimeError(f"the verifiers episode failed: {errors or 'not ok'}")
    named = {k: r.score for t in episode.traces for k, r in t.rewards.items() if r is not None}
    metrics = {k: float(v) for t in episode.traces for k, v in t.metrics.items() if v is not None}
    if not any(t.rewards for t in episode.traces) or any(
        r is None for t in episode.traces for r in t.rewards.values()
    ):
        raise ValueError("the verifiers episode ended without a score (a reward is missing)")
    return Result(reward=sum(t.reward for t in episode.traces), info={**metrics, **named})


class VerifiersAgent(ChatAgent):
    """One verifiers episode per rollout, its model calls sent to this rollout's tito session."""

    taskset_id: str

    async def run(self, ctx: Context, sample: dict) -> Result:
        vf = _vf()
        os.environ[API_KEY_VAR] = ctx.api_key
        env = await _served(self.taskset_id)
        client = vf.EvalClientConfig(base_url=ctx.base_url, api_key_var=API_KEY_VAR)
        episode = await env.run_episode(_task(env, sample), vf.ModelContext(model=ctx.model, client=client))
        return result_of(episode)


def _wire(task) -> dict:
    return {"task": task.data.model_dump(mode="json", exclude_defaults=True)}


def _rows(taskset_id: str, seed: int) -> Iterator[dict]:
    taskset = environment(taskset_id).taskset
    if not taskset.bounded:  # an endless taskset: its own order
        yield from map(_wire, taskset)
        return
    tasks = [_wire(task) for task in taskset]
    if not tasks:
        raise ValueError(f"verifiers taskset {taskset_id!r} yields no tasks")
    for epoch in itertools.count():
        yield from random.Random(seed * 1_000_003 + epoch).sample(tasks, len(tasks))


def load(env: str) -> SimpleNamespace:
    """The agent namespace for a taskset module name or file (module docstring)."""
    taskset_id = _taskset_id(env)
    try:
        environment(taskset_id)
    except (ModuleNotFoundError, TypeError, AttributeError) as error:
        raise ValueError(f"verifiers cannot load the taskset {env!r}: {error}") from error
    runner = type("AgentRunner", (VerifiersAgent,), {"taskset_id": taskset_id})
    return SimpleNamespace(AgentRunner=runner, dataset=lambda seed: _rows(taskset_id, seed))
