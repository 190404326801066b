"""Engine side of refit: the `refit_gloo` weight-transfer backend (CPU), loaded into vLLM's workers, and
the registration of all of refit's backends.

Give it to a vLLM server with
`--worker-extension-cls refit.vllm_worker.RefitWorkerExtension --weight-transfer-config
'{"backend": "refit_gloo"}'` (or `refit_nccl`, `refit_ipc`: `refit.engine_flags`). Importing this module
(vLLM does, to resolve the extension class) registers `GlooWeightTransferEngine` with
`WeightTransferEngineFactory`, and the GPU backends of `refit.vllm_gpu` by name (imported when an engine
is created with one); vLLM then drives them through its own lifecycle (`/start_weight_update`,
`/update_weights`, `/finish_weight_update`).

Why a backend of our own: vLLM's built-in backends are CUDA-only. This one receives the same buckets
the sender packs for vLLM's NCCL engine (`refit._buckets`), over a gloo group, each bucket preceded by
a header (its index, or -1 = the trainer aborted, and its CRC-32), into receive buffers kept between
refits (one copy of the weights in host memory), every receive posted before the first load; or a delta
stream (`refit._delta`) patched into those kept buffers. Every bucket's CRC is checked before it is
loaded (`refit_last_verify` reports the last transfer's check). It reloads layer by layer
(`initialize_layerwise_reload` → `load_weights` → `finalize_layerwise_reload`), because on the CPU
build a plain `load_weights` fails half way (weights are repacked for oneDNN).

What it refuses to leave behind: a model with layers on the meta device. If receiving, verifying or
loading fails after `start_weight_update`, every layer not yet reloaded gets its old tensors back before the
error propagates, so the engine can serve again (with weights that may mix old and new layers: the
trainer keeps it paused until a full refit succeeds). Tied embeddings: layerwise reload processes
only `embed_tokens`, so the CPU build's packed copy of a tied `lm_head` is rebuilt after every reload.

A server started with `--enable-lora` and one adapter (`--lora-modules NAME=DIR`) takes LoRA refits
only: the base weights never change, so no layer is reloaded. The buckets hold the adapter's tensors
(PEFT names); once all arrived and verified, vLLM's own loader builds them into a `LoRAModel` under the
served adapter's id (checking rank and target modules as it does for a directory), and
`finish_weight_update` swaps it in place of the served one, as vLLM's `load_inplace` does: one adapter in
memory, every request naming it samples from the new one from the next step on. A failed transfer
leaves the served adapter untouched.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.logger import init_logger
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from refit._buckets import ParamSpec, bucket_nbytes, plan_buckets, unpack_bucket
from refit._delta import DeltaIncoming, bucket_unit
from refit._engine import GLOO_BACKEND, IPC_BACKEND, NCCL_BACKEND
from refit._names import in_trainer_names
from refit._transport import Incoming, ReceiveBuffers, VerifyError, join_gloo_group

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = ["GlooWeightTransferEngine", "RefitWorkerExtension", "roll_back_reload"]

logger = init_logger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int
    token: str | None = None  # names the bytes the kept buffers hold once this refit is whole
    delta_base: str | None = None  # a delta stream against the bytes of that token (refit._delta)
    lora: dict | None = None  # the PEFT config of the LoRA adapter the buckets hold


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives refit buckets over gloo and reloads the model layer by layer (see module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self.last_timings: dict[str, float] = {}
        self.last_verify: dict = {"checked": 0, "failed": None, "error": ""}
        self.buffers = ReceiveBuffers()  # kept between refits
        self.pending_token: str | None = None  # the buffers' token once finish_weight_update succeeds
        self.adapters = getattr(model, "lora_manager", None)  # vLLM's LoRAModelManager under --enable-lora
        self.pending_adapter = None  # a received LoRAModel, swapped in by finish_weight_update

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + 1  # the trainer is rank 0
        self.group = join_gloo_group(
            init_info.host, init_info.port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        began = time.perf_counter()
        if self.adapters is None:  # a LoRA engine's base weights never change
            initialize_layerwise_reload(self.model)
        self.last_timings = {"start_s": time.perf_counter() - began, "recv_s": 0.0, "load_s": 0.0}

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._roll_back()
            raise

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        """Post the receive of every bucket at once, then verify and load each as it arrives: the wire
        never waits for a load or for this thread (which holds the GIL while loading), so small buckets
        pipeline the trainer's packing, the wire and the reload."""
        if self.group is None:
            raise RuntimeError("refit_gloo: /init_weight_transfer_engine was never called")
        self.last_verify = {"checked": 0, "failed": None, "error": ""}
        specs = [ParamSpec.from_json(s) for s in zip(info.names, info.dtype_names, info.shapes, strict=True)]
        plan = plan_buckets(specs, info.bucket_bytes)
        buffers = self.buffers.carve([bucket_nbytes(specs, b) for b in plan])
        base_ok = info.delta_base is not None and self.buffers.token == info.delta_base
        self.buffers.token = self.pending_token = None  # overwritten from here on
        began = time.perf_counter()
        adapter: dict[str, torch.Tensor] = {}
        if info.delta_base is None:
            incoming = Incoming(self.group, buffers)
        else:
            units = [bucket_unit([specs[i] for i in bucket]) for bucket in plan]
            incoming = DeltaIncoming(self.group, buffers, units, base_ok)
        try:
            if (info.lora is None) != (self.adapters is None):  # refused, once the stream is drained
                raise ValueError(
                    "refit_gloo: this engine serves a LoRA adapter and takes adapter refits only"
                    if self.adapters is not None
                    else "refit_gloo: an adapter refit needs an engine started with --enable-lora"
                )
            for index, bucket in enumerate(plan):
                try:
                    payload_N = incoming.wait(index)
                except VerifyError as error:
                    self.last_verify.update(failed=index, error=str(error))
                    raise
                self.last_verify["checked"] = index + 1
                loading = time.perf_counter()
                tensors = unpack_bucket(payload_N, [specs[i] for i in bucket])
                if info.lora is None:
                    self.model.load_weights(tensors)
                else:  # copied out: the receive buffers are reused by the next refit
                    adapter.update((name, tensor.clone()) for name, tensor in tensors)
                self.last_timings["load_s"] += time.perf_counter() - loading
            if info.lora is not None:
                self.pending_adapter = _lora_model(self.adapters, adapter, info.lora)
        finally:  # after an error the rest of the stream still arrives: take it before rolling back
            incoming.drain()
            self.last_timings.update(recv_s=time.perf_counter() - began, verify_s=incoming.verify_s)
        self.pending_token = info.token

    def _reloaded(self) -> None:
        """After a reload (finished or rolled back): the tied `lm_head`'s packed copy rebuilt, and the
        receive buffers checked. Layerwise reload copies each loaded tensor into the layer's own storage,
        so no weight should live in them; if one does, they are not reused (the next refit allocates)."""
        _repack_tied(self.model)
        if self.buffers.forget_if_used_by([*self.model.parameters(), *self.model.buffers()]):
            logger.warning("refit_gloo: a model tensor kept a view of the receive buffers; not reusing them")

    def finish_weight_update(self) -> None:
        began = time.perf_counter()
        if self.adapters is not None:
            if self.pending_adapter is None:
                raise RuntimeError("refit_gloo: finish_weight_update without a received adapter")
            # The served adapter replaced (same id, same slot), as vLLM's `load_inplace` does it.
            lora = self.pending_adapter
            self.adapters.remove_adapter(lora.id)
            self.adapters.add_adapter(lora)
            self.adapters.activate_adapter(lora.id)
            self.pending_adapter = None
        else:
            finalize_layerwise_reload(self.model, self.model_config)
            self.buffers.token, self.pending_token = self.pending_token, None  # they hold this refit whole
            self._reloaded()
        self.last_timings["finish_s"] = time.perf_counter() - began

    def _roll_back(self) -> None:
        """Put back the old tensors of every layer not fully reloaded (none stays on the meta device)."""
        if self.adapters is not None:  # nothing was touched: the served adapter stays
            self.pending_adapter = None
            return
        roll_back_reload(self.model, self.model_config)
        self._reloaded()

    def shutdown(self) -> None:
        self.group = None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        raise NotImplementedError("refit_gloo's trainer end is refit.update_weights, not vLLM's trainer API")


