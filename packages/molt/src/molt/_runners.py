"""Agent runners placed by Ray: actors that host the user's `Env` episodes.

The framework's side of an Env episode (rendering, sampling through tito, capture) stays on the
trainer's event loop; the user's side (`reset`, `step`: scoring, tools, sandboxes) runs in these actors,
so a slow or heavy environment never blocks generation, and runners can live on other machines. One
actor hosts many episodes at once (an async actor; plain methods run in its threads).
"""

from __future__ import annotations

import asyncio
import inspect

import ray

from molt.agent import Result, load_agent

__all__ = ["EnvRunner", "launch_runners"]


async def call_user(method, *args):
    """Call a user method that may be plain or async; plain ones run in a thread (they may block)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


class EnvRunner:
    """Episodes of the agent module's `AgentRunner` (a fresh instance each), keyed by episode id."""

    def __init__(self, agent_module: str) -> None:
        self.runner_class = load_agent(agent_module).AgentRunner
        self.episodes: dict[str, object] = {}

    async def reset(self, episode: str, row: dict):
        env = self.episodes[episode] = self.runner_class()
        return await call_user(env.reset, row)

    async def step(self, episode: str, action: str) -> Result:
        return await call_user(self.episodes[episode].step, action)

    async def close(self, episode: str) -> None:
        self.episodes.pop(episode, None)


def launch_runners(agent_module: str, num_runners: int) -> list:
    remote = ray.remote(num_cpus=0)(EnvRunner)
    runners = [remote.remote(agent_module) for _ in range(num_runners)]
    ray.get([runner.__ray_ready__.remote() for runner in runners])  # a broken agent module fails here
    return runners
