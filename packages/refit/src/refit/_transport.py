"""The byte pipes from the trainer (rank 0 of each group) to one engine's workers.

One group per engine, not one for all engines: an engine that dies mid-transfer breaks only its own
group, so the others still receive every bucket. Two kinds:

- gloo (CPU, our `refit_gloo` vLLM backend): a TCPStore hosted by the trainer plus a ProcessGroupGloo,
  built from torch alone on both ends (no global process group is touched). Each bucket is preceded by
  a one-element header (the bucket index, or -1 to abort), so a trainer-side failure mid-transfer tells
  the engine to roll back instead of leaving it blocked in a receive.
- nccl (GPU, vLLM's own `nccl` backend): vLLM's StatelessProcessGroup + PyNcclCommunicator, because the
  engine side rendezvouses that way. vLLM is imported only here, lazily. vLLM's NCCL consumer has no
  header, so an abort cannot be signalled: the engine stays paused and is reported (see `_refit.py`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["join_gloo_group", "GlooChannel", "NcclChannel", "ABORT"]

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


class GlooChannel:
    """Trainer end of one engine's gloo group. `send` is asynchronous: `wait` on what it returns."""

    kind = "gloo"

    def __init__(self, group: dist.ProcessGroupGloo) -> None:
        self.group = group

    def send(self, index: int, payload_N: torch.Tensor) -> list[dist.Work]:
        header = torch.tensor([index], dtype=torch.int64)
        return [broadcast(self.group, header), broadcast(self.group, payload_N)]

    def abort(self) -> None:
        broadcast(self.group, torch.tensor([ABORT], dtype=torch.int64)).wait()

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

    def abort(self) -> None:
        pass  # vLLM's NCCL consumer has no abort signal; the caller keeps the engine paused.

    def close(self) -> None:
        torch.cuda.current_stream().synchronize()
        self.comm = None
