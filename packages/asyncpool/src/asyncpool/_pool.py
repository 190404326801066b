"""GroupPool: keeps prompt groups in flight and hands a trainer whole groups in the order they complete.

What it is for: an asynchronous RL trainer asks for `n` groups (a group is every sample of one prompt, the
unit that group-baseline estimators need); the pool keeps up to `depth` groups running or waiting so the
engines never drain while the trainer trains, backfills groups the trainer's filter rejects, and retries
rollouts that raise. It admits a group only when that group can still be taken within `max_lag` versions
(AReaL's staleness control: a rollout is started only if it can be consumed in time), so what it generates
is trained rather than thrown away. A group that goes stale anyway (overtaken by faster ones) is returned
for the trainer's importance correction to weigh (`stale="keep"`, the default), or with `stale="drop"`
dropped and its prompt rerun, at most `max_requeues` times; then `take` raises `PromptStarved` naming it, so
a long-episode prompt can neither be dropped forever in silence nor hold a slot forever.

What it refuses to do: it knows nothing of engines, tokens or rewards (a sample is opaque apart from its
`min_version`/`max_version`, and what the caller's `cost` makes of it); it never cancels in-flight work on a
version bump (partial rollout, paper sec. 3.1: the loss corrects mixed-version tokens); it never returns part
of a group; it never lets a user error (a rollout or `keep` that raises) escape into the trainer. It is built
for one trainer calling `take`.
"""

import asyncio
import contextlib
import logging
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Protocol, Self

logger = logging.getLogger("asyncpool")


class PoolExhausted(Exception):
    """Raised by `take` when the prompt source is used up and every whole group has been returned.

    The `take` before it may return fewer than `n` groups (the last ones). If the prompt iterator itself
    raised, that error is the `__cause__`.
    """


class PromptStarved(Exception):
    """Raised by `take` when a prompt's group was dropped as stale (stale="drop") over `max_requeues` times.

    The prompt is not run again (its last drop is counted in `dropped_stale`); `.prompt`, `.prompt_index`
    and `.drops` name it. The pool stays open: a caller that catches this may go on taking.
    """

    def __init__(self, prompt: Any, prompt_index: int, drops: int, max_lag: int) -> None:
        shown = repr(prompt) if len(repr(prompt)) <= 200 else repr(prompt)[:197] + "..."
        super().__init__(
            f"prompt {prompt_index} ({shown}) was dropped as stale {drops} times: each of its groups "
            f"finished more than max_lag={max_lag} versions behind the trainer; raise max_lag or "
            "max_requeues, or pass stale='keep' to train stale groups with their importance correction"
        )
        self.prompt, self.prompt_index, self.drops, self.max_lag = prompt, prompt_index, drops, max_lag

    def __reduce__(self):  # picklable (e.g. across processes) although __init__ takes its parts
        return type(self), (self.prompt, self.prompt_index, self.drops, self.max_lag)


class _Versioned(Protocol):
    """What the pool reads from a sample: the oldest and newest policy version among its tokens."""

    @property
    def min_version(self) -> int: ...

    @property
    def max_version(self) -> int: ...


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: samples may hold arrays that refuse ==
class Group[P, S: _Versioned]:
    """All `group_size` samples of one prompt, in index order.

    `prompt_index` is the prompt's 0-based position in the `prompts` iterable; it survives requeueing, so a
    trainer that records the indices it trained on, and the pool's `discarded`, can resume by skipping them.
    """

    prompt: P
    prompt_index: int
    samples: list[S]

    @property
    def min_version(self) -> int:
        """The oldest policy version among the group's tokens (what staleness is measured on)."""
        return min(sample.min_version for sample in self.samples)

    @property
    def max_version(self) -> int:
        """The newest policy version among the group's tokens."""
        return max(sample.max_version for sample in self.samples)


