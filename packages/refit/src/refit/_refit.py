"""One refit: new full weights from the trainer into every engine, through vLLM's weight-transfer API.

Lifecycle, each phase run on all engines in parallel (paper §3.1 "partial rollout"):
check names/shapes → connect (first time) → pause(mode=keep) → start_weight_update → transfer buckets
(engine verifies and loads layer by layer) → [a verification failed: start + full transfer again, those
engines only] → finish_weight_update(version) → reset_prefix_cache → resume.

Every refit on refit_gloo is verified: each bucket carries the CRC-32 of the bytes the trainer packed,
and the engine checks it before it loads the bucket. A mismatch makes the engine roll back (as for an
abort) and the trainer retry that engine once with a full refit; `RefitStats.verify_failed` names it.
`delta=True` (refit_gloo only) sends per bucket only what changed since the engine's bytes
(`refit._delta`).

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
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from refit._buckets import ParamSpec, bucket_nbytes, packed_buckets, plan_buckets
from refit._delta import ABORTED, FULL, SPARSE, Shadow, bucket_unit, diff_into
from refit._engine import GLOO_BACKEND, IPC_BACKEND, NCCL_BACKEND, Engine
from refit._gather import FullParams
from refit._transport import checksum

__all__ = ["update_weights", "RefitError", "RefitStats", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 256 << 20
PAST_START = ("start", "transfer", "retry_start", "verify", "finish", "reset_prefix_cache", "resume")


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
    """What one refit moved and how long each phase took (seconds, wall clock on rank 0).

    `num_bytes`: the weights' size; `bytes_sent`: payload bytes put on the wire, summed over engines
    (a delta refit sends fewer; a retry adds its own); `verify_failed`: the engines whose first transfer
    failed verification and were retried with a full refit (phases `retry_start`, `retry_transfer`)."""

    version: str
    num_bytes: int
    num_buckets: int
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    verify_failed: tuple[str, ...] = ()


def update_weights(
    engines: Sequence[Engine],
    params: FullParams,
    *,
    version: int | str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    delta: bool = False,
) -> RefitStats | None:
    """Refit `engines` with `params` (from `full_params(model)`) and label the weights `version`.

    Call on every trainer rank. Returns the stats on rank 0 (None elsewhere); raises `ValueError` for a
    name/shape mismatch (no engine touched) and `RefitError` if any engine failed. `delta`: send each
    engine that holds the previous delta refit's bytes only what changed (rank 0 keeps a copy of the
    weights in the wire dtype for it); refit_gloo engines only.
    """
    if delta and (others := [e.url for e in engines if e.backend != GLOO_BACKEND]):
        raise ValueError(f"delta refit runs on {GLOO_BACKEND!r} engines only; {others} use another backend")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    specs = list(params.specs)
    plan = plan_buckets(specs, bucket_bytes)
    run = _Run(list(engines)) if rank == 0 else None
    _agree_or_raise(run.check(specs) if run else None)
    if run is None:
        for _ in params:  # join every gather; rank 0 sends
            pass
        if _share(None):  # rank 0 retries a transfer that failed verification: gather again
            for _ in params:
                pass
        return None
    run.phase("connect", lambda engine: _connect_once(engine, bucket_bytes))
    run.phase("pause", Engine.pause)
    run.phase("start", Engine.start_weight_update)
    token = uuid.uuid4().hex if delta else None  # names the bytes the engines hold after this refit
    if delta:
        run.transfer_delta(params, specs, plan, bucket_bytes, token)
    else:
        run.transfer(params, specs, plan, bucket_bytes)
    retry = run.verify_failures()
    if _share(bool(retry)):
        run.phase("retry_start", Engine.start_weight_update, retry)
        run.transfer(params, specs, plan, bucket_bytes, token, engines=retry, prefix="retry_")
        run.verify_failures(retry=False)
    run.phase("finish", lambda e: e.finish_weight_update(str(version)))
    run.phase("reset_prefix_cache", Engine.reset_prefix_cache)
    run.phase("resume", Engine.resume)
    for engine in engines:
        engine.delta_base = token if engine in run.live else None
    if run.failures:
        raise RefitError(run.failures, [e.url for e in run.live])
    verify_failed = tuple(e.url for e in retry)
    return RefitStats(
        str(version), sum(s.nbytes for s in specs), len(plan), run.seconds, run.bytes_sent, verify_failed
    )


def _share(value):
    """Rank 0's `value`, on every rank of the trainer's process group (a collective where it has >1)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def _connect_once(engine: Engine, bucket_bytes: int) -> None:
    if engine.channel is None:
        engine.connect(bucket_bytes)


