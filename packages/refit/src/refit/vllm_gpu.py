"""Engine side of refit on GPU: vLLM's own NCCL and CUDA IPC weight-transfer engines, every bucket checked.

`refit.vllm_worker` registers them as `refit_nccl` and `refit_ipc`; vLLM imports this module when it
creates an engine with one of them. Each receives and loads exactly as vLLM 0.26's engine of its kind
does, layerwise reload included; besides, it takes each packed bucket's `refit._transport.device_checksum`
on the device once the bucket has arrived, before it is loaded, and compares it with the trainer's
(`verify_checksums`; `refit_last_verify` answers the record):
- refit_ipc: the trainer's checksum comes in the bucket's own `/update_weights` call, so a bucket that
  fails is never loaded. The bucket is opened from its CUDA IPC handle and unpacked here, as vLLM's
  `packed_ipc_consumer` does it: that function opens, unpacks and copies in one call and hands back no
  packed bytes to check, and opening one handle twice would release its IPC reference twice. Where no
  layer of the model processes its weights after loading on this GPU (`loads_in_place`: unquantized
  dense models), the bucket's tensors are loaded straight into the served ones, without vLLM's layerwise
  reload (each layer put back on the meta device, its loads buffered, then materialised, loaded,
  processed and copied into the served tensors: on one H100, 0.05-0.11 s of a 135M model's 0.1 s refit).
- refit_nccl: vLLM's packed receiver (`packed_nccl_broadcast_consumer`) runs unchanged, over a wrapper of
  the NCCL group that takes each bucket's checksum right behind its broadcast, on the receiver's stream.
  vLLM's receiver takes bare buckets (no header), so the trainer's checksums follow the last bucket as
  one more broadcast: every bucket has been loaded when the engine compares.
A mismatch raises `VerifyError`, and any error of a transfer rolls back as refit_gloo does
(`roll_back_reload`: layers still waiting for weights get their old tensors back; loaded in place, the
buckets before the failed one stay loaded); vLLM's worker then ends the update, and the trainer retries
the engine once with a full transfer, the engine still paused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention, MLAAttention, MMEncoderAttention
from vllm.model_executor.layers.hpc import HpcModule
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionImplBase

from refit._transport import device_checksum, verify_checksums
from refit.vllm_worker import roll_back_reload

# under vLLM's own logger: its handler and level (INFO) put the lines in the engine's log
logger = init_logger(f"vllm.{__name__}")

__all__ = ["ChecksummedGroup", "IpcUpdateInfo", "VerifiedIpcEngine", "VerifiedNcclEngine", "loads_in_place"]


_NOTHING_TO_PROCESS_ON_CUDA = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)  # quant methods


def loads_in_place(model: torch.nn.Module, model_config) -> bool:
    """Whether `model.load_weights` alone serves a refit's weights on this GPU: vLLM's loaders copy each
    tensor into the served one (its shard of a fused projection included), and what its weight loading
    does afterwards (`process_weights_after_loading`) does nothing here for every layer of `model`. So:
    CUDA, no quantization, and only the layers whose processing on CUDA is empty: unquantized linear and
    embedding layers, and attention whose backend processes nothing (not MLA's absorbed projections, a
    multimodal encoder's, FlashInfer's sinks, MoE experts laid out for their kernels, fused HPC modules)."""
    if not current_platform.is_cuda() or model_config.quantization is not None:
        return False
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, _NOTHING_TO_PROCESS_ON_CUDA):
            return False
        if isinstance(module, MLAAttention | MMEncoderAttention | HpcModule):
            return False
        if isinstance(module, Attention):
            processing = type(module.impl).process_weights_after_loading
            if processing is not AttentionImplBase.process_weights_after_loading:
                return False
    return True


def _fresh_record() -> dict:
    return {"checked": 0, "failed": None, "error": "", "checksums": []}


class ChecksummedGroup:
    """The engine's NCCL communicator as vLLM's packed receiver calls it: each `broadcast` also queues
    the device checksum of the bucket it received, on the same stream, so it reads the received bytes."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.checksums: list[torch.Tensor] = []

    def broadcast(self, tensor_N: torch.Tensor, src: int) -> None:
        self.comm.broadcast(tensor_N, src=src)
        self.checksums.append(device_checksum(tensor_N))


class VerifiedNcclEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL engine, each bucket's checksum compared with the trainer's (module docstring)."""

    # A wrapper of vLLM's communicator stands in for it: vLLM's packed receiver calls only `broadcast`.
    model_update_group: ChecksummedGroup | None

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.last_verify = _fresh_record()

    def init_transfer_engine(self, init_info) -> None:
        super().init_transfer_engine(init_info)
        self.model_update_group = ChecksummedGroup(self.model_update_group)

    def receive_weights(self, update_info) -> None:
        group = self.model_update_group
        self.last_verify = _fresh_record()  # one call takes the whole transfer
        try:
            if group is None:
                raise RuntimeError("refit_nccl: /init_weight_transfer_engine was never called")
            if not update_info.packed:
                raise ValueError("refit_nccl takes packed buckets (refit.update_weights sends them)")
            group.checksums = []
            super().receive_weights(update_info)  # vLLM's receiver, through `group`
            torch.accelerator.synchronize()  # every bucket in and its checksum taken, on vLLM's streams
            expected_K = torch.empty(len(group.checksums), dtype=torch.int64, device=self.device)
            group.comm.broadcast(expected_K, src=0)
            verify_checksums(self.last_verify, [int(check) for check in group.checksums], expected_K.tolist())
        except BaseException:
            roll_back_reload(self.model, self.model_config)
            raise


@dataclass
class IpcUpdateInfo(IPCWeightTransferUpdateInfo):
    checksum: int | None = None  # the trainer's device_checksum of the packed bucket


class VerifiedIpcEngine(IPCWeightTransferEngine):
    """vLLM's CUDA IPC engine, each bucket checked against the trainer's checksum before it is loaded, and
    loaded in place where the model allows it (`loads_in_place`; the log says which when that changes).
    Where a refit's time goes on the engine (`last_timings`, seconds, summed over its buckets): opening
    the handles, the checksum (which waits for the bucket), loading (in place, the copies; else layerwise
    reload's buffering and, as a layer completes, its copies) and finishing (the layers' last
    processing; nothing in place); a log line a refit."""

    update_info_cls = IpcUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.last_verify = _fresh_record()
        self.last_timings = _zeroed_timings()
        self.in_place: bool | None = None
        self._choose_load()

    def _choose_load(self) -> None:
        """In place or by vLLM's layerwise reload, for the model an update goes to (`loads_in_place`);
        the engine's log says which, whenever that changes."""
        in_place = loads_in_place(self.model, self.model_config)
        if in_place != self.in_place:
            logger.info("refit_ipc: %s", "loads in place" if in_place else "loads by layerwise reload")
        self.in_place = in_place

    def set_weight_update_target(self, model, model_config) -> None:  # a speculative drafter's update
        super().set_weight_update_target(model, model_config)
        self._choose_load()

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        self._choose_load()

    def start_weight_update(self) -> None:
        began = time.perf_counter()
        if not self.in_place:
            super().start_weight_update()
        self.last_verify = _fresh_record()  # the transfer's buckets come in calls of their own
        self.last_timings = _zeroed_timings()
        self.last_timings["start_s"] = time.perf_counter() - began

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        assert isinstance(update_info, IpcUpdateInfo)  # parsed as update_info_cls
        timings, began = self.last_timings, time.perf_counter()
        try:
            if not update_info.packed or update_info.checksum is None:
                raise ValueError("refit_ipc takes packed buckets with their checksum (refit.update_weights)")
            handles, sizes = update_info.ipc_handles, update_info.tensor_sizes
            assert isinstance(handles, dict) and sizes is not None  # packed: vLLM's __post_init__ checks
            packed_N = _opened(handles, self.device.index)[: sum(sizes)]
            opened = time.perf_counter()
            index = len(self.last_verify["checksums"])  # one bucket per call, in order
            got = int(device_checksum(packed_N))
            verify_checksums(self.last_verify, [got], [update_info.checksum], first=index)
            checked = time.perf_counter()
            dtypes = [getattr(torch, name) for name in update_info.dtype_names]
            tensors = unpack_tensor(packed_N, update_info.names, update_info.shapes, dtypes, sizes)
            # Layerwise reload holds on to loaded tensors past this call, and the trainer packs its next
            # bucket into the same buffer: copies, as vLLM's packed_ipc_consumer makes them. In place,
            # each is copied into its served tensor before the call returns (vLLM synchronizes).
            self.model.load_weights(tensors if self.in_place else [(n, t.clone()) for n, t in tensors])
            timings["open_s"] += opened - began
            timings["verify_s"] += checked - opened
            timings["load_s"] += time.perf_counter() - checked
        except BaseException:
            if not self.in_place:
                roll_back_reload(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:
        began = time.perf_counter()
        if not self.in_place:
            super().finish_weight_update()
        self.last_timings["finish_s"] = time.perf_counter() - began
        logger.info("refit_ipc: %s", ", ".join(f"{k} {v:.4f}" for k, v in self.last_timings.items()))


def _zeroed_timings() -> dict[str, float]:
    """A refit's engine-side seconds before it starts, in the order the phases run (and are logged)."""
    return dict.fromkeys(("start_s", "open_s", "verify_s", "load_s", "finish_s"), 0.0)


def _opened(handles: dict[str, tuple], device_index: int) -> torch.Tensor:
    """The trainer's packed buffer, opened from its CUDA IPC handle on this worker's GPU (the handle is
    keyed by GPU UUID; its argument 6 is the device index, the receiver's own, as vLLM sets it)."""
    gpu = str(torch.cuda.get_device_properties(device_index).uuid)
    if gpu not in handles:
        raise ValueError(f"refit_ipc: no IPC handle for this GPU ({gpu}); the trainer sent {list(handles)}")
    args = list(handles[gpu])
    args[6] = device_index
    return rebuild_cuda_tensor(*args)
