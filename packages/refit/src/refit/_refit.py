"""One refit: new full weights from the trainer into every engine, through vLLM's weight-transfer API.

Lifecycle, each phase run on all engines in parallel (paper §3.1 "partial rollout"):
check names/shapes → connect (first time) → pause(mode=keep) → start_weight_update → transfer buckets
(engine loads layer by layer) → finish_weight_update(version) → reset_prefix_cache → resume.

Refuses, before any engine is touched: a parameter list whose names or full shapes differ from the
checkpoint an engine loaded (a missing parameter would leave its layer half loaded). Failure of one
engine never stops the others: it is dropped from later phases and reported in `RefitError` with the
phase it failed in. An engine that failed after `start_weight_update` is never resumed (its layers may
be on the meta device, or mixed old/new after a gloo rollback); the next successful refit resumes it.
Every trainer rank calls `update_weights` (the gathers are collectives); rank 0 alone talks to engines.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from refit._buckets import ParamSpec, bucket_nbytes, packed_buckets, plan_buckets
from refit._engine import NCCL_BACKEND, Engine
from refit._gather import FullParams

__all__ = ["update_weights", "RefitError", "RefitStats", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 256 << 20
PAST_START = ("start", "transfer", "finish", "reset_prefix_cache", "resume")


class RefitError(RuntimeError):
    """Some engines failed a refit. `failures` maps engine url → (phase, error); `updated` lists the
    engines that got the new weights and were resumed; `paused` those left paused on purpose."""

    def __init__(self, failures: dict[str, tuple[str, BaseException]], updated: list[str]) -> None:
        self.failures = failures
        self.updated = updated
        self.paused = [url for url, (phase, _) in failures.items() if phase in PAST_START]
        lines = [f"refit failed on {len(failures)} engine(s):"]
        lines += [
            f"  {url}: phase {phase!r}: {type(err).__name__}: {err}" for url, (phase, err) in failures.items()
        ]
        lines.append(f"  updated and resumed: {updated or 'none'}")
        if self.paused:
            lines.append(
                f"  left paused (not resumed after a failed update; the next refit resumes): {self.paused}"
            )
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved and how long each phase took (seconds, wall clock on rank 0)."""

    version: str
    num_bytes: int
    num_buckets: int
    seconds: dict[str, float] = field(default_factory=dict)


