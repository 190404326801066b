"""Delta refit on the gloo path: per bucket, only the elements whose bytes changed since the engine's.

Both ends keep the last refit's bytes of every bucket in `refit._transport.ReceiveBuffers`: the trainer
in its shadow (`refit._run._SHADOW`: one copy of the weights in the wire dtype, on rank 0's host), the
engine in its kept receive buffers. A token names the refit whose bytes both hold; the trainer sends
a delta stream only to an engine whose last refit ended with that token, and a full stream otherwise.

Elements are compared as raw bits in the wire dtype (`bucket_unit`: 2 bytes for a bf16 bucket), so an
element "changed" exactly when the engine's value would change. A bucket's patch is the changed
elements' int32 indices, then their values; where that is not smaller than the bucket (a dense change,
e.g. every fp32 element after an Adam step) the whole bucket goes instead.

The delta stream: one table `[num_buckets, 3]` int64 (kind, payload bytes, CRC-32 of the whole new
bucket), then each bucket's payload unless empty (FULL: the bucket; SPARSE: its patch; ABORTED:
nothing). The
payload sizes vary, so the engine posts its receives once the table has arrived (`DeltaIncoming`),
all at once as the full stream does. The CRC is that of the bucket the engine will load, patch
applied: a stale base, a lost patch or a flipped byte all fail its check (`refit._transport.Incoming`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from refit._buckets import ParamSpec
from refit._transport import Incoming, VerifyError, broadcast

FULL, SPARSE, ABORTED = 0, 1, -1
_INDEX_BYTES = 4  # int32 element indices: a bucket holds fewer than 2**31 elements
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bucket_unit(specs: list[ParamSpec]) -> int:
    """Bytes per compared element of a bucket: its narrowest dtype's size (2 for bf16), or 1 where
    that does not divide the bucket (mixed dtypes)."""
    unit = min(spec.dtype.itemsize for spec in specs)
    return unit if unit in _UNSIGNED and sum(spec.nbytes for spec in specs) % unit == 0 else 1


def diff_into(base_N: torch.Tensor, new_N: torch.Tensor, unit: int) -> torch.Tensor | None:
    """Make the bytes of `base_N` those of `new_N`; return the patch that does the same on a copy of the
    old `base_N` (uint8: int32 indices of the changed `unit`-byte elements, then their new values), or
    None where the patch would not be smaller than the bucket (send it whole)."""
    kind = _UNSIGNED[unit]
    base, new = base_N.numpy().view(kind), new_N.numpy().view(kind)
    changed = base != new
    num_changed = int(np.count_nonzero(changed))
    if num_changed * (_INDEX_BYTES + unit) >= new.nbytes or new.size >= 2**31:
        np.copyto(base, new)
        return None
    index = np.flatnonzero(changed).astype(np.int32)
    values = new[index]
    base[index] = values
    return torch.from_numpy(np.concatenate([index.view(np.uint8), values.view(np.uint8)]))


def apply_patch(index: int, buffer_N: torch.Tensor, patch_N: torch.Tensor, unit: int) -> None:
    """Write a `diff_into` patch into `buffer_N` (bucket `index`) in place; a patch that cannot be one
    (its size, an index out of range) raises `VerifyError`."""
    num_changed, rest = divmod(patch_N.numel(), _INDEX_BYTES + unit)
    patch = patch_N.numpy()
    where = patch[: num_changed * _INDEX_BYTES].view(np.int32)
    if rest or (num_changed and not 0 <= int(where.min()) <= int(where.max()) < buffer_N.numel() // unit):
        raise VerifyError(f"refit_gloo: the patch of bucket {index} is malformed ({patch_N.numel()} bytes)")
    buffer_N.numpy().view(_UNSIGNED[unit])[where] = patch[num_changed * _INDEX_BYTES :].view(_UNSIGNED[unit])


class DeltaIncoming(Incoming):
    """The engine end of a delta stream, with `Incoming`'s interface: `wait(index)` gives bucket `index`
    whole (patched into its kept bytes) once its CRC matches; `drain` takes whatever is left.

    `base_ok`: the kept buffers hold the bytes the trainer diffed against; if not, a patched bucket
    raises `VerifyError` (its patch needs a base this engine does not hold).
    """

    def __init__(  # posts its own receives, once the table has sized them: no `Incoming.__init__`
        self, group: dist.ProcessGroupGloo, buffers: list[torch.Tensor], units: list[int], base_ok: bool
    ) -> None:
        self.buffers, self.units, self.base_ok = buffers, units, base_ok
        self.verify_s = 0.0  # seconds spent on the CRC checks
        self.table_N3 = torch.empty((len(buffers), 3), dtype=torch.int64)
        broadcast(group, self.table_N3).wait()  # arrives once the trainer has diffed every bucket
        self.rows = self.table_N3.tolist()
        self.patches: dict[int, torch.Tensor] = {}
        self.works = []
        for index, (kind, num_bytes, _) in enumerate(self.rows):
            if kind == FULL and num_bytes == buffers[index].numel():  # an empty bucket does not travel
                self.works.append((broadcast(group, buffers[index]),) if num_bytes else ())
            elif kind == SPARSE:  # an empty patch (nothing changed) does not travel either
                self.patches[index] = torch.empty(num_bytes, dtype=torch.uint8)
                self.works.append((broadcast(group, self.patches[index]),) if num_bytes else ())
            else:  # aborted: no payload follows
                assert kind == ABORTED, f"refit_gloo: bucket {index} has kind {kind} and {num_bytes} bytes"
                self.works.append(())

    def wait(self, index: int) -> torch.Tensor:
        kind, _, crc = self.rows[index]
        if kind == ABORTED:
            raise RuntimeError(f"refit_gloo: the trainer aborted the transfer at bucket {index}")
        for work in self.works[index]:
            work.wait()
        if kind == SPARSE:
            if not self.base_ok:
                raise VerifyError(
                    f"refit_gloo: bucket {index} came as a patch against bytes this engine no longer holds "
                    "(the trainer retries with a full refit)"
                )
            apply_patch(index, self.buffers[index], self.patches.pop(index), self.units[index])
        return self._checked(index, crc)
