"""Delta refit's pieces: which elements changed, the patch that rebuilds a bucket, and the delta stream
over a real two-rank gloo group (both ends in this process, the engine end on a thread)."""

from __future__ import annotations

import threading

import pytest
import torch

import refit
from refit import ParamSpec
from refit._buckets import bucket_nbytes, plan_buckets, unpack_bucket
from refit._delta import ABORTED, FULL, SPARSE, DeltaIncoming, apply_patch, bucket_unit, diff_into
from refit._run import Run
from refit._transport import Incoming, ReceiveBuffers, VerifyError, checksum


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8).clone()


def _nudged(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`old` with about `fraction` of its elements moved to a different value."""
    gen = torch.Generator().manual_seed(seed)
    where = torch.rand(old.shape, generator=gen) < fraction
    return torch.where(where, old + 0.5 + torch.rand(old.shape, generator=gen), old).to(old.dtype)


def test_the_unit_is_the_narrowest_dtype_where_it_divides_the_bucket():
    bf16, fp32 = ParamSpec("a", torch.bfloat16, (3,)), ParamSpec("b", torch.float32, (2,))
    assert bucket_unit([fp32]) == 4 and bucket_unit([bf16]) == 2
    assert bucket_unit([fp32, bf16, bf16]) == 2  # 8 + 6 + 6 bytes
    assert bucket_unit([ParamSpec("c", torch.bfloat16, (2,)), ParamSpec("d", torch.uint8, (3,))]) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fraction", [0.0, 0.003, 0.05])
def test_a_patch_rebuilds_the_new_bucket_exactly_and_holds_only_the_changed_elements(dtype, fraction):
    old = torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    new = _nudged(old, fraction, seed=1)
    shadow_N, unit = _bytes(old), dtype.itemsize
    patch_N = diff_into(shadow_N, _bytes(new), unit)
    assert torch.equal(shadow_N, _bytes(new))  # the trainer's copy now holds the new bytes
    bits = {2: torch.int16, 4: torch.int32}[unit]
    changed = int((old.view(bits) != new.view(bits)).sum())
    assert patch_N.numel() == changed * (4 + unit)  # int32 index + value, per changed element
    engine_N = _bytes(old)
    apply_patch(0, engine_N, patch_N, unit)
    assert torch.equal(engine_N, _bytes(new))


def test_a_dense_change_sends_the_whole_bucket():
    old = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    new = _nudged(old, 0.5, seed=3)  # half the elements: index + value would outweigh the bucket
    shadow_N = _bytes(old)
    assert diff_into(shadow_N, _bytes(new), 2) is None
    assert torch.equal(shadow_N, _bytes(new))


def test_a_malformed_patch_is_refused():
    buffer_N = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(VerifyError, match="patch of bucket 3 is malformed"):
        apply_patch(3, buffer_N, torch.zeros(7, dtype=torch.uint8), 2)  # not a whole (index, value)
    far = torch.tensor([1000], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(VerifyError, match="malformed"):
        apply_patch(3, buffer_N, torch.cat([far, torch.zeros(2, dtype=torch.uint8)]), 2)


def _delta_round(pipe, engine_old, new, kinds, base_ok: bool, corrupt: int | None = None) -> dict:
    """Send `new` (uint8 buckets) as a delta stream of `kinds` against `engine_old`, the bytes the engine
    keeps; returns what the engine end made of each bucket (its bytes, or the error)."""
    channel, group = pipe
    buffers = [b.clone() for b in engine_old]
    shadow = [b.clone() for b in engine_old]
    rows, payloads = [], []
    for index, (bucket, kind) in enumerate(zip(new, kinds, strict=True)):
        patch = diff_into(shadow[index], bucket, 2) if kind == SPARSE else None
        if kind == FULL:
            shadow[index].copy_(bucket)
        rows.append(
            [kind, 0 if kind == ABORTED else (bucket if patch is None else patch).numel(), checksum(bucket)]
        )
        if kind != ABORTED and (patch is None or patch.numel()):
            payloads.append(bucket.clone() if patch is None else patch)
    if corrupt is not None:
        payloads[corrupt][-1] ^= 0x10  # a value byte of that payload
    out: dict = {}

    def engine() -> None:
        incoming = DeltaIncoming(group, buffers, [2] * len(buffers), base_ok)
        for index in range(len(buffers)):
            try:
                out[index] = incoming.wait(index).clone()
            except RuntimeError as exc:
                out[index] = exc
        incoming.drain()

    thread = threading.Thread(target=engine)
    thread.start()
    for work in channel.send_all([torch.tensor(rows, dtype=torch.int64), *payloads]):
        work.wait()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return out


def _buckets(seed: int, fraction: float = 0.0, old=None) -> list[torch.Tensor]:
    if old is None:
        gen = torch.Generator().manual_seed(seed)
        return [_bytes(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in (2000, 3000, 500)]
    return [_bytes(_nudged(b.view(torch.bfloat16), fraction, seed)) for b in old]


def test_the_delta_stream_rebuilds_every_bucket_on_the_engine(pipe):
    old = _buckets(0)
    new = _buckets(4, 0.01, old)
    new[2] = old[2].clone()  # an unchanged bucket: an empty patch, which does not travel
    out = _delta_round(pipe, old, new, [SPARSE, FULL, SPARSE], base_ok=True)
    assert all(torch.equal(out[i], new[i]) for i in range(3))
    assert not torch.equal(new[0], old[0])


def test_a_stale_base_a_corrupt_patch_and_an_abort_fail_only_their_buckets(pipe):
    old = _buckets(0)
    new = _buckets(5, 0.01, old)
    out = _delta_round(pipe, old, new, [SPARSE, FULL, SPARSE], base_ok=False)  # the engine lost its base
    assert isinstance(out[0], VerifyError) and "no longer holds" in str(out[0])
    assert torch.equal(out[1], new[1])  # a whole bucket needs no base
    out = _delta_round(pipe, old, new, [SPARSE, FULL, SPARSE], base_ok=True, corrupt=2)
    assert torch.equal(out[0], new[0]) and isinstance(out[2], VerifyError) and "CRC-32" in str(out[2])
    out = _delta_round(pipe, old, new, [ABORTED] * 3, base_ok=True)
    assert all("aborted the transfer" in str(out[i]) for i in range(3))
    out = _delta_round(pipe, old, new, [SPARSE, SPARSE, SPARSE], base_ok=True)  # the group is still usable
    assert all(torch.equal(out[i], new[i]) for i in range(3))


class _PipeEngine(refit.Engine):
    """An engine whose `/update_weights` is the gloo receive path, run here on the pipe's engine end."""

    def __init__(self, pipe) -> None:
        super().__init__("http://pipe")
        self.channel, self.group = pipe
        self.buffers, self.got = ReceiveBuffers(), {}

    def update_weights(self, update_info: dict) -> None:
        names, dtypes, shapes = (update_info[key] for key in ("names", "dtype_names", "shapes"))
        specs = [ParamSpec.from_json(item) for item in zip(names, dtypes, shapes, strict=True)]
        plan = plan_buckets(specs, update_info["bucket_bytes"])
        buffers = self.buffers.carve([bucket_nbytes(specs, bucket) for bucket in plan])
        if (base := update_info["delta_base"]) is None:
            incoming = Incoming(self.group, buffers)
        else:
            units = [bucket_unit([specs[i] for i in bucket]) for bucket in plan]
            incoming = DeltaIncoming(self.group, buffers, units, self.buffers.token == base)
        try:
            for index, bucket in enumerate(plan):
                tensors = unpack_bucket(incoming.wait(index), [specs[i] for i in bucket])
                self.got.update((name, tensor.clone()) for name, tensor in tensors)
        finally:
            incoming.drain()
        self.buffers.token = update_info["token"]


def test_a_delta_refit_with_a_bucket_of_empty_parameters_keeps_the_stream_aligned(pipe):
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(64))  # 256 bytes: bucket 0
    model.empty = torch.nn.Parameter(torch.empty(0))  # bucket 1 holds 0 bytes
    engine = _PipeEngine(pipe)
    specs = refit.full_params(model).specs
    plan = plan_buckets(specs, 128)
    assert [bucket_nbytes(specs, bucket) for bucket in plan] == [256, 0]
    for step in range(3):  # whole, then patched twice
        with torch.no_grad():
            model.weight[step] += 1.0
        run = Run([engine])
        run.transfer_delta(refit.full_params(model), specs, plan, 128, token=f"t{step}")
        assert not run.failures, (step, run.failures)
        engine.delta_base = f"t{step}"
        assert torch.equal(engine.got["weight"], model.weight.detach())
    engine.close()