def roll_back_reload(model: torch.nn.Module, model_config) -> None:
    """End a layerwise reload that failed: every layer still waiting for weights forgets what it buffered
    and gets its old tensors back (none stays on the meta device); layers already reloaded keep theirs."""
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.loaded_weights.clear()
            info.load_numel = 0
    # With nothing buffered, finalize places each waiting layer's kernel tensors back.
    finalize_layerwise_reload(model, model_config)


def _repack_tied(model: torch.nn.Module) -> None:
    """Re-run weight processing on every layer that shares its weight with another (tied lm_head)."""
    holders: dict[int, list[Any]] = {}  # vLLM layers: a weight and a quant_method
    for layer in model.modules():
        weight = layer._parameters.get("weight")
        if weight is not None and getattr(layer, "quant_method", None) is not None:
            holders.setdefault(id(weight), []).append(layer)
    for layers in holders.values():
        for layer in layers[1:]:
            layer.quant_method.process_weights_after_loading(layer)


def _lora_model(manager, tensors: dict[str, torch.Tensor], peft_config: dict):
    """`tensors` (PEFT names) as a `LoRAModel` under the id of the one adapter the engine serves, built and
    checked as vLLM's loader builds and checks an adapter directory (`WorkerLoRAManager._load_adapter`)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    served = list(manager.list_adapters())
    if len(served) != 1:
        raise RuntimeError(f"refit_gloo: a LoRA engine serves one adapter (--lora-modules), not {served}")
    helper = PEFTHelper.from_dict(peft_config)
    helper.validate_legal(manager.lora_config)  # the rank fits --max-lora-rank
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_unstacked_mapper() if mapper is not None else None
    lora = LoRAModel.from_lora_tensors(
        served[0], tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype, weights_mapper=mapper
    )
    expected = {
        name
        for module in manager.supported_lora_modules
        for name in manager.packed_modules_mapping.get(module, [module])
    }
    if unexpected := sorted(name for name in lora.loras if name.rsplit(".", 1)[-1] not in expected):
        raise ValueError(f"refit_gloo: the adapter wraps {unexpected[:4]}, which this engine's LoRA cannot")
    return lora


def _checkpoint_specs(model_path: str) -> list[list]:
    """Name and shape of every tensor in the model's safetensors files (headers only): the trainer's check
    compares names and shapes, whatever the dtypes."""
    from safetensors import safe_open

    folder = Path(model_path)
    if not folder.is_dir():  # a hub id: vLLM has downloaded it into the local cache
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_path, local_files_only=True, allow_patterns=["*.safetensors*"]))
    specs = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as reader:
            # keys(): safe_open is not a mapping (what SIM118 assumes).
            specs += [[name, list(reader.get_slice(name).get_shape())] for name in reader.keys()]  # noqa: SIM118
    if not specs:
        raise FileNotFoundError(f"no *.safetensors in {folder}: refit checks names against the checkpoint")
    return specs


class RefitWorkerExtension:
    """Mixed into vLLM's worker class; its methods are reachable through `/collective_rpc`."""

    # The worker's own attributes, which these methods read.
    vllm_config: VllmConfig
    model_runner: GPUModelRunner
    weight_transfer_engine: WeightTransferEngine | None

    def refit_checkpoint_specs(self, trainer_names: str = "[]") -> list[list]:
        """The checkpoint's names and shapes, in the trainer's spelling where vLLM maps both
        spellings alike (`trainer_names`: a JSON list; `/collective_rpc` passes strings only)."""
        specs = _checkpoint_specs(self.vllm_config.model_config.model)
        mapper = getattr(self.model_runner.get_model(), "hf_to_vllm_mapper", None)
        names = json.loads(trainer_names)
        return in_trainer_names(specs, names, mapper) if mapper is not None and names else specs

    def refit_transfer_backend(self) -> str | None:
        return getattr(self.vllm_config.weight_transfer_config, "backend", None)

    def refit_last_timings(self) -> dict[str, float]:
        return dict(getattr(self.weight_transfer_engine, "last_timings", {}))

    def refit_last_verify(self) -> dict:
        return dict(getattr(self.weight_transfer_engine, "last_verify", {}))


with contextlib.suppress(ValueError):  # already registered: imported twice in one process
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
for _name, _cls in ((NCCL_BACKEND, "VerifiedNcclEngine"), (IPC_BACKEND, "VerifiedIpcEngine")):
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(_name, "refit.vllm_gpu", _cls)
