"""The byte pipes from the trainer (rank 0 of each group) to one engine's workers, and the checks on them.

One group per engine, not one for all engines: an engine that dies mid-transfer breaks only its own
group, so the others still receive every bucket. Every bucket is checked by the engine against a checksum
of the bytes the trainer packed; a mismatch raises `VerifyError` there, the engine rolls back, and the
trainer retries it with a full refit (`refit._refit`). Three kinds:

- gloo (CPU, our `refit_gloo` vLLM backend): a TCPStore hosted by the trainer plus a ProcessGroupGloo,
  built from torch alone on both ends (no global process group is touched). Each bucket is preceded by
  a two-element header: the bucket index (or -1 = aborted) and the CRC-32 of the bucket's bytes as the
  trainer packed them. The receiver posts every receive of the refit at once (`Incoming`), so the
  stream must always run to its end: a trainer that fails mid-transfer sends the remaining buckets as
  aborted junk (`GlooChannel.abort`), and the engine, having seen an aborted header, rolls back
  instead of loading. The engine checks every bucket's CRC before it loads it.
- ipc (one GPU, our `refit_ipc`: vLLM's CUDA IPC engine plus the check): no group. Each bucket, packed
  into the trainer's GPU buffer, reaches the engine as a CUDA IPC handle in its own `/update_weights`
  call, with the bucket's `device_checksum`; the engine checks, copies and loads it before answering.
  A trainer that fails mid-transfer makes one call more, an unpacked bucket without a checksum: the
  engine refuses it and rolls back, which ends vLLM's update (open between calls, layers half reloaded).
- nccl (GPU, our `refit_nccl`: vLLM's NCCL engine plus the check): vLLM's StatelessProcessGroup +
  PyNcclCommunicator, because the engine side rendezvouses that way. vLLM is imported only here, lazily.
  vLLM's NCCL receiver takes bare buckets, so the trainer's checksums follow the last bucket as one more
  broadcast, and the engine checks once every bucket has arrived (and been loaded). No abort signal: a
  trainer that fails mid-transfer leaves the engine waiting; it stays paused and is reported (`_refit.py`).

The GPU check is `device_checksum`, computed on the device on both ends (no bucket crosses to the host);
the CPU one is zlib's CRC-32 (`checksum`), which lets go of the GIL while the wire moves.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import itertools
import pickle
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

ABORT = -1  # header value that tells a gloo engine to roll back


class VerifyError(RuntimeError):
    """A bucket's bytes on the engine differ from the bytes the trainer packed (its checksum differs)."""


def checksum(buffer_N: torch.Tensor) -> int:
    """CRC-32 of a uint8 host tensor's bytes. zlib's CRC lets go of the GIL while it runs (the wire
    keeps moving), and it catches every error of up to 32 consecutive bits, one flipped byte included."""
    return zlib.crc32(buffer_N.numpy())


CHECKSUM_WORDS = 1 << 22  # words per step of `device_checksum`: its int64 temporaries stay at 64 MiB


