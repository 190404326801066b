"""Engines that come back: an engine molt started that dies is restarted, given the current weights, and
serves again.

An engine is dead when tito finds it so (a request broke off and `/health` does not answer) or a refit
fails on it. Its Ray actor (`molt._engines.EngineActor`) starts the server again with the same flags on a
new port, in the background while the run goes on; tito's router puts it in the dead one's place, taking
no session yet. The loop refits it when its actor is idle (`molt.loop.take`, which waits while the
engines generate), as the version the other engines serve, and only then marks it alive: it never samples
with other weights. Rollouts that failed because their engine died wait here until one serves again and
are then retried by the pool (`molt._rollout`), so a group in flight re-runs rather than being lost. The
NeMo-RL engine lifecycle (dead -> restarting -> stale -> refit -> healthy) is the model.

Engines attached with --vllm.urls were started by someone else: molt cannot restart them, and one that
dies is dropped for the rest of the run, as before. An engine that dies more than --vllm.max_restarts
times (a crash loop) stops the run with its log's first error, and so does a restart that fails to start
(its error names the new log's first error; a start that failed once is not tried again).
"""

from __future__ import annotations

import asyncio

import ray

from molt._log import progress


class EngineRestarts:
    """The restarts of the engines in `router` (tito's) that molt started: `actors[i]` owns
    `router.engines[i]` (none for attached engines). `policy` refits the ones that come back."""

    def __init__(self, router, actors: list, policy, *, max_restarts: int) -> None:
        self.router, self.actors, self.policy, self.max_restarts = router, actors, policy, max_restarts
        self.restarts = [0] * len(actors)  # per engine; `engines/restarts` is their sum
        self.restarting: dict[int, asyncio.Task] = {}  # engine index -> its restart, until it is up
        self.stale: list[int] = []  # up again, waiting for the current weights
        self.failure: RuntimeError | None = None  # a restart past the bound, or one that failed
        self.refit_failed: dict[int, str] = {}  # engine index -> why the refit after its last restart failed

    @property
    def num_restarts(self) -> int:
        return sum(self.restarts)

    @property
    def coming_back(self) -> bool:
        """Whether an engine is being restarted or waits for its weights."""
        return bool(self.restarting or self.stale)

    def notice(self) -> None:
        """Start restarting every engine molt started that is dead and not coming back yet; past
        --vllm.max_restarts, record the failure that `check` raises."""
        for index, actor in enumerate(self.actors):
            engine = self.router.engines[index]
            if engine.alive or index in self.restarting or index in self.stale or self.failure:
                continue
            if self.restarts[index] >= self.max_restarts:
                refit = self.refit_failed.get(index)
                why = f" (its refit after restart {self.restarts[index]} failed: {refit})" if refit else ""
                self.failure = RuntimeError(
                    f"vLLM engine {index} ({engine.url}) died after {self.restarts[index]} restart(s){why}, "
                    f"the most --vllm.max_restarts allows; stopping. Its log {_log_report(actor)}"
                )
                continue
            self.restarts[index] += 1
            progress(f"vLLM engine {index} ({engine.url}) died; restarting it ({self.restarts[index]} of "
                     f"--vllm.max_restarts {self.max_restarts})")  # fmt: skip
            self.restarting[index] = asyncio.create_task(self._restart(index))

    async def _restart(self, index: int) -> None:
        try:
            url = await self.actors[index].restart.remote()  # awaited on the loop: a cancel does not wait
        except ray.exceptions.RayError as error:  # the start failed: its error holds the log's report
            # vLLM starts only where its share of the GPU is free (on a shared GPU the actor holds the rest)
            short = "is less than desired GPU memory utilization" in str(error)
            self.failure = self.failure or RuntimeError(
                f"vLLM engine {index} could not be restarted ({self.restarts[index]} of --vllm.max_restarts "
                f"{self.max_restarts}); stopping. {error}" + (_SHORT_OF_MEMORY if short else "")
            )
            return
        finally:
            del self.restarting[index]
        self.router.replace(self.router.engines[index], url)
        self.stale.append(index)

    def check(self) -> None:
        """Raise the failure of a restart (the run stops); otherwise start the restarts now due."""
        self.notice()
        if self.failure is not None:
            raise self.failure

    async def bring_back(self, version: int) -> None:
        """Refit the engines that are up again with the current weights, as `version`, and let them serve;
        then `check`: restart what is dead, one that failed its refit too, or raise the failure of a
        restart. Call only while the policy's actor is idle."""
        from molt._group import EnginesLost

        while self.stale:
            index = self.stale.pop(0)
            engine = self.router.engines[index]
            try:
                await asyncio.to_thread(self.policy.refit, [engine.url], version)
            except EnginesLost as lost:  # up, but not serving the current weights: dead again
                self.refit_failed[index] = lost.failed.get(engine.url, str(lost))
                progress(f"vLLM engine {index}'s refit after its restart failed: {self.refit_failed[index]}")
                continue
            engine.alive = True
            self.refit_failed.pop(index, None)
            progress(f"vLLM engine {index} is back at {engine.url}, serving the weights of version {version}")
        self.check()

    async def serving(self) -> None:
        """Return once an engine serves, or when none is coming back (nothing to wait for)."""
        self.notice()
        while not any(engine.alive for engine in self.router.engines) and self.coming_back:
            await asyncio.sleep(0.5)

    def cancel(self) -> None:
        """Stop waiting for the restarts under way (the run is ending)."""
        for task in list(self.restarting.values()):
            task.cancel()


_SHORT_OF_MEMORY = (
    "\nIts GPU's memory was held by other processes when it started again: on a shared GPU the actor takes "
    "what the engine's share (--vllm.gpu_memory_utilization) leaves, its activations bounded by "
    "--actor.micro_batch_tokens; lower one of the two."
)


def _log_report(actor) -> str:
    try:
        return ray.get(actor.log_report.remote(), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as error:
        return f"could not be read ({type(error).__name__})"
