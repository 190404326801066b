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
        self.given: list[torch.Tensor] = []  # the tensors load_weights was handed, as handed

    def load_weights(self, weights) -> None:
        weights = list(weights)
        self.given += [tensor for _, tensor in weights]
        self.loaded.update((name, tensor.clone()) for name, tensor in weights)


def _engine(cls, monkeypatch, in_place: bool = False):
    """An engine of `cls` as vLLM's worker holds it, minus the vLLM config (no GPU model to build);
    an IPC engine loading in place or by vLLM's layerwise reload (`refit.vllm_gpu.loads_in_place`)."""
    engine = cls.__new__(cls)
    engine.device, engine.model, engine.model_config = torch.device("cpu"), _Model(), None
    engine.in_place = in_place
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


@pytest.mark.parametrize("in_place", [False, True], ids=["layerwise", "in_place"])
def test_refits_ipc_engine_checks_each_bucket_before_loading_it(monkeypatch, in_place):
    """Loaded by layerwise reload, which keeps the tensors past the call, a bucket's tensors are copies
    (the trainer packs its next bucket into the same buffer) and a failure rolls the reload back; loaded
    in place, they are the bucket's own bytes, copied into the served tensors by the call, and a failure
    leaves nothing to roll back."""
    from refit.vllm_gpu import VerifiedIpcEngine

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # as refit.engine_env("refit_ipc")
    plan, packed, tensors = _buckets(2)
    opened = {}  # the bucket a handle opens to (CUDA IPC does not run on CPU)
    monkeypatch.setattr(refit.vllm_gpu, "_opened", lambda handles, device_index: opened["bucket"])
    channel = IpcChannel(post=lambda info: None)
    channel.begin(SPECS, plan)
    engine = _engine(VerifiedIpcEngine, monkeypatch, in_place=in_place)
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
    bucket_bytes = packed[0].untyped_storage().data_ptr()
    views = [tensor.untyped_storage().data_ptr() == bucket_bytes for tensor in engine.model.given]
    assert views == [in_place] * len(first)
    assert engine.last_verify["checked"] == 1 and engine.last_verify["failed"] == 1
    assert engine.rolled_back == (0 if in_place else 1)
    # the loaded bucket's checksum and load were timed
    assert engine.last_timings["load_s"] > 0 and engine.last_timings["verify_s"] > 0
    channel.pool.shutdown()


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("in_place", [False, True], ids=["layerwise", "in_place"])
def test_an_ipc_refit_logs_its_engine_side_phases_once_in_the_order_they_ran(monkeypatch, in_place):
    """... and starts and finishes vLLM's layerwise reload, unless it loads in place."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from refit.vllm_gpu import VerifiedIpcEngine

    reloads: list[str] = []
    for step in ("start_weight_update", "finish_weight_update"):  # vLLM's own need a GPU model
        monkeypatch.setattr(IPCWeightTransferEngine, step, lambda self, step=step: reloads.append(step))
    engine, kept = _engine(VerifiedIpcEngine, monkeypatch, in_place=in_place), _Kept()
    refit.vllm_gpu.logger.addHandler(kept)
    try:
        engine.start_weight_update()
        engine.finish_weight_update()
    finally:
        refit.vllm_gpu.logger.removeHandler(kept)
    assert len(kept.lines) == 1 and kept.lines[0].startswith("refit_ipc: ")
    phases = [part.split()[0] for part in kept.lines[0].removeprefix("refit_ipc: ").split(", ")]
    assert phases == ["start_s", "open_s", "verify_s", "load_s", "finish_s"]
    assert reloads == ([] if in_place else ["start_weight_update", "finish_weight_update"])


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


@pytest.mark.parametrize("in_place", [False, True], ids=["layerwise", "in_place"])
def test_a_trainer_that_fails_mid_transfer_ends_the_ipc_engines_update(monkeypatch, in_place):
    """An IPC engine's update stays open between bucket calls: the trainer's abort must end it (vLLM ends
    an update whose call failed), or the engine keeps half-reloaded layers and refuses every later start.
    Loaded in place, no layer waits: nothing to roll back (the engine stays paused until a full refit)."""
    from refit.vllm_gpu import VerifiedIpcEngine

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    plan, packed, _ = _buckets(3)
    monkeypatch.setattr(refit.vllm_gpu, "_opened", lambda handles, device_index: packed[0])
    engine = _engine(VerifiedIpcEngine, monkeypatch, in_place=in_place)
    channel = IpcChannel(post=lambda info: engine.receive_weights(engine.parse_update_info(info)))
    channel.begin(SPECS, plan)
    channel.post(channel.update_info(0, {"GPU-0": ("args",)}, int(device_checksum(packed[0]))))
    assert engine.last_verify["checked"] == 1 and engine.rolled_back == 0
    with pytest.raises(ValueError, match="refit_ipc"):  # the engine refuses the end of the stream
        channel.abort([bucket_nbytes(SPECS, bucket) for bucket in plan[1:]])
    assert engine.rolled_back == (0 if in_place else 1)
    channel.pool.shutdown()


def _layer(cls: type[torch.nn.Module], **attributes) -> torch.nn.Module:
    """A vLLM layer of `cls` as a loaded model holds it, built without its constructor (which needs the
    engine's parallel state) and holding only what `loads_in_place` reads."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    for name, value in attributes.items():
        setattr(layer, name, value)
    return layer


def test_only_a_model_whose_layers_process_nothing_after_loading_on_cuda_loads_in_place(monkeypatch):
    """`loads_in_place`: on CUDA (stood in: this build's platform is the CPU) an unquantized dense model,
    whose linear and embedding layers and attention backend process nothing after loading; a layer that
    does (another quant method: MoE experts laid out for their kernel; MLA's absorbed projections; an
    attention backend with processing of its own, as FlashInfer's sinks), a quantized model, or the CPU
    (which repacks weights for oneDNN) keep vLLM's layerwise reload."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention import Attention, MLAAttention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from refit.vllm_gpu import loads_in_place

    class _Processing(QuantizeMethodBase):  # a method whose processing does something
        def create_weights(self, *args, **kwargs) -> None: ...

        def apply(self, *args, **kwargs) -> None: ...

        def process_weights_after_loading(self, layer) -> None: ...

    class _Sinks(FlashAttentionImpl):  # a backend that processes, as FlashInfer's does its sinks
        def process_weights_after_loading(self, act_dtype) -> None: ...

    def model(*extra: torch.nn.Module) -> torch.nn.Module:
        dense = [
            _layer(torch.nn.Module, quant_method=UnquantizedEmbeddingMethod()),
            _layer(torch.nn.Module, quant_method=UnquantizedLinearMethod()),
            _layer(Attention, impl=FlashAttentionImpl.__new__(FlashAttentionImpl)),
            torch.nn.LayerNorm(4),  # no quant method: loaded as is
        ]
        return torch.nn.Sequential(*dense, *extra)

    unquantized, quantized = SimpleNamespace(quantization=None), SimpleNamespace(quantization="fp8")
    assert not loads_in_place(model(), unquantized)  # the CPU
    monkeypatch.setattr(refit.vllm_gpu.current_platform, "is_cuda", lambda: True)
    assert loads_in_place(model(), unquantized)
    assert not loads_in_place(model(), quantized)
    assert not loads_in_place(model(_layer(torch.nn.Module, quant_method=_Processing())), unquantized)
    assert not loads_in_place(model(_layer(MLAAttention)), unquantized)
    assert not loads_in_place(model(_layer(Attention, impl=_Sinks.__new__(_Sinks))), unquantized)