@dataclass(slots=True)
class PoolStats:
    """Counts of groups (and rollouts for `retried`) since the pool was entered.

    While the pool is open every started group is in exactly one place:
    `started == in_flight + ready + returned + dropped_stale + filtered + failed`.
    `spent` and `wasted` are in the units of the pool's `cost` (samples, unless the caller says otherwise,
    e.g. sampled tokens): `wasted / spent` is the share of generation that never reached the trainer.
    """

    in_flight: int = 0  # groups with rollouts still running
    ready: int = 0  # groups complete and accepted, waiting for `take`
    started: int = 0
    returned: int = 0  # groups handed to the trainer by `take`
    dropped_stale: int = 0  # more than `max_lag` versions old; their prompts were requeued (up to the cap)
    kept_stale: int = 0  # with stale="keep": returned groups more than `max_lag` versions old (in `returned`)
    filtered: int = 0  # rejected by `keep`
    failed: int = 0  # a rollout raised `retries + 1` times, or `keep` raised
    retried: int = 0  # single rollouts run again after raising
    take_wait_s: float = 0.0  # event-loop time the trainer spent inside `take`
    spent: float = 0.0  # cost of the samples of groups returned, dropped as stale or filtered
    wasted: float = 0.0  # the part of `spent` in groups dropped as stale or filtered (never returned)

    def metrics(self, prefix: str = "pool/") -> dict[str, float]:
        """The counters as flat metrics, e.g. `{"pool/dropped_stale": 3, ...}`."""
        return {prefix + field.name: getattr(self, field.name) for field in fields(self)}


