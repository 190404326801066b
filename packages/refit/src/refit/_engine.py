"""One vLLM server as the trainer sees it: its RL control endpoints over HTTP plus its byte pipe.

Every call here is one documented vLLM endpoint (they exist only with `VLLM_SERVER_DEV_MODE=1`):
`/pause?mode=keep`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/reset_prefix_cache`, `/reset_encoder_cache`, `/resume`, `/init_weight_transfer_engine`,
`/get_world_size`, and `/collective_rpc` for the read-only methods of our worker extension (the backend
it serves, checkpoint specs, timings, the last transfer's verification).
No engine internals are touched from the trainer. This module does not order the calls; `_refit.py`
runs the lifecycle. A non-2xx reply raises `EngineCallError` naming the engine, the call and the body.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

from refit._buckets import ParamSpec
from refit._transport import GlooChannel, IpcChannel, NcclChannel, host_store, join_gloo_group

# Our weight-transfer backends, registered into vLLM by refit.vllm_worker; every one checks each bucket.
GLOO_BACKEND = "refit_gloo"  # CPU, over gloo
NCCL_BACKEND = "refit_nccl"  # vLLM's NCCL engine plus the check: engine and trainer on GPUs of their own
IPC_BACKEND = "refit_ipc"  # vLLM's CUDA IPC engine plus the check: engine and trainer on one GPU
BACKENDS = (GLOO_BACKEND, NCCL_BACKEND, IPC_BACKEND)


def engine_flags(backend: str = GLOO_BACKEND) -> list[str]:
    """The vLLM server flags an engine needs for refit (besides `VLLM_SERVER_DEV_MODE=1`)."""
    # The extension registers refit's backends and answers the checkpoint-spec query every backend uses;
    # the middleware keeps the weight version that vLLM 0.26 does not (refit.vllm_versions).
    return [
        "--worker-extension-cls", "refit.vllm_worker.RefitWorkerExtension",
        "--weight-transfer-config", json.dumps({"backend": backend}),
        "--middleware", "refit.vllm_versions.WeightVersions",
    ]  # fmt: skip


def engine_env(backend: str) -> dict[str, str]:
    """Environment an engine's server needs for `backend`: the IPC backend takes the CUDA IPC handles as a
    pickle over HTTP, which vLLM reads only when told to (the server listens on loopback)."""
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if backend == IPC_BACKEND else {}


class EngineCallError(RuntimeError):
    """An engine answered an RL endpoint with an error status."""


class Engine:
    """Handle on one vLLM server at `url` that serves with `backend` (one of `BACKENDS`).

    `trainer_host` is the address of this (trainer) machine as the engine's workers can reach it; the
    trainer hosts the rendezvous there. `timeout_s` bounds every HTTP call and every collective.
    """

    def __init__(
        self,
        url: str,
        *,
        backend: str = GLOO_BACKEND,
        trainer_host: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.url = url.rstrip("/")
        self.backend, self.trainer_host, self.timeout_s = backend, trainer_host, timeout_s
        self.channel: GlooChannel | NcclChannel | IpcChannel | None = None
        self.delta_base: str | None = None  # token of the delta refit whose bytes it holds (refit._delta)
        self._checkpoint_specs: dict[str, tuple[int, ...]] | None = None
        import httpx  # here, not at module top: the sender's pack path must import without it

        self._http = httpx.Client(timeout=timeout_s)

    def __repr__(self) -> str:
        return f"Engine({self.url!r}, backend={self.backend!r})"

    def _call(self, method: str, path: str, *, read_only: bool = False, **kwargs):
        import httpx

        try:
            reply = self._http.request(method, f"{self.url}{path}", **kwargs)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if not (read_only or method == "GET"):
                raise
            # The server may close a kept-alive connection after answering an error (a failed update):
            # a read-only query asks once more, on a fresh connection.
            reply = self._http.request(method, f"{self.url}{path}", **kwargs)
        if reply.status_code >= 400:
            raise EngineCallError(f"{self.url}{path} answered {reply.status_code}: {reply.text[:2000]}")
        return reply

    # --- the lifecycle endpoints, in the order a refit calls them ---
    def pause(self) -> None:
        # In-flight requests freeze, not abort. The caches are cleared once, after the load
        # (`reset_prefix_cache`): vLLM's pause would clear them too (clear_cache, default true), and each
        # reset walks every block of the KV cache.
        self._call("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        # On its own connection: the server may reset a connection kept alive after an error reply,
        # and this is the call that fails when a transfer does.
        headers = {"Connection": "close"}
        self._call("POST", "/update_weights", json={"update_info": update_info}, headers=headers)

    def finish_weight_update(self, version: str) -> None:
        self._call("POST", "/finish_weight_update", json={"weight_version": version})

    def reset_prefix_cache(self) -> None:
        """Drop every KV block and encoder output computed with the old weights (one walk over the
        KV cache a refit)."""
        # reset_running_requests: kept requests hold blocks, so a plain reset would fail; preempting
        # them makes vLLM recompute their KV with the new weights when they resume.
        reply = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not reply.json().get("success"):
            raise EngineCallError(f"{self.url}/reset_prefix_cache did not reset: {reply.text}")
        # A vision-language engine's cached image embeddings are the old encoder's (cheap when empty).
        self._call("POST", "/reset_encoder_cache")

    def resume(self) -> None:
        self._call("POST", "/resume")

    # --- read-only queries ---
    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").json()["is_paused"])

    def weight_version(self) -> str:
        return self._call("GET", "/weight_info").json()["weight_version"]

    def world_size(self) -> int:
        return int(self._call("GET", "/get_world_size").json()["world_size"])

    def _rpc(self, method: str, **kwargs: str) -> list:
        body = {"method": method, "kwargs": kwargs}  # only our extension's read-only methods
        return self._call("POST", "/collective_rpc", json=body, read_only=True).json()["results"]

    def checkpoint_specs(self, names: Sequence[str] = ()) -> dict[str, tuple[int, ...]]:
        """Name -> full shape of each tensor of the checkpoint the engine loaded (what a refit must send),
        a name spelt as in `names` (the trainer's) where the engine loads both spellings into one parameter.
        Asked once: a server never changes the checkpoint it loaded, so later refits skip the round trip."""
        if self._checkpoint_specs is None:
            reply = self._rpc("refit_checkpoint_specs", trainer_names=json.dumps(list(names)))
            self._checkpoint_specs = {name: tuple(shape) for name, shape in reply[0]}
        return self._checkpoint_specs

    def transfer_backend(self) -> list[str]:
        """Per worker, the weight-transfer backend the engine was started with."""
        return self._rpc("refit_transfer_backend")

    def worker_timings(self) -> list[dict]:
        """Per worker, seconds spent receiving and loading in the last update (gloo backend only)."""
        return self._rpc("refit_last_timings")

    def verify_report(self) -> list[dict]:
        """Per worker, the last transfer's check: `{"checked": buckets that passed, "failed": the bucket
        that did not, or None, "error": why}`, and on the GPU backends `"checksums"`: the device checksum
        the engine took of each bucket."""
        return self._rpc("refit_last_verify")

    # --- the byte pipe ---
    def connect(self) -> None:
        """Open this engine's transfer group (trainer = rank 0, its workers = 1..N); for IPC, only tell the
        engine to get ready (each bucket's handle then travels in its own `/update_weights`). Refuses an
        engine started with another backend (vLLM's own `nccl` takes bare buckets and would leave the
        trainer's checksum broadcast unmatched)."""
        if (served := set(self.transfer_backend())) != {self.backend}:
            raise ValueError(
                f"{self.url} serves weight-transfer backend {sorted(served)}, refit sends {self.backend!r}: "
                f"start it with refit.engine_flags({self.backend!r})"
            )
        if self.backend == IPC_BACKEND:
            if (gpus := self.world_size()) != 1:
                raise ValueError(f"{self.url}: the IPC refit serves a one-GPU engine, not {gpus}")
            self._call("POST", "/init_weight_transfer_engine", json={"init_info": {}})
            self.channel = IpcChannel(self.update_weights)
            return
        host, world_size = self.trainer_host, 1 + self.world_size()
        opener: Callable[[], GlooChannel | NcclChannel]
        if self.backend == NCCL_BACKEND:  # vLLM's NCCL group binds the port itself: find a free one
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            init_info = dict(master_address=host, master_port=port, rank_offset=1, world_size=world_size)
            opener = partial(NcclChannel, host, port, world_size)
        else:  # the trainer's store listens before the engine is told its port
            store, timeout_s = host_store(host, self.timeout_s), self.timeout_s
            init_info = {"host": host, "port": store.port, "world_size": world_size, "timeout_s": timeout_s}
            opener = partial(_open_gloo, host, store.port, world_size, timeout_s, store)
        init = partial(self._call, "POST", "/init_weight_transfer_engine", json={"init_info": init_info})
        self.channel = _rendezvous(opener, init)

    def update_info(
        self,
        specs: list[ParamSpec],
        bucket_bytes: int,
        *,
        token: str | None = None,
        delta_base: str | None = None,
        lora: dict | None = None,
    ) -> dict:
        """The `/update_weights` payload: the parameter list both ends plan buckets from; on gloo also
        the `token` naming the bytes the engine keeps after this refit and, for a delta stream, the
        token of the bytes it is patched against (`refit._delta`)."""
        info = {
            "names": [s.name for s in specs],
            "dtype_names": [str(s.dtype).removeprefix("torch.") for s in specs],
            "shapes": [list(s.shape) for s in specs],
        }
        if self.backend == GLOO_BACKEND:
            info.update(bucket_bytes=bucket_bytes, token=token, delta_base=delta_base, lora=lora)
        else:  # refit_nccl runs vLLM 0.26's NCCL receiver, which reads the packing per update
            info.update(packed=True, packed_buffer_size_bytes=bucket_bytes, packed_num_buffers=2)
        return info

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._http.close()


def _rendezvous(open_trainer_end, init_engine_end):
    """Run both ends of a rendezvous at once (each blocks until the other arrives).

    The engine's HTTP call runs here; the trainer end runs on a daemon thread so that an engine that
    refuses at once (wrong backend) surfaces its error now instead of after the collective's timeout.
    """
    opened: Future = Future()

    def trainer_end() -> None:
        try:
            opened.set_result(open_trainer_end())
        except BaseException as exc:  # handed to the caller below
            opened.set_exception(exc)

    threading.Thread(target=trainer_end, daemon=True).start()
    init_engine_end()
    return opened.result()  # waits for the trainer end


def _open_gloo(host: str, port: int, world_size: int, timeout_s: float, store) -> GlooChannel:
    return GlooChannel(join_gloo_group(host, port, 0, world_size, timeout_s, store))