def device_checksum(buffer_N: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of a uint8 bucket's 4-byte words, computed where the bucket lives: the bytes,
    zero-padded to a multiple of 4, read as int32 words w_0, w_1, ..., and summed as sum_i (i + 1) * w_i
    in int64 (wrapping; integer sums wrap alike in any order, on any device). A 0-dim int64 tensor on the
    bucket's device, queued on the current stream: no host sync.

    In a bucket under 16 GiB it catches every change of one word (one flipped byte among them: d * (i + 1)
    with 0 < |d| < 2^32 is no multiple of 2^64) and every swap of two different words (their difference
    times the distance between them). Steps of `CHECKSUM_WORDS` words keep the temporaries bounded.
    """
    num_bytes, device = buffer_N.numel(), buffer_N.device
    whole = num_bytes - num_bytes % 4
    words_W = buffer_N[:whole].view(torch.int32)  # a bucket starts 4-byte aligned (a buffer's start)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, words_W.numel(), CHECKSUM_WORDS):
        step_S = words_W[start : start + CHECKSUM_WORDS].to(torch.int64)
        step_S *= torch.arange(start + 1, start + 1 + step_S.numel(), dtype=torch.int64, device=device)
        total += step_S.sum()
    if whole < num_bytes:  # the last 1-3 bytes, zero-padded to one more word
        tail_4 = torch.zeros(4, dtype=torch.uint8, device=device)
        tail_4[: num_bytes - whole] = buffer_N[whole:]
        total += tail_4.view(torch.int32).to(torch.int64)[0] * (whole // 4 + 1)
    return total


def verify_checksums(record: dict, got: list[int], expected: list[int], *, first: int = 0) -> None:
    """The GPU engines' check: note the device checksums the engine took (`got`, of buckets `first`,
    `first` + 1, ...) in `record` (its `refit_last_verify` answer), and raise `VerifyError` at the first
    that differs from the trainer's (`expected`), naming that bucket in `record["failed"]`."""
    record["checksums"] += got
    if len(got) != len(expected):
        error = VerifyError(f"{len(got)} buckets arrived, the trainer sent checksums of {len(expected)}")
        record.update(failed=first, error=str(error))
        raise error
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True), start=first):
        if mine != theirs:
            error = VerifyError(
                f"bucket {index} has device checksum {mine:#x} on the engine, the trainer packed "
                f"{theirs:#x}: its bytes changed on the way (the engine rolls back; the trainer retries "
                "with a full refit)"
            )
            record.update(failed=index, error=str(error))
            raise error
        record["checked"] = index + 1


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore, listening on a port the OS picks (`.port`): no window between choosing a free
    port and binding it in which another process could take it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def join_gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, store: dist.TCPStore | None = None
) -> dist.ProcessGroupGloo:
    """Join (rank 0: host) a gloo group of `world_size` ranks through a TCPStore at host:port (rank 0 may
    pass the one it already holds, from `host_store`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("refit", store), rank, world_size, timeout)


def broadcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> dist.Work:
    # Call the group directly: torch.distributed.broadcast(group=...) needs the group registered in the
    # global state, which a stateless group is not (FACTS).
    options = dist.BroadcastOptions()
    options.rootRank = 0
    # torch's stub omits Backend.broadcast (the binding has it).
    return group.broadcast([tensor], options)  # type: ignore[attr-defined]


class Incoming:
    """One refit's buckets arriving into `buffers` (uint8, one per bucket, sized by the plan).

    Every receive is posted at once, before the first is waited for, so gloo's threads take bucket
    after bucket off the wire with no Python (and no GIL) between them, whatever the caller does
    meanwhile. The stream always runs to its end (a trainer that fails sends the rest as aborted
    junk), so `drain` must follow, even after an error, before the group carries another refit.
    """

    def __init__(self, group: dist.ProcessGroupGloo, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.verify_s = 0.0  # seconds spent on the CRC checks
        self.headers_N2 = torch.full((len(buffers), 2), ABORT - 1, dtype=torch.int64)  # (index, CRC-32)
        self.works: list[tuple[dist.Work, ...]] = [
            (broadcast(group, self.headers_N2[index]), broadcast(group, buffer_N))
            for index, buffer_N in enumerate(buffers)
        ]

    def wait(self, index: int) -> torch.Tensor:
        """Bucket `index`, once it has arrived and its CRC matches the trainer's; raises `RuntimeError` if
        the trainer aborted it, `VerifyError` if its bytes differ from what the trainer packed."""
        for work in self.works[index]:
            work.wait()
        sent_index, crc = self.headers_N2[index].tolist()
        if sent_index != index:
            raise RuntimeError(f"refit_gloo: the trainer aborted the transfer at bucket {index}")
        return self._checked(index, crc)

    def _checked(self, index: int, crc: int) -> torch.Tensor:
        """Bucket `index`, unless its CRC-32 differs from the one the trainer sent (`VerifyError`)."""
        began = time.perf_counter()
        buffer_N = self.buffers[index]
        if (got := checksum(buffer_N)) != crc:
            raise VerifyError(
                f"refit_gloo: bucket {index} ({buffer_N.numel()} bytes) has CRC-32 {got:#010x}, the trainer "
                f"packed {crc:#010x}: its bytes changed on the way (the engine rolls back; the trainer "
                "retries with a full refit)"
            )
        self.verify_s += time.perf_counter() - began
        return buffer_N

    def drain(self) -> None:
        """Wait for the rest of the stream (errors here are the ones already raised, or a dead peer)."""
        for work in (work for works in self.works for work in works):
            with contextlib.suppress(Exception):
                work.wait()


class ReceiveBuffers:
    """An engine's receive buffers, one per bucket, carved from one block of host memory kept between
    refits (one copy of the weights): fresh memory costs a page fault per 4 KiB on every refit (a raw
    gloo broadcast into fresh memory takes 2-3x as long as into a warm buffer, bench/refit_cpu.py).
    Reusing the block is safe only while no weight lives in it: `forget_if_used_by` checks that.
    The trainer keeps two: the shadow of its delta engines' bytes (`refit._delta`) and its host send
    buffers."""

    def __init__(self) -> None:
        self.block_N: torch.Tensor | None = None
        self.layout: tuple = ()
        self.token: str | None = None  # names the refit whose bytes the block holds whole (delta base)

    def carve(self, sizes: list[int], key: tuple = ()) -> list[torch.Tensor]:
        """One buffer per bucket of `sizes`; `key`: what else the bytes held depend on (the trainer's
        shadow: the specs and the bucket size)."""
        if (key, sizes) != self.layout:  # another layout: the bytes held are no base for it
            self.layout, self.token = (key, list(sizes)), None
        # Each bucket starts 64-byte aligned, so its tensors view as any dtype.
        starts = [0, *itertools.accumulate(-(-num_bytes // 64) * 64 for num_bytes in sizes)]
        if self.block_N is None or self.block_N.numel() < starts[-1]:
            self.block_N, self.token = torch.empty(starts[-1], dtype=torch.uint8), None
        return [self.block_N[start : start + n] for start, n in zip(starts, sizes, strict=False)]

    def forget_if_used_by(self, tensors: list[torch.Tensor]) -> bool:
        """Drop the block if any of `tensors` lives in it (the next `carve` allocates); True if so."""
        if self.block_N is None:
            return False
        block = self.block_N.untyped_storage().data_ptr()
        if used := any(t.untyped_storage().data_ptr() == block for t in tensors):
            self.block_N, self.token = None, None
        return used


class GlooChannel:
    """Trainer end of one engine's gloo group. `send` is asynchronous: `wait` on what it returns."""

    def __init__(self, group: dist.ProcessGroupGloo) -> None:
        self.group = group

    def send(self, index: int, payload_N: torch.Tensor, crc: int) -> list[dist.Work]:
        """Bucket `index` behind its header; `crc`: `checksum(payload_N)`, which the engine checks."""
        header = torch.tensor([index, crc], dtype=torch.int64)
        return [broadcast(self.group, header), broadcast(self.group, payload_N)]

    def send_all(self, payloads: list[torch.Tensor]) -> list[dist.Work]:
        """Broadcast each of `payloads` as it is, in order (a delta stream: `refit._delta`)."""
        return [broadcast(self.group, payload) for payload in payloads]

    def abort(self, sizes: list[int]) -> None:
        """Send the buckets not yet sent (their byte `sizes`) as aborted: an ABORT header and junk each,
        so the engine's posted receives all complete and it rolls back."""
        junk_N = torch.zeros(max(sizes, default=0), dtype=torch.uint8)
        works = [work for num_bytes in sizes for work in self.send(ABORT, junk_N[:num_bytes], 0)]
        for work in works:
            work.wait()

    def close(self) -> None:
        del self.group  # a closed channel holds no group


