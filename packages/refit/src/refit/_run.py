"""The engines of one refit (`refit._refit.update_weights`), as `Run`: each phase run on every live
engine in parallel, which engines failed in which phase, the phase timings, and the transfers themselves.

A full transfer streams gather, pack, checksum and the wire bucket by bucket through two buffers
(`Run._send`); a delta transfer diffs every bucket against rank 0's shadow of the engines' bytes first, then
sends each engine holding them only the patches (`refit._delta`). A failure drops that engine from later
phases and is recorded with its phase; the others carry on. Rank 0 alone runs it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from refit._buckets import ParamSpec, bucket_nbytes, packed_buckets
from refit._delta import ABORTED, FULL, SPARSE, bucket_unit, diff_into
from refit._engine import IPC_BACKEND, NCCL_BACKEND, Engine
from refit._gather import FullParams
from refit._transport import IpcChannel, NcclChannel, ReceiveBuffers, checksum, device_checksum


class Run:
    """The engines of one refit: which are still live, which failed in which phase, phase timings."""

    def __init__(self, engines: list[Engine], *, lora: dict | None = None) -> None:
        self.live = engines
        self.lora = lora  # a LoRA adapter's PEFT config: the transfer is that adapter
        self.failures: dict[Engine, tuple[str, BaseException]] = {}
        self.seconds: dict[str, float] = {}
        self.bytes_sent = 0
        self.buckets_sent = 0  # by `_send`: where a failed transfer's aborted rest begins
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="refit")

    def fail(self, engine: Engine, phase: str, error: BaseException) -> None:
        self.failures.setdefault(engine, (phase, error))
        self.live = [e for e in self.live if e is not engine]

    def phase(self, name: str, fn: Callable[[Engine], object], engines: list[Engine] | None = None) -> dict:
        """`fn` on every live engine (or `engines`) in parallel: each engine's result (None: it failed)."""
        began = time.perf_counter()
        futures = [(e, self.pool.submit(fn, e)) for e in (self.live if engines is None else engines)]
        results = {e: self._result(e, name, f) for e, f in futures}
        self.seconds[name] = time.perf_counter() - began
        return results

    def _result(self, engine: Engine, phase: str, future: Future):
        try:
            return future.result()
        except Exception as exc:
            self.fail(engine, phase, exc)

    def check(self, specs: list[ParamSpec]) -> str | None:
        """Compare `specs` with each engine's checkpoint (read-only); the first mismatch refuses the refit."""
        expected = self.phase("check", lambda e: e.checkpoint_specs([s.name for s in specs]))
        for engine, want in expected.items():
            if want is not None and (problem := _mismatch(want, specs)):
                return f"refit refused, the parameters do not match {engine.url}'s checkpoint: {problem}"
        return None

    def verify_failures(self, *, retry: bool = True) -> list[Engine]:
        """The engines whose transfer failed because a bucket failed the engine's check, on any backend
        (asked only of engines that failed it). `retry`: they are live again, for a retry; else they fail
        in `verify`."""
        failed = [e for e, (phase, _) in self.failures.items() if phase == "transfer" and _verify_failed(e)]
        for engine in failed:
            _, error = self.failures.pop(engine)
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
        infos = {e: e.update_info(specs, bucket_bytes, token=token, lora=self.lora) for e in engines}
        receivers = {  # an IPC engine takes each bucket in a call of its own, made by its channel
            e: self.pool.submit(e.update_weights, infos[e]) for e in engines if e.backend != IPC_BACKEND
        }
        for engine in engines:  # the GPU channels need the plan (IPC's calls, NCCL's end)
            if isinstance(engine.channel, IpcChannel | NcclChannel):
                engine.channel.begin(specs, plan)
        self.buckets_sent = 0
        try:
            self._send(params, specs, plan, engines, prefix)
        except BaseException as exc:  # the trainer itself failed: tell every engine to roll back
            unsent = [bucket_nbytes(specs, b) for b in plan[self.buckets_sent :]]
            for engine in [e for e in engines if e in self.live]:
                self._abort(engine, exc, "abort", unsent)
        self._receipts(receivers)
        self.seconds[f"{prefix}transfer"] = time.perf_counter() - began

    def transfer_delta(
        self, params: FullParams, specs: list[ParamSpec], plan: list[range], bucket_bytes: int, token: str
    ) -> None:
        """A delta transfer: diff every bucket against the shadow first, then send each engine holding
        the shadow's bytes the patches, the others every bucket whole (`refit._delta`)."""
        began = time.perf_counter()
        sizes = [bucket_nbytes(specs, b) for b in plan]
        base_N = _SHADOW.carve(sizes, key=(tuple(specs), bucket_bytes))
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
                signal = ("send_all", [table_N3]) if engine in patched else ("abort", sizes)
                self._abort(engine, exc, *signal)
        else:
            _SHADOW.token = token
            self._send_delta(engines, patched, rows, payloads, base_N)
        self._receipts(receivers)
        self.seconds["transfer"] = time.perf_counter() - began

    def _diff(self, params, specs, plan, base_N) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Gather and pack each bucket, take its CRC, and diff it into the shadow: the delta table's rows
        and each bucket's payload (its patch, or the whole bucket as the shadow now holds it)."""
        rows, payloads = [], []
        self.seconds["diff"] = 0.0
        buffers_N = _send_buffers("cpu", max((b.numel() for b in base_N), default=0))
        for index, new_N, crc in self._packed(params, specs, plan, buffers_N):
            began = time.perf_counter()
            patch = diff_into(base_N[index], new_N, bucket_unit([specs[i] for i in plan[index]]))
            self.seconds["diff"] += time.perf_counter() - began
            rows.append([FULL, new_N.numel(), crc] if patch is None else [SPARSE, patch.numel(), crc])
            payloads.append(base_N[index] if patch is None else patch)
        return rows, payloads

    def _send_delta(self, engines, patched, rows, payloads, base_N) -> None:
        began = time.perf_counter()
        table_N3 = torch.tensor(rows, dtype=torch.int64)
        stream = [payload for payload in payloads if payload.numel()]  # an empty patch or bucket stays home
        pending = {}
        for engine in engines:
            if engine in patched:
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

    def _abort(self, engine: Engine, exc: BaseException, method: str, *args) -> None:
        """The trainer failed (`exc`): tell the engine so (`method`; its pipe may be gone too), fail it."""
        with contextlib.suppress(Exception):
            getattr(engine.channel, method)(*args)
        self.fail(engine, "transfer", RuntimeError(f"trainer aborted the transfer: {exc!r}"))

    def _send(self, params: FullParams, specs: list[ParamSpec], plan: list[range], engines, prefix) -> None:
        """Gather, pack and send bucket by bucket, into two buffers: each bucket is queued for sending as
        soon as it is packed (behind the one on the wire), and packing the next waits only for the
        send of the bucket whose buffer it reuses, so the wire never waits for the packing."""
        device = "cuda" if any(e.backend in (NCCL_BACKEND, IPC_BACKEND) for e in engines) else "cpu"
        buffers_2N = _send_buffers(device, max((bucket_nbytes(specs, b) for b in plan), default=0))
        in_flight: deque[dict[Engine, list]] = deque()
        started = time.perf_counter()
        for index, payload_N, crc in self._packed(params, specs, plan, buffers_2N, prefix):
            live = [e for e in engines if e in self.live]
            in_flight.append({e: self._try(e, "send", index, payload_N, crc) for e in live})
            self.bytes_sent += payload_N.numel() * len(live)
            self.buckets_sent = index + 1
            if len(in_flight) == len(buffers_2N):  # the next bucket reuses the oldest one's buffer
                self._wait(in_flight.popleft())
        while in_flight:
            self._wait(in_flight.popleft())
        self.seconds[f"{prefix}send"] = time.perf_counter() - started  # gather + pack + checksum + broadcast

    def _packed(self, params: FullParams, specs, plan, buffers, prefix: str = "") -> Iterator[tuple]:
        """Each bucket gathered and packed into the next of `buffers`, with its checksum: `(index,
        payload_N, checksum)`; the seconds spent on each step go to `{prefix}gather_pack` and
        `{prefix}checksum`. Every engine checks each bucket: refit_gloo the CRC-32 of its host bytes, the
        GPU engines a checksum taken on the device (queued on the stream behind the packing; no host sync)."""
        gather_pack = crc_s = 0.0
        began = time.perf_counter()
        for index, payload_N in packed_buckets(iter(params), specs, plan, buffers):
            packed = time.perf_counter()
            crc = checksum(payload_N) if payload_N.device.type == "cpu" else device_checksum(payload_N)
            gather_pack += packed - began
            crc_s += time.perf_counter() - packed
            yield index, payload_N, crc
            began = time.perf_counter()
        self.seconds[f"{prefix}gather_pack"], self.seconds[f"{prefix}checksum"] = gather_pack, crc_s

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


