"""The wire format: bucket planning, packing, and its agreement with vLLM's packed broadcast."""

from __future__ import annotations

import pytest
import torch

import refit
from refit import ParamSpec, pack_bucket, plan_buckets, unpack_bucket
from refit._buckets import bucket_nbytes, packed_buckets


def test_public_names_are_pinned():
    assert sorted(refit.__all__) == sorted([
        "DEFAULT_BUCKET_BYTES", "GLOO_BACKEND", "IPC_BACKEND", "NCCL_BACKEND", "Engine", "EngineCallError",
        "FullParams", "ParamSpec", "RefitError", "RefitStats", "RoutingReplay", "adapter_params",
        "decode_routed_experts", "engine_env", "engine_flags", "full_params", "pack_bucket", "plan_buckets",
        "unpack_bucket", "update_weights",
    ])  # fmt: skip


def _named_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (), (16, 16), (2, 3, 4), (40,), (1,)]
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float32,
        torch.float16,
        torch.float32,
        torch.int64,
        torch.float32,
    ]
    return [
        (f"p{i}", torch.randn(shape, generator=gen).to(dtype) if dtype != torch.int64 else torch.arange(40))
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
    ]


def _specs(named):
    return [ParamSpec(n, t.dtype, tuple(t.shape)) for n, t in named]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 600, 10**6])
def test_buckets_cover_everything_in_order_and_close_once_over_the_limit(bucket_bytes):
    specs = _specs(_named_tensors())
    plan = plan_buckets(specs, bucket_bytes)
    assert [i for bucket in plan for i in bucket] == list(range(len(specs)))
    largest = max(s.nbytes for s in specs)
    for bucket in plan[:-1]:
        size = sum(specs[i].nbytes for i in bucket)
        assert bucket_bytes < size <= bucket_bytes + largest  # bounded: the limit plus one parameter
        assert size - specs[bucket[-1]].nbytes <= bucket_bytes  # closed by its last parameter


def test_pack_then_unpack_round_trips_bytes_exactly():
    named = _named_tensors()
    specs = _specs(named)
    for bucket in plan_buckets(specs, 100):
        buffer = torch.empty(sum(specs[i].nbytes for i in bucket), dtype=torch.uint8)
        assert pack_bucket(buffer, [named[i][1] for i in bucket]) == buffer.numel()
        for (name, got), i in zip(unpack_bucket(buffer, [specs[i] for i in bucket]), bucket, strict=True):
            assert name == named[i][0]
            torch.testing.assert_close(got, named[i][1], rtol=0, atol=0)


def test_pack_on_several_threads_in_pieces_writes_the_same_bytes(monkeypatch):
    import refit._buckets as buckets

    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen) for n in (1000, 7, 4096, 333, 2500)]
    serial = torch.empty(sum(t.numel() * 4 for t in tensors), dtype=torch.uint8)
    monkeypatch.setattr(buckets, "_pack_threads", lambda: 1)
    pack_bucket(serial, tensors)
    monkeypatch.setattr(buckets, "_pack_threads", lambda: 3)
    monkeypatch.setattr(buckets, "_PACK_PIECE_BYTES", 1000)  # tensors split across pieces and threads
    threaded = torch.zeros_like(serial)
    assert pack_bucket(threaded, tensors) == serial.numel()
    assert torch.equal(threaded, serial)
    assert torch.equal(threaded[:4000].view(torch.float32), tensors[0])


def test_pack_threads_leave_two_cores_to_the_wire(monkeypatch):
    import refit._buckets as buckets

    for cores, threads in ((1, 1), (2, 1), (4, 1), (6, 2), (16, 4), (64, 4)):
        monkeypatch.setattr(buckets.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert buckets._pack_threads() == threads


def test_pack_reads_non_contiguous_tensors_by_value():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buffer = torch.empty(48, dtype=torch.uint8)
    pack_bucket(buffer, [base.t()])
    ((_, got),) = unpack_bucket(buffer, [ParamSpec("t", torch.float32, (4, 3))])
    torch.testing.assert_close(got, base.t().contiguous(), rtol=0, atol=0)


def test_packed_buckets_alternate_two_buffers_and_hold_every_byte_in_order():
    named = _named_tensors()
    specs = _specs(named)
    plan = plan_buckets(specs, 100)
    buffers = [torch.empty(max(bucket_nbytes(specs, b) for b in plan), dtype=torch.uint8) for _ in range(2)]
    sent = []
    for index, payload in packed_buckets(iter(named), specs, plan, buffers):
        assert payload.data_ptr() == buffers[index % 2].data_ptr()
        sent.append(payload.clone())
    expected = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named])
    assert torch.equal(torch.cat(sent), expected)


def test_packed_buckets_refuse_a_stream_that_disagrees_with_its_specs():
    named = _named_tensors()
    specs = _specs(named)
    swapped = [named[1], named[0], *named[2:]]
    buffers = [torch.empty(4096, dtype=torch.uint8)] * 2
    with pytest.raises(ValueError, match="disagrees with its specs"):
        list(packed_buckets(iter(swapped), specs, plan_buckets(specs, 100), buffers))


def test_plan_refuses_a_non_positive_bucket_size():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([ParamSpec("a", torch.float32, (2,))], 0)


def test_full_params_specs_need_no_gather_and_match_iteration():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    params = refit.full_params(model, dtype=torch.bfloat16)
    got = list(params)
    assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == [tuple(s) for s in params.specs]
    assert all(s.dtype == torch.bfloat16 for s in params.specs)


@pytest.mark.slow
def test_buckets_are_byte_identical_to_vllm_packed_chunks():
    """vLLM's NCCL consumer cuts chunks with `pack_tensors`' rule: same boundaries, same bytes."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    named = _named_tensors()
    specs = _specs(named)
    flat = lambda item: item[1].reshape(-1)  # noqa: E731 (vLLM 0.26 cannot view a 0-dim tensor as bytes)
    for bucket_bytes in (512, 600, 1000):  # no tensor above the limit (vLLM warns then)
        stream = iter(named)
        for bucket in plan_buckets(specs, bucket_bytes):
            chunk = pack_tensors(stream, flat, bucket_bytes)
            assert chunk.names == [specs[i].name for i in bucket]
            ours = torch.empty(chunk.packed_tensor.numel(), dtype=torch.uint8)
            pack_bucket(ours, [named[i][1] for i in bucket])
            assert torch.equal(ours, chunk.packed_tensor)
        assert pack_tensors(stream, flat, bucket_bytes) is None


def test_engines_on_the_trainers_gpu_take_fewer_larger_buckets():
    """refit_ipc pays one `/update_weights` call per bucket: a 1.7B model's 3.4 GB goes in a few buckets
    there, in 256 MiB ones over the wire backends."""
    from refit._refit import default_bucket_bytes

    specs = [ParamSpec(f"layer{i}.weight", torch.bfloat16, (2048, 6144)) for i in range(140)]  # 3.5 GB
    ipc, gloo = (
        refit.Engine("http://127.0.0.1:1", backend=refit.IPC_BACKEND),
        refit.Engine("http://127.0.0.1:1"),
    )
    over_ipc = plan_buckets(specs, default_bucket_bytes([ipc]))
    assert len(over_ipc) <= 4
    assert len(plan_buckets(specs, default_bucket_bytes([gloo]))) >= 13
    assert default_bucket_bytes([ipc, gloo]) == default_bucket_bytes([gloo])  # a mix: the smaller