class NcclChannel:
    """Trainer end of one engine's NCCL group (vLLM's communicator; needs vLLM and CUDA).

    `begin` gives it the refit's bucket plan; `send` broadcasts each bucket and, after the last, the
    buckets' checksums, which the engine compares with its own (`refit.vllm_gpu`). Every broadcast is
    queued on the current stream, behind the packing and the checksum of its bucket."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})
        self.num_buckets = 0
        self.checksums: list[torch.Tensor] = []

    def begin(self, specs: Sequence, plan: Sequence[range]) -> None:
        self.num_buckets, self.checksums = len(plan), []

    def send(self, index: int, payload_N: torch.Tensor, check: torch.Tensor) -> list:
        """Bucket `index`; `check`: its `device_checksum` (a 0-dim tensor on the payload's device)."""
        self.comm.broadcast(payload_N, src=0)
        self.checksums.append(check)
        if index == self.num_buckets - 1:
            self.comm.broadcast(torch.stack(self.checksums), src=0)
        return []

    def abort(self, sizes: list[int]) -> None:
        pass  # vLLM's NCCL receiver has no abort signal; the caller keeps the engine paused.

    def close(self) -> None:
        torch.cuda.current_stream().synchronize()
        del self.comm  # a closed channel holds no communicator


class IpcChannel:
    """Trainer end of an engine on this trainer's GPU (our `refit_ipc` backend; needs CUDA, not vLLM).

    `begin` gives it the refit's parameter list and bucket plan; `send` hands the engine a CUDA IPC handle
    of one packed bucket and its checksum in one `/update_weights` call (`post`), which answers once the
    engine has checked, copied and loaded the bucket. The calls run one at a time on a thread of their own,
    so the trainer packs the next bucket into its other buffer meanwhile; `wait` on what `send` returns
    before reusing a buffer.
    """

    def __init__(self, post: Callable[[dict], None]) -> None:
        self.post = post
        self.specs: list = []
        self.plan: list[range] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-ipc")

    def begin(self, specs: Sequence, plan: Sequence[range]) -> None:
        self.specs, self.plan = list(specs), list(plan)

    def send(self, index: int, payload_N: torch.Tensor, check: torch.Tensor) -> list[_Posted]:
        """Bucket `index`; `check`: its `device_checksum` (a 0-dim tensor on the payload's device)."""
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(payload_N.device).synchronize()  # the packing kernel has written it
        gpu = str(torch.cuda.get_device_properties(payload_N.device).uuid)  # the engine finds its GPU here
        info = self.update_info(index, {gpu: reduce_tensor(payload_N)[1]}, int(check))
        return [_Posted(self.pool.submit(self.post, info))]

    def update_info(self, index: int, handle: dict, checksum: int) -> dict:
        """The `/update_weights` payload of bucket `index`: its parameters, the CUDA IPC `handle` of its
        packed bytes (by GPU UUID) and their `checksum`."""
        bucket = [self.specs[i] for i in self.plan[index]]
        return {
            "names": [spec.name for spec in bucket],
            "dtype_names": [str(spec.dtype).removeprefix("torch.") for spec in bucket],
            "shapes": [list(spec.shape) for spec in bucket],
            "tensor_sizes": [spec.nbytes for spec in bucket],
            "packed": True,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handle)).decode(),
            "checksum": checksum,
        }

    def abort(self, sizes: list[int]) -> None:
        """End the engine's update, behind the buckets in flight: an unpacked bucket without a checksum,
        which it refuses, rolling back (this raises its refusal)."""
        self.pool.submit(self.post, dict(names=[], dtype_names=[], shapes=[], ipc_handles={})).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        torch.cuda.ipc_collect()  # lets go of buffers the engine has released


class _Posted:
    """One `/update_weights` call in flight, waited for like a collective's work."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()