class GroupPool[P, S: _Versioned]:
    """A pool of prompt groups in flight; see the package README for the full semantics.

    `depth` bounds the groups the pool holds at once, running or complete-and-waiting for `take`.
    Admission bounds them too, by the `n` of the latest `take(n)`: the trainer takes `n` groups per
    version, so a group started now, behind `held` others, is taken `ceil((held + 1) / n)` takes from now;
    those takes happen at the current version and the next ones, or from the next version on if the trainer
    has taken its batch at this one and not yet moved the version (it is training). The group is started
    only if that last take is within `max_lag` versions: `held < (max_lag + 1) * n`, or `max_lag * n`
    between a take and the next version. Before the first take the pool takes `n` from `batch` where
    given, else (`n` unknown) it fills to `depth`.
    With `max_lag=0` nothing starts between a take and the next version (or the next take, so taking twice
    without a refit cannot deadlock); with `depth == n` that is strict on-policy training.
    """

    def __init__(
        self,
        rollout: Callable[[P, int], Awaitable[S]],
        prompts: Iterable[P],
        *,
        group_size: int,
        depth: int,
        max_lag: int = 1,
        keep: Callable[[Group[P, S]], bool] | None = None,
        retries: int = 2,
        retry_delay: float = 0.1,
        stale: Literal["drop", "keep"] = "keep",
        max_requeues: int = 16,
        cost: Callable[[S], float] | None = None,
        batch: int | None = None,
    ) -> None:
        at_least: dict[str, tuple[float, int]]  # each number: its value, and the least it may be
        at_least = {"group_size": (group_size, 1), "depth": (depth, 1), "max_requeues": (max_requeues, 1)}
        at_least |= {"max_lag": (max_lag, 0), "retries": (retries, 0), "retry_delay": (retry_delay, 0)}
        if batch is not None:
            at_least["batch"] = (batch, 1)
        for name, (value, low) in at_least.items():
            if value < low:
                raise ValueError(f"GroupPool needs {name} >= {low}, got {value}")
        self.group_size, self.depth, self.max_lag, self.retries = group_size, depth, max_lag, retries
        if stale not in ("drop", "keep"):
            raise ValueError(f"GroupPool needs stale='drop' or stale='keep', got {stale!r}")
        self.retry_delay, self.stale, self.max_requeues = retry_delay, stale, max_requeues
        self._stale_drops: dict[int, int] = {}  # prompt index -> stale drops so far, while it is in play
        self._starved: deque[PromptStarved] = deque()  # raised by the next takes, one each
        self._logged_errors: set[tuple] = set()  # kinds of error whose traceback was logged already
        self._rollout, self._keep = rollout, keep
        self._cost = cost or (lambda sample: 1)  # what a sample cost to generate, for `spent`/`wasted`
        self._source: Iterator[tuple[int, P]] | None = enumerate(prompts)  # None once used up
        self._source_error: Exception | None = None
        self._requeued: deque[tuple[int, P]] = deque()  # stale groups' prompts, run before fresh ones
        self._running: dict[asyncio.Task[Group[P, S]], int] = {}  # task -> prompt index
        self._ready: list[Group[P, S]] = []  # completion order
        self._version = 0
        self._pauses = 0
        # the n of the latest take(n), the groups consumed per version; `batch` gives it before the first
        self._batch = batch
        self._took_at_version = False  # a take returned at this version and none has begun since
        self._state = "new"  # -> "open" -> "closed"
        self._changed = asyncio.Event()
        self._stats = PoolStats()
        # the prompt indices of groups dropped for good (filtered, failed, starved), in the order dropped:
        # with those `take` returned, the prompts a resumed run skips (README, Groups)
        self.discarded: list[int] = []

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise RuntimeError("a GroupPool can be entered only once; make a new one")
        self._state = "open"
        self._fill()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._state = "closed"
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._changed.set()

    @property
    def version(self) -> int:
        """The trainer's current policy version; set it after each refit (it may only grow)."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        if value < self._version:
            raise ValueError(f"pool.version only grows: it is {self._version}, got {value}")
        if value > self._version:
            self._took_at_version = False
        self._version = value
        for group in [group for group in self._ready if self._is_stale(group)]:
            self._ready.remove(group)  # by identity (eq=False)
            self._drop_stale(group)
        self._fill()

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the counters (a copy: safe to keep and log)."""
        return replace(self._stats, in_flight=len(self._running), ready=len(self._ready))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Start no new group inside this block (e.g. around a refit); running rollouts carry on.

        Blocks nest. A `take` that needs a new group to start waits for the block to end.
        """
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            self._fill()

    async def take(self, n: int) -> list[Group[P, S]]:
        """The first `n` groups to complete, in completion order, leaving out rejected ones (and stale ones,
        with stale="drop"; with the default stale="keep" they are returned and counted in `kept_stale`).

        Returns fewer than `n` only when the prompt source is used up; after the last group, raises
        `PoolExhausted`. With stale="drop", raises `PromptStarved` (one per call) once a prompt has been
        dropped as stale more than `max_requeues` times. `n` also sizes admission (class docstring).
        """
        if not 1 <= n <= self.depth:
            raise ValueError(f"take(n) needs 1 <= n <= depth ({self.depth}), got {n}")
        if self._state != "open":
            raise RuntimeError("take() needs an open pool: use it inside `async with pool:`")
        loop = asyncio.get_running_loop()
        began = loop.time()
        self._batch = n
        self._took_at_version = False  # a caller asking again wants data at the current version
        self._fill()
        try:  # until n groups are ready, the source is drained, or a starved prompt is to be named
            while not self._starved and len(self._ready) < n and not self._drained():
                self._changed.clear()
                await self._changed.wait()
                if self._state != "open":
                    raise RuntimeError("the pool was closed while take() waited")
            if self._starved:
                raise self._starved.popleft()
        finally:
            self._stats.take_wait_s += loop.time() - began
        groups, self._ready = self._ready[:n], self._ready[n:]
        if not groups:
            message = "the prompt source is used up and every group was returned"
            raise PoolExhausted(message) from self._source_error
        self._stats.returned += len(groups)
        self._stats.kept_stale += sum(self._version - group.min_version > self.max_lag for group in groups)
        for group in groups:
            self._stale_drops.pop(group.prompt_index, None)
            self._spend(group, wasted=False)
        self._took_at_version = True
        self._fill()
        return groups

    def _drained(self) -> bool:
        return self._source is None and not self._requeued and not self._running

    def _is_stale(self, group: Group[P, S]) -> bool:
        """Too old to return: more than `max_lag` versions behind (never, with stale="keep")."""
        return self.stale == "drop" and self._version - group.min_version > self.max_lag

    def _spend(self, group: Group[P, S], *, wasted: bool) -> None:
        """Count what the group's samples cost in `spent`, and in `wasted` if it never reaches the trainer."""
        cost = sum(self._cost(sample) for sample in group.samples)
        self._stats.spent += cost
        self._stats.wasted += cost if wasted else 0

    def _drop_stale(self, group: Group[P, S]) -> None:
        self._stats.dropped_stale += 1
        self._spend(group, wasted=True)
        index = group.prompt_index
        drops = self._stale_drops[index] = self._stale_drops.get(index, 0) + 1
        if drops <= self.max_requeues:
            self._requeued.append((index, group.prompt))
            return
        self._discard(index)
        self._starved.append(PromptStarved(group.prompt, index, drops, self.max_lag))
        logger.error("%s", self._starved[-1])

    def _discard(self, index: int) -> None:
        """Drop the prompt for good: its stale drops are forgotten, and it is listed in `discarded`."""
        self._stale_drops.pop(index, None)
        self.discarded.append(index)

    def _admits(self) -> bool:
        """Whether a group started now can still be taken within `max_lag` versions (class docstring)."""
        held = len(self._running) + len(self._ready)
        if held >= self.depth:
            return False
        if self._batch is None:  # no take nor `batch` yet: how many groups a version consumes is unknown
            return True
        takes_within_lag = self.max_lag + (0 if self._took_at_version else 1)
        return held < takes_within_lag * self._batch

    def _fill(self) -> None:
        """Start the groups admission allows, then wake a waiting `take` to look again: what it waits
        for may have changed (ready, dropped or starved groups, a source that ran out)."""
        while self._state == "open" and not self._pauses and self._admits():
            if (item := self._next_prompt()) is None:
                break
            index, prompt = item
            task = asyncio.create_task(self._run_group(index, prompt), name=f"asyncpool-group-{index}")
            self._running[task] = index
            task.add_done_callback(self._on_done)
            self._stats.started += 1
        self._changed.set()

    def _next_prompt(self) -> tuple[int, P] | None:
        if self._requeued:
            return self._requeued.popleft()
        if self._source is None:
            return None
        try:
            return next(self._source)
        except StopIteration:
            self._source = None
        except Exception as err:  # a broken source ends the pool; take() names it as PoolExhausted's cause
            logger.exception("the prompt source raised; no new prompts will be started")
            self._source, self._source_error = None, err
        return None

    async def _run_group(self, index: int, prompt: P) -> Group[P, S]:
        # A TaskGroup cancels (and awaits) the siblings of a sample that finally fails, and every
        # sample when the pool closes, so nothing outlives the group.
        async with asyncio.TaskGroup() as samples:
            tasks = [samples.create_task(self._sample(index, prompt, i)) for i in range(self.group_size)]
        return Group(prompt, index, [task.result() for task in tasks])

    async def _sample(self, prompt_index: int, prompt: P, index: int) -> S:
        for attempt in range(1, self.retries + 1):
            try:
                return _checked(await self._rollout(prompt, index))
            except Exception as err:
                self._stats.retried += 1
                what = f"rollout {index} of prompt {prompt_index} raised on attempt {attempt}"
                self._log_failure(what, err, logging.WARNING, repeat_level=logging.DEBUG)
                # Back off (doubling) so an agent that fails at once does not spin the loop and the log.
                await asyncio.sleep(self.retry_delay * 2 ** (attempt - 1))
        return _checked(await self._rollout(prompt, index))  # the last attempt: its error fails the group

    def _log_failure(self, what: str, err: BaseException, level: int, repeat_level: int) -> None:
        """The first error of each kind (type and raising line) is logged with its traceback at `level`;
        later ones of that kind in one line at `repeat_level`: `stats` counts them all."""
        raised_at = traceback.extract_tb(err.__traceback__, limit=-1)  # the innermost frame
        kind = (type(err).__qualname__, *((frame.filename, frame.lineno) for frame in raised_at))
        if kind in self._logged_errors:
            logger.log(repeat_level, "%s: %r", what, err)
            return
        self._logged_errors.add(kind)
        logger.log(level, "%s (errors of this kind are logged once): %r", what, err, exc_info=err)

    def _on_done(self, task: asyncio.Task[Group[P, S]]) -> None:
        index = self._running.pop(task)
        if task.cancelled() or self._state != "open":  # closing: cancelled work is no outcome
            return
        if (err := task.exception()) is not None:
            self._stats.failed += 1
            self._discard(index)
            while isinstance(err, BaseExceptionGroup):  # the group's TaskGroup wraps the sample's error
                err = err.exceptions[0]
            what = f"group of prompt {index} dropped: a rollout failed every attempt"
            self._log_failure(what, err, logging.ERROR, repeat_level=logging.WARNING)
        else:
            self._settle(task.result())
        self._fill()

    def _settle(self, group: Group[P, S]) -> None:
        # Staleness is judged before `keep`: a stale prompt is run again, never filtered away.
        if self._is_stale(group):
            self._drop_stale(group)
            return
        try:
            kept = self._keep is None or self._keep(group)
        except Exception:  # a filter that raises drops its group, like a failed rollout
            self._stats.failed += 1
            self._discard(group.prompt_index)
            logger.exception("keep() raised for the group of prompt %d; group dropped", group.prompt_index)
            return
        if kept:
            self._ready.append(group)  # its stale drops are forgotten when `take` returns it
        else:
            self._stats.filtered += 1
            self._spend(group, wasted=True)
            self._discard(group.prompt_index)


def _checked(sample: Any) -> Any:
    versions = (getattr(sample, "min_version", None), getattr(sample, "max_version", None))
    if not all(isinstance(version, int) for version in versions):
        raise TypeError(f"rollout must return a sample with int min_version and max_version, got {sample!r}")
    return sample
