"""Parameter specs, bucket planning and byte packing: the wire format shared by sender and engine.

A refit moves full parameters as a sequence of buckets. Each bucket is the raw bytes of consecutive
parameters laid end to end (uint8), in the order of the spec list. Both ends compute the bucket
boundaries from the same spec list with `plan_buckets`, so no boundary travels on the wire.

The boundary rule is vLLM's packed-broadcast rule (`vllm.distributed.weight_transfer.packed_tensor`:
add parameters until the running size *exceeds* the buffer size, then flush), so the same sender
feeds vLLM's own NCCL engine on GPU and our gloo engine on CPU. A bucket therefore holds at most
`bucket_bytes` plus one parameter. This module only needs torch: it must import on a GPU machine
without vLLM (bench/refit_pack.py runs there). It refuses nothing; validation lives in `_refit.py`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch


class ParamSpec(NamedTuple):
    """One full (unsharded) parameter as it travels: Hugging Face name, wire dtype, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def from_json(cls, item: Sequence) -> ParamSpec:
        name, dtype_name, shape = item
        return cls(name, getattr(torch, dtype_name), tuple(int(s) for s in shape))


def plan_buckets(specs: Sequence[ParamSpec], bucket_bytes: int) -> list[range]:
    """Split `specs` into consecutive index ranges; a bucket closes once its size exceeds `bucket_bytes`."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, start, size = [], 0, 0
    for i, spec in enumerate(specs):
        size += spec.nbytes
        if size > bucket_bytes:
            buckets.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(specs):
        buckets.append(range(start, len(specs)))
    return buckets


def bucket_nbytes(specs: Sequence[ParamSpec], bucket: range) -> int:
    return sum(specs[i].nbytes for i in bucket)


def pack_bucket(buffer_N: torch.Tensor, tensors: Iterable[torch.Tensor]) -> int:
    """Copy `tensors` back to back into the uint8 `buffer_N`; returns the number of bytes written.

    On a GPU: one `torch.cat(..., out=)` into a reused buffer, one batched kernel instead of a copy per
    tensor (per-tensor copies were host-bound at a third of cat's rate on an H200, bench/refit_pack.py).
    On a CPU: plain memcpys (numpy, which lets go of the GIL while it copies), in pieces of at most
    4 MiB spread over `_pack_threads()` threads. torch's CPU copy (and cat, which copies input by
    input) splits every tensor over its OpenMP threads, and on a loaded machine each such split waits
    for a preempted thread: ~7 ms per 256 KiB tensor on the 2-core CI VM, a tenth of memcpy's rate over
    a small model (bench/refit_cpu.py).
    """
    flats = [tensor.detach().contiguous().view(-1).view(torch.uint8) for tensor in tensors]
    num_bytes = sum(flat.numel() for flat in flats)
    if buffer_N.device.type != "cpu":
        torch.cat(flats, out=buffer_N[:num_bytes])
        return num_bytes
    import numpy as np

    out_N, offset, pieces = buffer_N.numpy(), 0, []
    for flat in flats:
        source = flat.numpy()
        for start in range(0, source.size, _PACK_PIECE_BYTES):
            piece = source[start : start + _PACK_PIECE_BYTES]
            pieces.append((out_N[offset + start : offset + start + piece.size], piece))
        offset += source.size
    threads = _pack_threads()
    copy_all = map if threads == 1 or len(pieces) == 1 else _pack_pool(threads).map  # map: on this thread
    list(copy_all(lambda job: np.copyto(*job), pieces))
    return num_bytes


_PACK_PIECE_BYTES = 4 << 20


def _pack_threads() -> int:
    """Threads that pack on a CPU: one per two cores beyond the two the wire itself keeps busy (the
    sender's and the receiver's socket copies), at most four; one on a machine of two to five cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, (cores - 2) // 2))


@functools.cache
def _pack_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="refit-pack")


def packed_buckets(
    stream: Iterator[tuple[str, torch.Tensor]],
    specs: Sequence[ParamSpec],
    plan: Sequence[range],
    buffers: Sequence[torch.Tensor],
) -> Iterator[tuple[int, torch.Tensor]]:
    """Take each bucket's tensors from `stream` (gathering them) and pack it into the next of `buffers`.

    Yields `(index, payload_N)`, a view of `buffers[index % len(buffers)]`: the caller must be done with
    a buffer (its send complete) before asking for the bucket that reuses it. At most one bucket of
    gathered tensors is alive at a time. A stream that disagrees with `specs` raises `ValueError`.
    """
    for index, bucket in enumerate(plan):
        tensors = []
        for i in bucket:
            name, tensor = next(stream)
            spec = specs[i]
            if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(
                    f"the parameter stream disagrees with its specs: expected {spec}, got {name} "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
            tensors.append(tensor)
        buffer_N = buffers[index % len(buffers)]
        num_bytes = pack_bucket(buffer_N, [t.to(buffer_N.device) for t in tensors])
        del tensors
        yield index, buffer_N[:num_bytes]


def unpack_bucket(buffer_N: torch.Tensor, specs: Sequence[ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer_N` as the named tensors of `specs` (no copy: keep `buffer_N` alive while used)."""
    out, offset = [], 0
    for spec in specs:
        chunk = buffer_N[offset : offset + spec.nbytes]
        if offset % spec.dtype.itemsize:  # mixed dtypes can misalign a view; copy that one tensor
            chunk = chunk.clone()
        out.append((spec.name, chunk.view(spec.dtype).view(spec.shape)))
        offset += spec.nbytes
    assert offset == buffer_N.numel(), f"bucket holds {buffer_N.numel()} bytes, specs need {offset}"
    return out