def update_weights(
    engines: Sequence[Engine],
    params: FullParams,
    *,
    version: int | str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> RefitStats | None:
    """Refit `engines` with `params` (from `full_params(model)`) and label the weights `version`.

    Call on every trainer rank. Returns the stats on rank 0 (None elsewhere); raises `ValueError` for a
    name/shape mismatch (no engine touched) and `RefitError` if any engine failed.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    specs = list(params.specs)
    plan = plan_buckets(specs, bucket_bytes)
    run = _Run(list(engines)) if rank == 0 else None
    _agree_or_raise(run.check(specs) if run else None)
    if run is None:
        for _ in params:  # join every gather; rank 0 sends
            pass
        return None
    run.phase("connect", lambda engine: _connect_once(engine, bucket_bytes))
    run.phase("pause", Engine.pause)
    run.phase("start", Engine.start_weight_update)
    run.transfer(params, specs, plan, bucket_bytes)
    run.phase("finish", lambda e: e.finish_weight_update(str(version)))
    run.phase("reset_prefix_cache", Engine.reset_prefix_cache)
    run.phase("resume", Engine.resume)
    if run.failures:
        raise RefitError(run.failures, [e.url for e in run.live])
    return RefitStats(str(version), sum(s.nbytes for s in specs), len(plan), run.seconds)


def _connect_once(engine: Engine, bucket_bytes: int) -> None:
    if engine.channel is None:
        engine.connect(bucket_bytes)


def _agree_or_raise(error: str | None) -> None:
    """Rank 0's verdict on the check, shared so all ranks refuse together (none hangs in a gather)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ValueError(error)


def _mismatch(expected: list[ParamSpec], specs: list[ParamSpec]) -> str | None:
    want = {s.name: s.shape for s in expected}
    have = {s.name: s.shape for s in specs}
    missing = sorted(want.keys() - have.keys())
    extra = sorted(have.keys() - want.keys())
    shapes = [
        f"{n}: engine {want[n]}, sent {have[n]}"
        for n in sorted(want.keys() & have.keys())
        if want[n] != have[n]
    ]
    if not (missing or extra or shapes):
        return None
    parts = [f"missing {missing[:8]}" * bool(missing), f"unexpected {extra[:8]}" * bool(extra)]
    parts.append(f"shape mismatch {shapes[:8]}" * bool(shapes))
    return "; ".join(p for p in parts if p)


class _Run:
    """The engines of one refit: which are still live, which failed in which phase, phase timings."""

    def __init__(self, engines: list[Engine]) -> None:
        self.live = engines
        self.failures: dict[str, tuple[str, BaseException]] = {}
        self.seconds: dict[str, float] = {}
        self.buckets_sent = 0  # by `_send`: where a failed transfer's aborted rest begins
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="refit")

    def fail(self, engine: Engine, phase: str, error: BaseException) -> None:
        self.failures.setdefault(engine.url, (phase, error))
        self.live = [e for e in self.live if e is not engine]

    def phase(self, name: str, fn: Callable[[Engine], object]) -> list:
        began = time.perf_counter()
        futures = [(e, self.pool.submit(fn, e)) for e in self.live]
        results = [self._result(e, name, f) for e, f in futures]
        self.seconds[name] = time.perf_counter() - began
        return results

    def _result(self, engine: Engine, phase: str, future: Future):
        try:
            return future.result()
        except Exception as exc:
            self.fail(engine, phase, exc)

    def check(self, specs: list[ParamSpec]) -> str | None:
        """Compare `specs` with each engine's checkpoint (read-only); the first mismatch refuses the refit."""
        for engine, expected in zip(
            list(self.live),
            self.phase("check", lambda e: e.checkpoint_specs([s.name for s in specs])),
            strict=True,
        ):
            if expected is not None and (problem := _mismatch(expected, specs)):
                return f"refit refused, the parameters do not match {engine.url}'s checkpoint: {problem}"
        return None

    def transfer(
        self, params: FullParams, specs: list[ParamSpec], plan: list[range], bucket_bytes: int
    ) -> None:
        began = time.perf_counter()
        receivers = {
            e: self.pool.submit(e.update_weights, e.update_info(specs, bucket_bytes)) for e in self.live
        }
        try:
            self._send(params, specs, plan)
        except BaseException as exc:  # the trainer itself failed: tell every engine to roll back
            unsent = [bucket_nbytes(specs, b) for b in plan[self.buckets_sent :]]
            for engine in list(self.live):
                self._abort(engine, unsent)
                self.fail(engine, "transfer", RuntimeError(f"trainer aborted the transfer: {exc!r}"))
        for engine, future in receivers.items():
            if engine in self.live:
                self._result(engine, "transfer", future)
        self.seconds["transfer"] = time.perf_counter() - began

    def _abort(self, engine: Engine, unsent: list[int]) -> None:
        with contextlib.suppress(Exception):  # it is reported as failed already; its pipe may be gone too
            engine.channel.abort(unsent)

    def _send(self, params: FullParams, specs: list[ParamSpec], plan: list[range]) -> None:
        """Gather, pack and send bucket by bucket, into two buffers: each bucket is queued for sending as
        soon as it is packed (behind the one on the wire), and packing the next waits only for the
        send of the bucket whose buffer it reuses, so the wire never waits for the packing."""
        device = "cuda" if any(e.backend == NCCL_BACKEND for e in self.live) else "cpu"
        buffers_2N = _send_buffers(device, max((bucket_nbytes(specs, b) for b in plan), default=0))
        in_flight: deque[dict[Engine, list]] = deque()
        self.seconds["gather_pack"] = 0.0
        began = started = time.perf_counter()
        for index, payload_N in packed_buckets(iter(params), specs, plan, buffers_2N):
            self.seconds["gather_pack"] += time.perf_counter() - began
            in_flight.append({e: self._try_send(e, index, payload_N) for e in self.live})
            self.buckets_sent = index + 1
            if len(in_flight) == len(buffers_2N):  # the next bucket reuses the oldest one's buffer
                self._wait(in_flight.popleft())
            began = time.perf_counter()
        while in_flight:
            self._wait(in_flight.popleft())
        self.seconds["send"] = time.perf_counter() - started  # gather + pack + broadcast, all buckets

    def _try_send(self, engine: Engine, index: int, payload_N: torch.Tensor) -> list:
        try:
            return engine.channel.send(index, payload_N)
        except Exception as exc:
            self.fail(engine, "transfer", exc)
            return []

    def _wait(self, pending: dict[Engine, list]) -> None:
        for engine, works in pending.items():
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # this engine's pipe broke (it died); the others carry on
                self.fail(engine, "transfer", exc)


_HOST_BUFFERS: list[torch.Tensor] = []


def _send_buffers(device: str, num_bytes: int) -> list[torch.Tensor]:
    """Two bucket buffers. Host ones are kept between refits: fresh host memory is paid for again in
    page faults on every first write (~25K faults for two 50 MiB buffers), GPU memory is not kept."""
    if device != "cpu":
        return [torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    if not _HOST_BUFFERS or _HOST_BUFFERS[0].numel() < num_bytes:
        _HOST_BUFFERS[:] = [torch.empty(num_bytes, dtype=torch.uint8) for _ in range(2)]
    return _HOST_BUFFERS
