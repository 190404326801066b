"""refit's GPU backends (`refit_nccl`, `refit_ipc`: GPU only to run) on the CPU build, which ships the same
Python: what the trainer sends fits what the engines parse, each engine checks every bucket against the
trainer's device checksum and rolls back on a mismatch, and the trainer retries such an engine once.

Stand-ins, each only where the real part needs a GPU: a fake communicator carries the NCCL broadcasts
from the trainer's channel to the engine (NCCL does not run on CPU), and vLLM's packed NCCL receiver
(which needs CUDA streams) is replaced by its loop's essentials: one broadcast per planned bucket into a
fresh buffer, then a load. An IPC bucket is handed over as the CPU tensor a CUDA IPC handle would open
to. A fake model records what is loaded. tests/refit/test_refit_ipc_gpu.py runs the real engine on a GPU.
"""

from __future__ import annotations

import logging
from collections import deque

import pytest
import torch

import refit
from refit._buckets import ParamSpec, bucket_nbytes, pack_bucket, plan_buckets, unpack_bucket
from refit._run import Run
from refit._transport import IpcChannel, NcclChannel, VerifyError, device_checksum

# Importing vLLM's model loader (refit.vllm_worker does) compiles a torch function that warns (not ours).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
SPECS = [
    ParamSpec("a.weight", torch.bfloat16, (64, 33)),
    ParamSpec("a.bias", torch.float32, (7,)),
    ParamSpec("b.weight", torch.bfloat16, (48, 40)),
    ParamSpec("c.weight", torch.float32, (30, 30)),
]
BUCKET_BYTES = 4000  # three buckets


def _buckets(seed: int) -> tuple[list[range], list[torch.Tensor], dict[str, torch.Tensor]]:
    """The plan, each bucket packed, and the tensors packed into them."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {s.name: torch.randn(s.shape, generator=gen).to(s.dtype) for s in SPECS}
    plan = plan_buckets(SPECS, BUCKET_BYTES)
    packed = []
    for bucket in plan:
        buffer_N = torch.empty(bucket_nbytes(SPECS, bucket), dtype=torch.uint8)
        pack_bucket(buffer_N, [tensors[SPECS[i].name] for i in bucket])
        packed.append(buffer_N)
    return plan, packed, tensors


class _Model:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        self.loaded.update((name, tensor.clone()) for name, tensor in weights)


def _engine(cls, monkeypatch):
    """An engine of `cls` as vLLM's worker holds it, minus the vLLM config (no GPU model to build)."""
    engine = cls.__new__(cls)
    engine.device, engine.model, engine.model_config = torch.device("cpu"), _Model(), None
    engine.last_verify = {"checked": 0, "failed": None, "error": "", "checksums": []}
    engine.last_timings = refit.vllm_gpu._zeroed_timings()  # as after a start
    engine.rolled_back = 0

    def roll_back(model, model_config) -> None:
        engine.rolled_back += 1

    monkeypatch.setattr(refit.vllm_gpu, "roll_back_reload", roll_back)
    return engine


class _FakeNccl:
    """One end of a broadcast group (rank 0 sends, rank 1 receives) over a shared queue."""

    def __init__(self, wire: deque, rank: int) -> None:
        self.wire, self.rank = wire, rank

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.rank == src:
            self.wire.append(tensor.clone())
        else:
            tensor.copy_(self.wire.popleft())


def test_nccl_init_and_update_payloads_are_what_refits_nccl_engine_takes(monkeypatch):
    from refit.vllm_gpu import VerifiedNcclEngine

    engine = refit.Engine("http://127.0.0.1:1", backend=refit.NCCL_BACKEND)
    sent = {}
    monkeypatch.setattr(engine, "world_size", lambda: 2)
    monkeypatch.setattr(engine, "transfer_backend", lambda: [refit.NCCL_BACKEND] * 2)
    monkeypatch.setattr(
        refit._engine, "_rendezvous", lambda _opener, init: sent.update(init.keywords["json"])
    )
    engine.connect()
    init = VerifiedNcclEngine.init_info_cls(**sent["init_info"])
    assert (init.rank_offset, init.world_size) == (1, 3)

    specs = [ParamSpec("w", torch.bfloat16, (4, 2)), ParamSpec("b", torch.float32, (4,))]
    update = VerifiedNcclEngine.update_info_cls(**engine.update_info(specs, 2 << 20))
    assert update.packed and update.packed_buffer_size_bytes == 2 << 20
    assert (update.names, update.dtype_names, update.shapes) == (
        ["w", "b"],
        ["bfloat16", "float32"],
        [[4, 2], [4]],
    )
    engine.close()