def _agree_or_raise(error: str | None) -> None:
    """Rank 0's verdict on the check, shared so all ranks refuse together (none hangs in a gather)."""
    if error := _share(error):
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
        self.bytes_sent = 0
        self._by_url = {engine.url: engine for engine in engines}
        self.buckets_sent = 0  # by `_send`: where a failed transfer's aborted rest begins
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="refit")

    def fail(self, engine: Engine, phase: str, error: BaseException) -> None:
        self.failures.setdefault(engine.url, (phase, error))
        self.live = [e for e in self.live if e is not engine]

    def phase(self, name: str, fn: Callable[[Engine], object], engines: list[Engine] | None = None) -> list:
        began = time.perf_counter()
        futures = [(e, self.pool.submit(fn, e)) for e in (self.live if engines is None else engines)]
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

    def verify_failures(self, *, retry: bool = True) -> list[Engine]:
        """The engines whose transfer failed because a bucket failed the engine's check (asked only of
        engines that failed it). `retry`: they are live again, for a retry; else they fail in `verify`."""
        failed = [
            engine
            for url, (phase, _) in self.failures.items()
            if phase == "transfer" and (engine := self._by_url.get(url)) is not None
            and engine.backend == GLOO_BACKEND and _verify_failed(engine)
        ]  # fmt: skip
        for engine in failed:
            _, error = self.failures.pop(engine.url)
            if retry:
                self.live.append(engine)
            else:
                self.fail(engine, "verify", error)
        return failed

    def transfer(
        self,
        params: FullParams,
        specs: list[ParamSpec],
        plan: list[range],
        bucket_bytes: int,
        token: str | None = None,
        *,
        engines: list[Engine] | None = None,
        prefix: str = "",
    ) -> None:
        """A full transfer, streamed: gathering, packing and the wire overlap (see `_send`)."""
        began = time.perf_counter()
        engines = list(self.live if engines is None else engines)
        infos = {e: e.update_info(specs, bucket_bytes, token=token) for e in engines}
        receivers = {  # an IPC engine takes each bucket in a call of its own, made by its channel
            e: self.pool.submit(e.update_weights, infos[e]) for e in engines if e.backend != IPC_BACKEND
        }
        for engine in engines:
            if engine.backend == IPC_BACKEND:
                engine.channel.begin(specs, plan)
        self.buckets_sent = 0
        try:
            self._send(params, specs, plan, engines, prefix)
        except BaseException as exc:  # the trainer itself failed: tell every engine to roll back
            unsent = [bucket_nbytes(specs, b) for b in plan[self.buckets_sent :]]
            for engine in [e for e in engines if e in self.live]:
                self._abort(engine, "abort", unsent)
                self.fail(engine, "transfer", RuntimeError(f"trainer aborted the transfer: {exc!r}"))
        self._receipts(receivers)
        self.seconds[f"{prefix}transfer"] = time.perf_counter() - began

    def transfer_delta(
        self, params: FullParams, specs: list[ParamSpec], plan: list[range], bucket_bytes: int, token: str
    ) -> None:
        """A delta transfer: diff every bucket against the shadow first, then send each engine holding
        the shadow's bytes the patches, the others every bucket whole (`refit._delta`)."""
        began = time.perf_counter()
        sizes = [bucket_nbytes(specs, b) for b in plan]
        base_N = _SHADOW.carve((tuple(specs), bucket_bytes), sizes)
        old_token, _SHADOW.token = _SHADOW.token, None  # rewritten from here on: valid again once whole
        engines = list(self.live)
        patched = {e for e in engines if old_token is not None and e.delta_base == old_token}
        infos = {
            e: e.update_info(specs, bucket_bytes, token=token, delta_base=old_token if e in patched else None)
            for e in engines
        }
        receivers = {e: self.pool.submit(e.update_weights, infos[e]) for e in engines}
        try:
            rows, payloads = self._diff(params, specs, plan, base_N)
        except BaseException as exc:  # nothing was sent yet: every bucket goes out aborted
            table_N3 = torch.tensor([[ABORTED, 0, 0]] * len(plan), dtype=torch.int64)
            for engine in engines:  # a delta engine waits for its table, a full one for every bucket
                self._abort(engine, *(("send_all", [table_N3]) if engine in patched else ("abort", sizes)))
                self.fail(engine, "transfer", RuntimeError(f"trainer aborted the transfer: {exc!r}"))
        else:
            _SHADOW.token = token
            self._send_delta(engines, patched, rows, payloads, base_N)
        self._receipts(receivers)
        self.seconds["transfer"] = time.perf_counter() - began

    def _diff(self, params, specs, plan, base_N) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Gather and pack each bucket, take its CRC, and diff it into the shadow: the delta table's rows
        and each bucket's patch (None: whole)."""
        rows, payloads = [], []
        self.seconds.update(gather_pack=0.0, checksum=0.0, diff=0.0)
        began = time.perf_counter()
        buffers_N = _send_buffers("cpu", max(b.numel() for b in base_N) if base_N else 0)
        for index, new_N in packed_buckets(iter(params), specs, plan, buffers_N):
            self.seconds["gather_pack"] += time.perf_counter() - began
            began = time.perf_counter()
            crc = checksum(new_N)
            self.seconds["checksum"] += time.perf_counter() - began
            began = time.perf_counter()
            patch = diff_into(base_N[index], new_N, bucket_unit([specs[i] for i in plan[index]]))
            self.seconds["diff"] += time.perf_counter() - began
            rows.append([FULL, new_N.numel(), crc] if patch is None else [SPARSE, patch.numel(), crc])
            payloads.append(patch)
            began = time.perf_counter()
        return rows, payloads

    def _send_delta(self, engines, patched, rows, payloads, base_N) -> None:
        began = time.perf_counter()
        table_N3 = torch.tensor(rows, dtype=torch.int64)
        pending = {}
        for engine in engines:
            if engine in patched:
                stream = [base if p is None else p for p, base in zip(payloads, base_N, strict=True)]
                stream = [payload for payload in stream if payload.numel()]  # an empty patch stays home
                pending[engine] = self._try(engine, "send_all", [table_N3, *stream])
                self.bytes_sent += sum(t.numel() for t in stream)
            else:
                pending[engine] = [
                    work
                    for index, (base, row) in enumerate(zip(base_N, rows, strict=True))
                    for work in self._try(engine, "send", index, base, row[2])
                ]
                self.bytes_sent += sum(base.numel() for base in base_N)
        self._wait(pending)
        self.seconds["send"] = time.perf_counter() - began  # the wire alone: everything was packed first

    def _receipts(self, receivers: dict[Engine, Future]) -> None:
        for engine, future in receivers.items():
            if engine in self.live:
                self._result(engine, "transfer", future)

    def _abort(self, engine: Engine, method: str, *args) -> None:
        with contextlib.suppress(Exception):  # it is reported as failed already; its pipe may be gone too
            getattr(engine.channel, method)(*args)

    def _send(self, params: FullParams, specs: list[ParamSpec], plan: list[range], engines, prefix) -> None:
        """Gather, pack and send bucket by bucket, into two buffers: each bucket is queued for sending as
        soon as it is packed (behind the one on the wire), and packing the next waits only for the
        send of the bucket whose buffer it reuses, so the wire never waits for the packing."""
        device = "cuda" if any(e.backend in (NCCL_BACKEND, IPC_BACKEND) for e in engines) else "cpu"
        verified = device == "cpu"  # refit_gloo engines check each bucket's CRC; vLLM's own ones cannot
        buffers_2N = _send_buffers(device, max((bucket_nbytes(specs, b) for b in plan), default=0))
        in_flight: deque[dict[Engine, list]] = deque()
        gather_pack = crc_s = 0.0
        began = started = time.perf_counter()
        for index, payload_N in packed_buckets(iter(params), specs, plan, buffers_2N):
            gather_pack += time.perf_counter() - began
            began = time.perf_counter()
            crc = checksum(payload_N) if verified else 0
            crc_s += time.perf_counter() - began
            live = [e for e in engines if e in self.live]
            in_flight.append({e: self._try(e, "send", index, payload_N, crc) for e in live})
            self.bytes_sent += payload_N.numel() * len(live)
            self.buckets_sent = index + 1
            if len(in_flight) == len(buffers_2N):  # the next bucket reuses the oldest one's buffer
                self._wait(in_flight.popleft())
            began = time.perf_counter()
        while in_flight:
            self._wait(in_flight.popleft())
        self.seconds[f"{prefix}gather_pack"], self.seconds[f"{prefix}checksum"] = gather_pack, crc_s
        self.seconds[f"{prefix}send"] = time.perf_counter() - started  # gather + pack + CRC + broadcast

    def _try(self, engine: Engine, method: str, *args) -> list:
        """`engine.channel.method(*args)`, its works; a failure drops the engine (its pipe broke)."""
        if engine not in self.live:
            return []
        try:
            return getattr(engine.channel, method)(*args)
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


def _verify_failed(engine: Engine) -> bool:
    """Whether the engine's last transfer stopped at a bucket that failed its check (False if it cannot
    say: it died, or it is not one of ours)."""
    try:
        return any(report.get("failed") is not None for report in engine.verify_report())
    except Exception:
        return False


_SHADOW = Shadow()  # rank 0's copy of the bytes its delta engines hold (kept between refits)

_HOST_BUFFERS: list[torch.Tensor] = []


def _send_buffers(device: str, num_bytes: int) -> list[torch.Tensor]:
    """Two bucket buffers. Host ones are kept between refits: fresh host memory is paid for again in
    page faults on every first write (~25K faults for two 50 MiB buffers), GPU memory is not kept."""
    if device != "cpu":
        return [torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    if not _HOST_BUFFERS or _HOST_BUFFERS[0].numel() < num_bytes:
        _HOST_BUFFERS[:] = [torch.empty(num_bytes, dtype=torch.uint8) for _ in range(2)]
    return _HOST_BUFFERS
