"""One refit: new full weights from the trainer into every engine, through vLLM's weight-transfer API.

Lifecycle, each phase run on all engines in parallel (paper §3.1 "partial rollout"):
check names/shapes → connect (first time) → pause(mode=keep) → start_weight_update → transfer buckets
(engine verifies and loads layer by layer) → [a verification failed: start + full transfer again, those
engines only] → finish_weight_update(version) → reset_prefix_cache → resume.

Every refit is verified, on every backend: the engine checks each bucket against a checksum of the bytes
the trainer packed (refit_gloo: the CRC-32 in the bucket's header, before loading it; refit_ipc: a checksum
taken on the GPU, in the bucket's own call, before loading it; refit_nccl: the same checksum, sent after
the last bucket, so checked once all are loaded; `refit._transport`). A mismatch makes the engine roll back
(as for an abort) and the trainer retry that engine once with a full refit, the engine still paused;
`RefitStats.verify_failed` names it. `delta=True` (refit_gloo only) sends per bucket only what changed
since the engine's bytes (`refit._delta`). `lora` (refit_gloo only) sends a LoRA adapter
(`adapter_params`) to engines serving one: they build it with vLLM's LoRA loader while the transfer runs
and swap it in place of the adapter they serve at `finish_weight_update`, so the version label switches
exactly when the weights do.

Refuses, before any engine is touched: a parameter list whose names or full shapes differ from the
checkpoint an engine loaded (a missing parameter would leave its layer half loaded). Failure of one
engine never stops the others: it is dropped from later phases and reported in `RefitError` with the
phase it failed in. An engine that failed after `start_weight_update` is never resumed (its layers may
be on the meta device, or mixed old/new after a rollback); the next successful refit resumes it.
Every trainer rank calls `update_weights` (the gathers are collectives); rank 0 alone talks to engines,
through a `refit._run.Run` (the phases' bookkeeping and the transfers).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from refit._buckets import plan_buckets
from refit._engine import GLOO_BACKEND, IPC_BACKEND, Engine
from refit._gather import FullParams
from refit._run import Run

DEFAULT_BUCKET_BYTES = 256 << 20
IPC_BUCKET_BYTES = 1 << 30
"""refit_ipc's buckets: each is an `/update_weights` call of its own, about 17 ms besides its bytes on one
H200 (a tiny model's whole send), so a 1.7B model in 256 MiB buckets spent 0.22 s in 13 calls. Two GPU
buffers of this size exist while the refit runs."""
PAST_START = ("start", "transfer", "retry_start", "verify", "finish", "reset_prefix_cache", "resume")


class RefitError(RuntimeError):
    """Some engines failed a refit. `failures` maps engine url → (phase, error); `updated` lists the
    engines that got the new weights and were resumed; `paused` those left paused on purpose."""

    def __init__(self, failures: dict[str, tuple[str, BaseException]], updated: list[str]) -> None:
        self.failures, self.updated = failures, updated
        self.paused = [url for url, (phase, _) in failures.items() if phase in PAST_START]
        lines = [f"refit failed on {len(failures)} engine(s):"]
        lines += [
            f"  {url}: phase {phase!r}: {type(err).__name__}: {err}" for url, (phase, err) in failures.items()
        ]
        lines.append(f"  updated and resumed: {updated or 'none'}")
        if self.paused:
            lines.append(
                f"  left paused (not resumed after a failed update; the next refit resumes): {self.paused}"
            )
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved and how long each phase took (seconds, wall clock on rank 0).

    `num_bytes`: the weights' size; `bytes_sent`: payload bytes put on the wire, summed over engines
    (a delta refit sends fewer; a retry adds its own); `verify_failed`: the engines whose first transfer
    failed verification and were retried with a full refit (phases `retry_start`, `retry_transfer`)."""

    version: str
    num_bytes: int
    num_buckets: int
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    verify_failed: tuple[str, ...] = ()


def update_weights(
    engines: Sequence[Engine],
    params: FullParams,
    *,
    version: int | str,
    bucket_bytes: int | None = None,
    delta: bool = False,
    lora: dict | None = None,
) -> RefitStats | None:
    """Refit `engines` with `params` (from `full_params(model)`) and label the weights `version`.

    Call on every trainer rank. Returns the stats on rank 0 (None elsewhere); raises `ValueError` for a
    name/shape mismatch (no engine touched) and `RefitError` if any engine failed. `delta`: send each
    engine that holds the previous delta refit's bytes only what changed (rank 0 keeps a copy of the
    weights in the wire dtype for it); refit_gloo engines only. `lora`: `params` is a LoRA adapter
    (`adapter_params`) and this is its PEFT config (`r`, `lora_alpha`, `target_modules`); refit_gloo
    engines serving LoRA only, and never a delta (the adapter is small). `bucket_bytes`: by default
    `default_bucket_bytes(engines)`; every rank must pass the same engines' backends, or the same size.
    """
    if (delta or lora) and (others := [e.url for e in engines if e.backend != GLOO_BACKEND]):
        what = "an adapter refit" if lora else "delta refit"
        raise ValueError(f"{what} runs on {GLOO_BACKEND!r} engines only; {others} use another backend")
    if delta and lora:
        raise ValueError("an adapter refit is never a delta: pass delta=False with lora")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    specs = list(params.specs)
    bucket_bytes = bucket_bytes or default_bucket_bytes(engines)
    plan = plan_buckets(specs, bucket_bytes)
    run = Run(list(engines), lora=lora) if rank == 0 else None
    # Rank 0's verdict on the check (an adapter is not the checkpoint), shared so all ranks refuse together
    # (none hangs in a gather).
    if error := _share(run.check(specs) if run and lora is None else None):
        raise ValueError(error)
    if run is None:
        for _ in params:  # join every gather; rank 0 sends
            pass
        if _share(None):  # rank 0 retries a transfer that failed verification: gather again
            for _ in params:
                pass
        return None
    run.phase("connect", Engine.connect, [e for e in run.live if e.channel is None])  # once per engine
    run.phase("pause", Engine.pause)
    run.phase("start", Engine.start_weight_update)
    token = uuid.uuid4().hex if delta else None  # names the bytes the engines hold after this refit
    if token is not None:  # a delta refit
        run.transfer_delta(params, specs, plan, bucket_bytes, token)
    else:
        run.transfer(params, specs, plan, bucket_bytes)
    retry = run.verify_failures()
    if _share(bool(retry)):
        run.phase("retry_start", Engine.start_weight_update, retry)
        run.transfer(params, specs, plan, bucket_bytes, token, engines=retry, prefix="retry_")
        run.verify_failures(retry=False)
    run.phase("finish", lambda e: e.finish_weight_update(str(version)))
    run.phase("reset_prefix_cache", Engine.reset_prefix_cache)
    run.phase("resume", Engine.resume)
    for engine in engines:
        engine.delta_base = token if engine in run.live else None
    if run.failures:
        raise RefitError({e.url: failure for e, failure in run.failures.items()}, [e.url for e in run.live])
    verify_failed = tuple(e.url for e in retry)
    return RefitStats(
        str(version), sum(s.nbytes for s in specs), len(plan), run.seconds, run.bytes_sent, verify_failed
    )


def default_bucket_bytes(engines: Sequence[Engine]) -> int:
    """`IPC_BUCKET_BYTES` when every engine takes CUDA IPC handles, else `DEFAULT_BUCKET_BYTES`."""
    ipc_only = bool(engines) and all(engine.backend == IPC_BACKEND for engine in engines)
    return IPC_BUCKET_BYTES if ipc_only else DEFAULT_BUCKET_BYTES


def _share(value):
    """Rank 0's `value`, on every rank of the trainer's process group (a collective where it has >1)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value
