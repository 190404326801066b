"""Agent hosts placed by Ray: actors that run the user's agents, away from the trainer's event loop.

For an `Env`, the framework's side of an episode (rendering, sampling through tito, capture) stays on
the trainer's event loop and the user's side (`reset`, `step`: scoring, tools, sandboxes) runs here. A
`ChatAgent` runs here whole and talks to tito over HTTP like any SDK program. Either way a slow or heavy
agent never blocks generation, and hosts can live on other machines. One actor hosts many episodes at
once (an async actor; plain methods run in its threads).

`--agent.num_runners 0` puts one host in the trainer's process instead: no Ray call per `reset` and
`step` (about a millisecond of CPU on each side), for agents cheap enough to share the trainer's
machine. Plain methods still run in threads; an async agent then runs on the trainer's event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor

import ray

from molt._log import redirect_output
from molt.agent import Context, Env, Result, load_agent

MAX_AGENT_THREADS = 256  # plain (blocking) agents running at once in one host


class AgentHost:
    """Episodes of the agent module's `AgentRunner` (a fresh instance each), keyed by episode id."""

    def __init__(self, agent_module: str, log_path: str = "") -> None:
        if log_path:  # a Ray actor's third-party output goes there
            redirect_output(log_path)
        self.runner_class = load_agent(agent_module).AgentRunner
        self.episodes: dict[str, Env] = {}
        # asyncio's default pool has cpu_count + 4 threads: too few for blocking SDK agents.
        self.threads = ThreadPoolExecutor(MAX_AGENT_THREADS, thread_name_prefix="agent")

    async def reset(self, episode: str, row: dict):
        env = self.episodes[episode] = self.runner_class()
        return await self._call_user(env.reset, row)

    async def step(self, episode: str, action: str) -> Result:
        result = await self._call_user(self.episodes[episode].step, action)
        if not isinstance(result, Result):
            raise TypeError(f"{self.runner_class.__name__}.step returned {result!r}; return a molt.Result")
        if result.observation is None:  # the episode is over: no `close` call needed
            self.episodes.pop(episode, None)
        return result

    async def close(self, episode: str) -> None:
        self.episodes.pop(episode, None)

    async def run(self, ctx: Context, row: dict) -> Result:
        """A whole ChatAgent episode."""
        return await self._call_user(self.runner_class().run, ctx, row)

    async def _call_user(self, method, *args):
        """Call a user method that may be plain or async; plain ones run in a thread (they may block), and
        what one hands back to await (its helper's coroutine, say) is awaited here."""
        if inspect.iscoroutinefunction(method):
            return await method(*args)
        result = await asyncio.get_running_loop().run_in_executor(self.threads, method, *args)
        return await result if inspect.isawaitable(result) else result


class RemoteHost:
    """An `AgentHost` Ray actor, awaited like a local one. A cancelled call cancels the remote task."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def reset(self, episode: str, row: dict):
        return await self._call(self.actor.reset.remote(episode, row))

    async def step(self, episode: str, action: str) -> Result:
        return await self._call(self.actor.step.remote(episode, action))

    async def close(self, episode: str) -> None:
        await self._call(self.actor.close.remote(episode))

    async def run(self, ctx: Context, row: dict) -> Result:
        return await self._call(self.actor.run.remote(ctx, row))

    @staticmethod
    async def _call(ref):
        try:
            return await ref
        except asyncio.CancelledError:  # a timeout or the pool closing: stop the agent's work too
            ray.cancel(ref)
            raise


def launch_hosts(
    agent_module: str, num_hosts: int, *, log_prefix: str = ""
) -> tuple[list[AgentHost] | list[RemoteHost], list]:
    """`num_hosts` agent hosts as Ray actors, or one in this process for 0 (module docstring), and a Ray
    object ref per actor that is ready once it has imported the agent (a broken module fails there).
    `log_prefix`: host i writes its output into `{log_prefix}-{i}.log` (empty: Ray's worker logs)."""
    if num_hosts == 0:
        return [AgentHost(agent_module)], []
    # No task events: a host runs several calls per rollout, and Ray would keep each one in its GCS
    # (the dashboard's task table), which grew by about 1.3 MiB a step on the default recipe.
    remote = ray.remote(num_cpus=0, enable_task_events=False)(AgentHost)
    logs = [f"{log_prefix}-{index}.log" if log_prefix else "" for index in range(num_hosts)]
    actors = [remote.remote(agent_module, log) for log in logs]
    return [RemoteHost(actor) for actor in actors], [actor.__ray_ready__.remote() for actor in actors]
