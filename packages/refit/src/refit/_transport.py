"""The byte pipes from the trainer (rank 0 of each group) to one engine's workers.

One group per engine, not one for all engines: an engine that dies mid-transfer breaks only its own
group, so the others still receive every bucket. Two kinds:

- gloo (CPU, our `refit_gloo` vLLM backend): a TCPStore hosted by the trainer plus a ProcessGroupGloo,
  built from torch alone on both ends (no global process group is touched). Each bucket is preceded by
  a one-element header (the bucket index, or -1 = aborted). The receiver posts every receive of the
  refit at once (`Incoming`), so the stream must always run to its end: a trainer that fails
  mid-transfer sends the remaining buckets as aborted junk (`GlooChannel.abort`), and the engine,
  having seen an aborted header, rolls back instead of loading.
- nccl (GPU, vLLM's own `nccl` backend): vLLM's StatelessProcessGroup + PyNcclCommunicator, because the
  engine side rendezvouses that way. vLLM is imported only here, lazily. vLLM's NCCL consumer has no
  header, so an abort cannot be signalled: the engine stays paused and is reported (see `_refit.py`).
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

__all__ = ["join_gloo_group", "Incoming", "ReceiveBuffers", "GlooChannel", "NcclChannel", "ABORT"]

ABORT = -1  # header value that tells a gloo engine to roll back


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
    return group.broadcast([tensor], options)


class Incoming:
    """One refit's buckets arriving into `buffers` (uint8, one per bucket, sized by the plan).

    Every receive is posted at once, before the first is waited for, so gloo's threads take bucket
    after bucket off the wire with no Python (and no GIL) between them, whatever the caller does
    meanwhile. The stream always runs to its end (a trainer that fails sends the rest as aborted
    junk), so `drain` must follow, even after an error, before the group carries another refit.
    """

    def __init__(self, group: dist.ProcessGroupGloo, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.headers = torch.full((len(buffers),), ABORT - 1, dtype=torch.int64)
        self.works = [
            (broadcast(group, self.headers[index : index + 1]), broadcast(group, buffer_N))
            for index, buffer_N in enumerate(buffers)
        ]

    def wait(self, index: int) -> torch.Tensor:
        """Bucket `index`, once it has arrived; raises `RuntimeError` if the trainer aborted it."""
        for work in self.works[index]:
            work.wait()
        if int(self.headers[index]) != index:
            raise RuntimeError(f"refit_gloo: the trainer aborted the transfer at bucket {index}")
        return self.buffers[index]

    def drain(self) -> None:
        """Wait for the rest of the stream (errors here are the ones already raised, or a dead peer)."""
        for work in (work for pair in self.works for work in pair):
            with contextlib.suppress(Exception):
                work.wait()


class ReceiveBuffers:
    """An engine's receive buffers, one per bucket, carved from one block of host memory kept between
    refits (one copy of the weights): fresh memory costs a page fault per 4 KiB on every refit (a raw
    gloo broadcast into fresh memory takes 2-3x as long as into a warm buffer, bench/refit_cpu.py).
    Reusing the block is safe only while no weight lives in it: `forget_if_used_by` checks that."""

    def __init__(self) -> None:
        self.block_N: torch.Tensor | None = None

    def carve(self, sizes: list[int]) -> list[torch.Tensor]:
        starts = [0]
        for num_bytes in sizes:  # each bucket starts 64-byte aligned, so its tensors view as any dtype
            starts.append(starts[-1] + -(-num_bytes // 64) * 64)
        if self.block_N is None or self.block_N.numel() < starts[-1]:
            self.block_N = torch.empty(starts[-1], dtype=torch.uint8)
        return [self.block_N[start : start + n] for start, n in zip(starts, sizes, strict=False)]

    def forget_if_used_by(self, tensors: list[torch.Tensor]) -> bool:
        """Drop the block if any of `tensors` lives in it (the next `carve` allocates); True if so."""
        if self.block_N is None:
            return False
        block = self.block_N.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == block for t in tensors):
            self.block_N = None
            return True
        return False


class GlooChannel:
    """Trainer end of one engine's gloo group. `send` is asynchronous: `wait` on what it returns."""

    kind = "gloo"

    def __init__(self, group: dist.ProcessGroupGloo) -> None:
        self.group = group

    def send(self, index: int, payload_N: torch.Tensor) -> list[dist.Work]:
        header = torch.tensor([index], dtype=torch.int64)
        return [broadcast(self.group, header), broadcast(self.group, payload_N)]

    def abort(self, sizes: list[int]) -> None:
        """Send the buckets not yet sent (their byte `sizes`) as aborted: an ABORT header and junk each,
        so the engine's posted receives all complete and it rolls back."""
        header = torch.tensor([ABORT], dtype=torch.int64)
        junk_N = torch.zeros(max(sizes, default=0), dtype=torch.uint8)
        works = []
        for num_bytes in sizes:
            works += [broadcast(self.group, header), broadcast(self.group, junk_N[:num_bytes])]
        for work in works:
            work.wait()

    def close(self) -> None:
        self.group = None


class NcclChannel:
    """Trainer end of one engine's NCCL group (vLLM's communicator; needs vLLM and CUDA)."""

    kind = "nccl"

    def __init__(self, host: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})

    def send(self, index: int, payload_N: torch.Tensor) -> list:
        # Enqueued on the current stream; packing the next bucket is ordered after it on that stream.
        self.comm.broadcast(payload_N, src=0)
        return []

    def abort(self, sizes: list[int]) -> None:
        pass  # vLLM's NCCL consumer has no abort signal; the caller keeps the engine paused.

    def close(self) -> None:
        torch.cuda.current_stream().synchronize()
        self.comm = None