def test_an_engine_started_with_another_backend_is_refused_before_anything_is_opened(monkeypatch):
    engine = refit.Engine("http://127.0.0.1:1", backend=refit.NCCL_BACKEND)
    monkeypatch.setattr(engine, "transfer_backend", lambda: ["nccl"])  # vLLM's own: bare buckets
    with pytest.raises(ValueError, match=r"backend \['nccl'\], refit sends 'refit_nccl'.*engine_flags"):
        engine.connect()
    assert engine.channel is None
    engine.close()


def _nccl_receive(engine_self, update_info) -> None:
    """vLLM's packed NCCL receiver, reduced to its loop: each planned bucket broadcast into a fresh
    buffer through the engine's group, then loaded."""
    specs = [
        ParamSpec.from_json(item)
        for item in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)
    ]
    for bucket in plan_buckets(specs, update_info.packed_buffer_size_bytes):
        buffer_N = torch.empty(bucket_nbytes(specs, bucket), dtype=torch.uint8)
        engine_self.model_update_group.broadcast(buffer_N, src=0)
        engine_self.model.load_weights(unpack_bucket(buffer_N, [specs[i] for i in bucket]))


def test_refits_nccl_engine_compares_every_bucket_after_the_stream_and_rolls_back_on_a_mismatch(monkeypatch):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from refit.vllm_gpu import ChecksummedGroup, VerifiedNcclEngine

    monkeypatch.setattr(NCCLWeightTransferEngine, "receive_weights", _nccl_receive)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    wire: deque = deque()
    monkeypatch.setattr(
        "vllm.distributed.weight_transfer.nccl_common.trainer_init", lambda info: _FakeNccl(wire, 0)
    )
    channel = NcclChannel("127.0.0.1", 0, 2)
    engine = _engine(VerifiedNcclEngine, monkeypatch)
    engine.model_update_group = ChecksummedGroup(_FakeNccl(wire, 1))
    handle = refit.Engine("http://127.0.0.1:1", backend=refit.NCCL_BACKEND)
    update = VerifiedNcclEngine.update_info_cls(**handle.update_info(SPECS, BUCKET_BYTES))
    for seed, corrupt in ((0, None), (1, 1)):
        plan, packed, tensors = _buckets(seed)
        checks = [device_checksum(p) for p in packed]
        channel.begin(SPECS, plan)
        for index, payload_N in enumerate(packed):
            channel.send(index, payload_N, checks[index])
        assert len(wire) == len(plan) + 1 and torch.equal(wire[-1], torch.stack(checks))  # sums last
        if corrupt is not None:
            wire[corrupt][len(wire[corrupt]) // 2] ^= 0x40  # one byte on the way, after the checksum
            with pytest.raises(VerifyError, match=f"bucket {corrupt} has device checksum"):
                engine.receive_weights(update)
            assert engine.last_verify["failed"] == corrupt and engine.rolled_back == 1
        else:
            engine.receive_weights(update)
            assert engine.last_verify["failed"] is None and engine.rolled_back == 0
            assert all(torch.equal(engine.model.loaded[n], t) for n, t in tensors.items())
        assert not wire  # the engine took the whole stream, checksums included
        assert engine.last_verify["checksums"] == [int(c) for c in device_checksum_of(packed, corrupt)]
    handle.close()


def device_checksum_of(packed: list[torch.Tensor], corrupt: int | None) -> list[torch.Tensor]:
    """What the engine should have taken: the packed buckets' checksums, bucket `corrupt` changed."""
    sums = []
    for index, payload_N in enumerate(packed):
        if index == corrupt:
            payload_N = payload_N.clone()
            payload_N[len(payload_N) // 2] ^= 0x40
        sums.append(device_checksum(payload_N))
    return sums


def test_refits_ipc_engine_checks_each_bucket_before_loading_it(monkeypatch):
    from refit.vllm_gpu import VerifiedIpcEngine

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # as refit.engine_env("refit_ipc")
    plan, packed, tensors = _buckets(2)
    opened = {}  # the bucket a handle opens to (CUDA IPC does not run on CPU)
    monkeypatch.setattr(refit.vllm_gpu, "_opened", lambda handles, device_index: opened["bucket"])
    channel = IpcChannel(post=lambda info: None)
    channel.begin(SPECS, plan)
    engine = _engine(VerifiedIpcEngine, monkeypatch)
    for index, payload_N in enumerate(packed):
        check = int(device_checksum(payload_N)) + (index == 1)  # bucket 1's checksum is not its bytes'
        update = engine.parse_update_info(channel.update_info(index, {"GPU-0": ("args",)}, check))
        assert update.checksum == check and update.ipc_handles == {"GPU-0": ("args",)}
        assert update.names == [SPECS[i].name for i in plan[index]]
        opened["bucket"] = payload_N
        if index == 1:
            with pytest.raises(VerifyError, match="bucket 1 has device checksum"):
                engine.receive_weights(update)
            break
        engine.receive_weights(update)
    first = {SPECS[i].name for i in plan[0]}
    assert set(engine.model.loaded) == first  # bucket 1 was never loaded
    assert all(torch.equal(engine.model.loaded[name], tensors[name]) for name in first)
    assert engine.last_verify["checked"] == 1 and engine.last_verify["failed"] == 1
    assert engine.rolled_back == 1
    # the loaded bucket's checksum and load were timed
    assert engine.last_timings["load_s"] > 0 and engine.last_timings["verify_s"] > 0
    channel.pool.shutdown()


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_ipc_refit_logs_its_engine_side_phases_once_in_the_order_they_ran(monkeypatch):
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from refit.vllm_gpu import VerifiedIpcEngine

    for step in ("start_weight_update", "finish_weight_update"):  # vLLM's own need a GPU model
        monkeypatch.setattr(IPCWeightTransferEngine, step, lambda self: None)
    engine, kept = _engine(VerifiedIpcEngine, monkeypatch), _Kept()
    refit.vllm_gpu.logger.addHandler(kept)
    try:
        engine.start_weight_update()
        engine.finish_weight_update()
    finally:
        refit.vllm_gpu.logger.removeHandler(kept)
    assert len(kept.lines) == 1 and kept.lines[0].startswith("refit_ipc: ")
    phases = [part.split()[0] for part in kept.lines[0].removeprefix("refit_ipc: ").split(", ")]
    assert phases == ["start_s", "open_s", "verify_s", "load_s", "finish_s"]


class _Handle(refit.Engine):
    """An engine handle whose check report is given, not asked over HTTP."""

    def __init__(self, url: str, backend: str, failed: int | None) -> None:
        super().__init__(url, backend=backend)
        self.failed = failed

    def verify_report(self) -> list[dict]:
        return [{"checked": 0, "failed": self.failed, "error": ""}]


def test_an_engine_of_any_backend_whose_check_failed_is_retried_once_then_fails_in_verify():
    ipc = _Handle("http://ipc", refit.IPC_BACKEND, failed=1)
    nccl = _Handle("http://nccl", refit.NCCL_BACKEND, failed=3)
    gloo = _Handle("http://gloo", refit.GLOO_BACKEND, failed=0)
    died = _Handle("http://died", refit.NCCL_BACKEND, failed=None)  # failed for another reason
    fine = _Handle("http://fine", refit.IPC_BACKEND, failed=None)
    run = Run([ipc, nccl, gloo, died, fine])
    for engine in (ipc, nccl, gloo, died):
        run.fail(engine, "transfer", RuntimeError("update_weights answered 500"))
    retry = run.verify_failures()
    assert retry == [ipc, nccl, gloo]
    assert run.live == [fine, ipc, nccl, gloo] and list(run.failures) == [died]
    for engine in (ipc, nccl):  # their retries fail the check again; gloo's passes
        run.fail(engine, "transfer", RuntimeError("update_weights answered 500"))
    assert run.verify_failures(retry=False) == [ipc, nccl]
    assert {engine.url: phase for engine, (phase, _) in run.failures.items()} == {
        "http://died": "transfer",
        "http://ipc": "verify",
        "http://nccl": "verify",
    }
    assert run.live == [fine, gloo]
    for engine in (ipc, nccl, gloo, died, fine):
        engine.close()


def test_a_trainer_that_fails_mid_transfer_ends_the_ipc_engines_update_which_rolls_back(monkeypatch):
    """An IPC engine's update stays open between bucket calls: the trainer's abort must end it (vLLM ends
    an update whose call failed), or the engine keeps half-reloaded layers and refuses every later start."""
    from refit.vllm_gpu import VerifiedIpcEngine

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    plan, packed, _ = _buckets(3)
    monkeypatch.setattr(refit.vllm_gpu, "_opened", lambda handles, device_index: packed[0])
    engine = _engine(VerifiedIpcEngine, monkeypatch)
    channel = IpcChannel(post=lambda info: engine.receive_weights(engine.parse_update_info(info)))
    channel.begin(SPECS, plan)
    channel.post(channel.update_info(0, {"GPU-0": ("args",)}, int(device_checksum(packed[0]))))
    assert engine.last_verify["checked"] == 1 and engine.rolled_back == 0
    with pytest.raises(ValueError, match="refit_ipc"):  # the engine refuses the end of the stream
        channel.abort([bucket_nbytes(SPECS, bucket) for bucket in plan[1:]])
    assert engine.rolled_back == 1
    channel.pool.shutdown()
