"""Engines that come back (`molt._restarts`): a dead engine molt started is restarted through its Ray actor,
refit with the current weights before it takes a session, and a crash loop stops the run naming the log's
first error. The actors are real Ray actors standing in for `molt._engines.EngineActor` (no vLLM server:
tests/e2e/test_engine_restarts.py kills real ones); tito's router is real, over a transport that is never
called; the policy records its refits.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from dataclasses import dataclass

import httpx
import pytest

from asyncpool import GroupPool
from molt._group import EnginesLost
from molt._restarts import EngineRestarts
from molt.loop import refit_engines, take
from tito._engines import Router

pytestmark = pytest.mark.slow  # a local Ray


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class FakeEngineActor:
    """`EngineActor`'s restart surface: each restart serves at a new URL, or fails as a start that
    crashed does (`VLLMServer` raises with its log's report)."""

    def __init__(self, fail: str = "") -> None:
        self.fail, self.num_restarts = fail, 0

    def restart(self) -> str:
        self.num_restarts += 1
        if self.fail:
            raise RuntimeError(f"vLLM server exited with 1; its first error:\n{self.fail}")
        return f"http://engine-0-restart-{self.num_restarts}"

    def log_report(self) -> str:
        return "(whole log: engine-0.restart-1.log); the first error it logged:\nRuntimeError: CPU oom"


class Policy:
    """Records its refits; a refit of a URL in `dead` fails as the real group's does."""

    def __init__(self) -> None:
        self.refits: list[tuple[list[str], int]] = []
        self.dead: set[str] = set()

    def refit(self, urls, version):
        self.refits.append((list(urls), version))
        if failed := {url: "pause: ConnectError" for url in urls if url in self.dead}:
            raise EnginesLost(failed, updated=[url for url in urls if url not in failed])
        return {"transfer": 0.01}


def restarts_of(ray, num_engines=1, *, fail="", max_restarts=2):
    router = Router([f"http://engine-{i}" for i in range(num_engines)], transport=httpx.MockTransport(None))
    actors = [ray.remote(FakeEngineActor).remote(fail) for _ in range(num_engines)]
    return EngineRestarts(router, actors, Policy(), max_restarts=max_restarts)


async def restarted(restarts: EngineRestarts) -> None:
    """Notice the dead engines and wait until their restarts are done."""
    restarts.notice()
    await asyncio.gather(*restarts.restarting.values(), return_exceptions=True)


def test_a_dead_engine_comes_back_with_the_current_weights_before_it_serves(ray_local):
    async def main():
        restarts = restarts_of(ray_local)
        dead = restarts.router.engines[0]
        dead.alive = False  # tito found it dead
        waiting = asyncio.create_task(restarts.serving())  # a rollout that failed on it
        await restarted(restarts)
        back = restarts.router.engines[0]
        assert back is not dead and back.url == "http://engine-0-restart-1"
        assert not back.alive and not waiting.done()  # up, but not serving its initial weights
        with pytest.raises(Exception, match="no engine is answering"):
            restarts.router.assign()
        await restarts.bring_back(7)
        assert restarts.policy.refits == [(["http://engine-0-restart-1"], 7)]
        assert back.alive and not restarts.coming_back and restarts.num_restarts == 1
        await asyncio.wait_for(waiting, timeout=5)

    asyncio.run(main())


def test_an_engine_that_dies_during_the_steps_refit_is_restarted_and_the_run_goes_on(ray_local):
    """The only engine fails the refit of step 3 (it died while paused): before, the run stopped."""

    async def main():
        restarts = restarts_of(ray_local)
        tito = type("Tito", (), {"router": restarts.router})
        restarts.policy.dead.add("http://engine-0")
        assert await refit_engines(restarts.policy, tito, 3, restarts) == {}
        assert restarts.coming_back and restarts.num_restarts == 1
        await asyncio.gather(*restarts.restarting.values())
        await restarts.bring_back(3)
        assert restarts.router.engines[0].alive
        assert restarts.policy.refits[-1] == (["http://engine-0-restart-1"], 3)

    asyncio.run(main())


@dataclass(frozen=True)
class _Sample:
    reward: float = 1.0
    min_version: int = 0
    max_version: int = 0


def test_take_waits_for_the_restart_and_brings_the_engine_back_at_the_pools_version(ray_local):
    """A run whose only engine died: `take` neither stops ("no vLLM engine is answering") nor lets the
    engine serve before it has the weights of the pool's version; the rollouts that failed re-run."""

    async def main():
        restarts = restarts_of(ray_local)
        restarts.router.engines[0].alive = False
        served_by = []

        async def rollout(prompt, index):
            if not any(engine.alive for engine in restarts.router.engines):
                await restarts.serving()  # as `RolloutRunner` does before the pool retries
                raise ConnectionError("the engine died")
            served_by.append(restarts.router.assign().url)
            return _Sample()

        pool = GroupPool(rollout, itertools.cycle([{"p": 1}]), group_size=2, depth=2, retry_delay=0.01)
        pool.version = 4
        tito = type("Tito", (), {"router": restarts.router})
        async with pool:
            groups = await asyncio.wait_for(take(pool, 2, tito, restarts), timeout=60)
        assert len(groups) == 2 and pool.stats.failed == 0
        assert restarts.policy.refits == [(["http://engine-0-restart-1"], 4)]
        assert set(served_by) == {"http://engine-0-restart-1"}

    asyncio.run(main())


def test_an_engine_that_dies_again_while_it_is_brought_back_is_restarted_again(ray_local):
    """The restarted engine dies during the refit that would bring it back (the second kill of
    tests/e2e/test_engine_restarts.py, when the steps ran on groups already sampled): `take` restarts it
    again, within --vllm.max_restarts, instead of stopping with "no vLLM engine is answering"."""

    async def main():
        restarts = restarts_of(ray_local)
        restarts.router.engines[0].alive = False
        restarts.policy.dead.add("http://engine-0-restart-1")

        async def rollout(prompt, index):
            if not any(engine.alive for engine in restarts.router.engines):
                await restarts.serving()
                raise ConnectionError("the engine died")
            return _Sample()

        pool = GroupPool(rollout, itertools.cycle([{"p": 1}]), group_size=2, depth=2, retry_delay=0.01)
        tito = type("Tito", (), {"router": restarts.router})
        async with pool:
            groups = await asyncio.wait_for(take(pool, 2, tito, restarts), timeout=60)
        assert len(groups) == 2 and restarts.num_restarts == 2
        assert [urls for urls, _ in restarts.policy.refits] == [
            ["http://engine-0-restart-1"],
            ["http://engine-0-restart-2"],
        ]

    asyncio.run(main())


def test_a_crash_loop_stops_the_run_with_the_engine_logs_first_error(ray_local):
    async def main():
        restarts = restarts_of(ray_local, max_restarts=1)
        restarts.router.engines[0].alive = False
        await restarted(restarts)
        await restarts.bring_back(1)
        restarts.router.engines[0].alive = False  # it died again
        with pytest.raises(RuntimeError) as error:
            restarts.check()
        message = str(error.value)
        assert "died after 1 restart(s), the most --vllm.max_restarts allows" in message
        assert "RuntimeError: CPU oom" in message and "engine-0.restart-1.log" in message
        await restarts.serving()  # nothing is coming back: a waiting rollout fails at once

    asyncio.run(main())


def test_a_restarted_engine_whose_refit_fails_past_the_bound_names_the_refits_error(ray_local):
    """An engine can be up and still not come back: its refit failed. The run that stops then says so,
    not only what the engine's log holds (nothing, for an engine that did not crash)."""

    async def main():
        restarts = restarts_of(ray_local, max_restarts=1)
        restarts.policy.dead.add("http://engine-0-restart-1")
        restarts.router.engines[0].alive = False
        await restarted(restarts)
        with pytest.raises(RuntimeError) as error:
            await restarts.bring_back(1)
        message = str(error.value)
        assert "died after 1 restart(s)" in message
        assert "its refit after restart 1 failed: pause: ConnectError" in message

    asyncio.run(main())


def test_a_restart_that_fails_to_start_stops_the_run_with_its_error(ray_local):
    async def main():
        restarts = restarts_of(ray_local, fail="ValueError: no such model")
        restarts.router.engines[0].alive = False
        await restarted(restarts)
        with pytest.raises(RuntimeError, match="could not be restarted(.|\n)*ValueError: no such model"):
            restarts.check()

    asyncio.run(main())


def test_a_restart_short_of_gpu_memory_says_which_flags_share_it(ray_local):
    """vLLM refuses to start where its share of the GPU is not free (on a shared GPU, the actor holds the
    rest): the error says which flags split the memory."""
    full = (
        "ValueError: Free memory on device cuda:0 (27.53/79.18 GiB) on startup is less than desired GPU "
        "memory utilization (0.4, 31.67 GiB)."
    )

    async def main():
        restarts = restarts_of(ray_local, fail=full)
        restarts.router.engines[0].alive = False
        await restarted(restarts)
        with pytest.raises(RuntimeError) as error:
            restarts.check()
        message = str(error.value)
        assert "27.53/79.18 GiB" in message
        assert "--actor.micro_batch_tokens" in message and "--vllm.gpu_memory_utilization" in message

    asyncio.run(main())


def test_attached_engines_are_never_restarted(ray_local):
    """--vllm.urls: no actors; a dead engine stays dead and the loop stops as before when none is left."""

    async def main():
        router = Router(["http://attached"], transport=httpx.MockTransport(None))
        restarts = EngineRestarts(router, [], Policy(), max_restarts=3)
        restarts.policy.dead.add("http://attached")
        tito = type("Tito", (), {"router": router})
        with pytest.raises(RuntimeError, match="no vLLM engine took the weights of step 2"):
            await refit_engines(restarts.policy, tito, 2, restarts)
        assert not router.engines[0].alive and not restarts.coming_back and restarts.num_restarts == 0

    asyncio.run(main())
