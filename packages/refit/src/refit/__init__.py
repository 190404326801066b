"""refit: weight refit from an FSDP2 trainer into running vLLM engines, and MoE routing replay.

`update_weights(engines, full_params(model), version=v)` pauses every engine (keeping in-flight
requests), streams the full parameters in bounded buckets through vLLM's weight-transfer API (over our
backends: `refit_nccl` across GPUs and `refit_ipc` on one shared GPU, vLLM's own NCCL and CUDA IPC engines
plus a check; `refit_gloo` on CPU), labels them `v`, clears the prefix cache and resumes. Every bucket is
verified (the engine checks a checksum of the bytes the trainer packed; a mismatch is rolled back and
retried in full), and on `refit_gloo` `delta=True` sends only the elements that changed since the
engine's last refit.
`update_weights(engines, adapter_params(model), version=v, lora=peft_config)` sends a LoRA policy's
adapters alone to engines that serve them (`--enable-lora`), which swap them in place.
`decode_routed_experts` and `RoutingReplay` replay an engine's MoE routing in transformers and NeMo
AutoModel MoE models.
See README.md.
"""

from refit._buckets import ParamSpec, pack_bucket, plan_buckets, unpack_bucket
from refit._engine import (
    GLOO_BACKEND,
    IPC_BACKEND,
    NCCL_BACKEND,
    Engine,
    EngineCallError,
    engine_env,
    engine_flags,
)
from refit._gather import FullParams, adapter_params, full_params
from refit._refit import DEFAULT_BUCKET_BYTES, RefitError, RefitStats, update_weights
from refit._routing import RoutingReplay, decode_routed_experts

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GLOO_BACKEND",
    "IPC_BACKEND",
    "NCCL_BACKEND",
    "Engine",
    "EngineCallError",
    "FullParams",
    "ParamSpec",
    "RefitError",
    "RefitStats",
    "RoutingReplay",
    "adapter_params",
    "decode_routed_experts",
    "engine_env",
    "engine_flags",
    "full_params",
    "pack_bucket",
    "plan_buckets",
    "unpack_bucket",
    "update_weights",
]