def _mismatch(want: dict[str, tuple[int, ...]], specs: list[ParamSpec]) -> str | None:
    have = {s.name: s.shape for s in specs}
    problems = {
        "missing": sorted(want.keys() - have.keys()),
        "unexpected": sorted(have.keys() - want.keys()),
        "shape mismatch": [
            f"{n}: engine {want[n]}, sent {have[n]}"
            for n in sorted(want.keys() & have.keys())
            if want[n] != have[n]
        ],
    }
    return "; ".join(f"{what} {items[:8]}" for what, items in problems.items() if items) or None


def _verify_failed(engine: Engine) -> bool:
    """Whether the engine's last transfer stopped at a bucket that failed its check (False if it cannot
    say: it died, or it is not one of ours)."""
    try:
        return any(report.get("failed") is not None for report in engine.verify_report())
    except Exception:
        return False


_SHADOW = ReceiveBuffers()  # rank 0's copy of the bytes its delta engines hold (kept between refits)
_HOST_SEND = ReceiveBuffers()  # rank 0's two host bucket buffers (kept between refits)


def _send_buffers(device: str, num_bytes: int) -> list[torch.Tensor]:
    """Two bucket buffers. Host ones are kept between refits: fresh host memory is paid for again in
    page faults on every first write (~25K faults for two 50 MiB buffers), GPU memory is not kept."""
    if device != "cpu":
        return [torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    return _HOST_SEND.carve([num_bytes] * 2)
