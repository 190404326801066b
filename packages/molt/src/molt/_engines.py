"""vLLM engines placed by Ray: one Ray actor per engine, each owning one vLLM server process.

Each engine serves the token-level interface tito speaks, returns processed logprobs, and carries
refit's worker extension so the trainer can push weights into it (`refit.engine_flags`). Under
--actor.lora.rank each engine also serves one LoRA adapter, `ADAPTER`, that every tito request names and
every refit replaces in place (`lora_flags`). Where the engines run on the trainer's machine, each
server process starts before Ray does and imports vLLM meanwhile (`prestart_engines`); its actor hands it
its flags. A server dies with the process that started it (its actor, or the trainer for one started
ahead: see `molt.vllm_server`), and `stop_engines` stops them explicitly first. A server that dies is
started again by its actor (`EngineActor.restart`, driven by `molt._restarts`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, cast

import ray

from molt._checks_model import LORA_RANKS
from molt._placement import (
    compute_dtype_name,
    engine_gpus,
    engine_max_num_seqs,
    engine_memory_share,
    kv_cache_bytes,
    refit_backend,
)
from molt.config import Config
from molt.vllm_server import VLLMServer, prestart, stop_process

ADAPTER = "policy"  # the LoRA adapter's name on the engines, and the model each tito request names


def lora_flags(adapter: dict, folder: Path) -> list[str]:
    """vLLM flags that serve one LoRA adapter, `ADAPTER`, of PEFT config `adapter`, written into `folder`
    as the base model: vLLM refuses an adapter without tensors, so it holds one zero pair, 1 wide, on the
    first layer's o_proj (vLLM copies a pair into the corner of its zeroed slot). Refits swap the trained
    adapter in (`refit.vllm_worker`), so one adapter is ever held."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    name, rank = "base_model.model.model.layers.0.self_attn.o_proj", adapter["r"]
    zeros = {f"{name}.lora_A.weight": np.zeros((rank, 1), np.float32)}
    zeros[f"{name}.lora_B.weight"] = np.zeros((1, rank), np.float32)
    save_file(zeros, str(folder / "adapter_model.safetensors"))
    max_rank = min(r for r in LORA_RANKS if r >= rank)
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "1",
            "--lora-modules", f"{ADAPTER}={folder}"]  # fmt: skip


class EngineActor:
    """Runs inside a Ray worker: starts the server in `__init__`, so the actor is ready when it answers.
    It never loads torch: the server starts seconds sooner (the trainer says whether it is a CPU run)."""

    def __init__(
        self,
        model_dir: str,
        extra_args: list[str],
        log_path: str,
        on_cpu: bool,
        env: dict[str, str],
        adapter: dict | None = None,
        prestarted: int | None = None,
    ) -> None:
        if adapter is not None:  # on the engine's own machine: vLLM reads the adapter's folder there
            extra_args = extra_args + lora_flags(adapter, Path(log_path).with_suffix(".adapter"))
        # The server's flags, for `restart`.
        self.flags: dict[str, Any] = dict(model=model_dir, extra_args=extra_args, on_cpu=on_cpu, env=env)
        self.log_path, self.num_restarts = Path(log_path), 0
        # `prestarted`: the pid of its server process, started ahead with `log_path` (`prestart_engines`)
        self.server = VLLMServer(log_path=log_path, prestarted=prestarted, **self.flags).start()

    def url(self) -> str:
        return self.server.url

    def restart(self) -> str:
        """Stop what is left of the server and start it again, same flags, on a new port (a request still
        bound for the old one fails instead of reaching a server with other weights); returns its URL.
        Each restart logs into `engine-<i>.restart-<n>.log`, beside the log of the one that died."""
        self.server.stop()
        self.num_restarts += 1
        log_path = self.log_path.with_name(f"{self.log_path.stem}.restart-{self.num_restarts}.log")
        self.server = VLLMServer(log_path=log_path, **self.flags).start()
        return self.server.url

    def log_report(self) -> str:
        """The server's log: where it is, the first error it names and its last lines."""
        return self.server.log_report()

    def stop(self) -> None:
        self.server.stop()


def engine_extra_args(config: Config, model_dir: Path | None = None) -> list[str]:
    """vLLM flags from `--vllm.*` plus refit's worker extension; `model_dir` sizes a CUDA engine's KV
    cache (`kv_cache_bytes`)."""
    import torch  # here, not at the top: the engine actors' workers import this module (`EngineActor`)

    import refit

    on_gpu, vllm = torch.cuda.is_available(), config.vllm
    args = refit.engine_flags(refit_backend(config, on_gpu=on_gpu))
    args += ["--max-model-len", str(vllm.max_model_len), "--seed", str(config.train.seed)]
    args += ["--enable-prefix-caching" if vllm.enable_prefix_caching else "--no-enable-prefix-caching"]
    if on_gpu:
        # The engine samples with the function the trainer computes (invariant 3), and a refit sends
        # weights in that dtype (`compute_dtype_name`); the CPU engine always runs float32.
        args += ["--dtype", compute_dtype_name(config)]
        args += ["--tensor-parallel-size", str(vllm.tensor_parallel_size)]
        args += ["--data-parallel-size", str(vllm.data_parallel_size)]
        args += ["--gpu-memory-utilization", str(engine_memory_share(config))]
        max_num_seqs = engine_max_num_seqs(config)  # fewer CUDA graphs to capture for a small run
        args += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
        if model_dir is not None:
            kv_bytes = kv_cache_bytes(config, model_dir, torch.cuda.get_device_properties(0).total_memory)
            args += ["--kv-cache-memory-bytes", str(kv_bytes)] if kv_bytes else []
        args += ["--enable-expert-parallel"] if vllm.enable_expert_parallel else []
        args += [] if vllm.cuda_graphs else ["--enforce-eager"]
        if vllm.cuda_graphs and not vllm.compile:  # vLLM's piecewise graphs need its compiled model
            args += ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})]
        args += ["--enable-return-routed-experts"] if config.train.routing_replay else []  # R3's routes
        if vllm.mtp_num_speculative_tokens:
            spec = f'{{"method": "mtp", "num_speculative_tokens": {vllm.mtp_num_speculative_tokens}}}'
            args += ["--speculative-config", spec]
    if vllm.max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(vllm.max_num_batched_tokens)]
    args += ["--stream-interval", str(vllm.stream_interval)] if vllm.stream_interval else []  # tito streams
    return args


def _engine_env(config: Config) -> tuple[bool, dict[str, str]]:
    """Whether the engines run on a GPU, and what their servers' environment adds (`refit.engine_env`)."""
    import torch

    import refit

    on_gpu = torch.cuda.is_available()
    return on_gpu, refit.engine_env(refit_backend(config, on_gpu=on_gpu))


def prestart_engines(config: Config, run_dir: Path) -> list[subprocess.Popen]:
    """Where Molt starts Ray on this machine (no --ray.address, no --vllm.urls), one server process per
    engine, started now: each imports vLLM (seconds) while Ray, the model and its engine's actor start,
    then waits for the flags that actor hands it (`molt.vllm_server.prestart`; `launch_engines`). The
    caller stops them after the actors (`stop_prestarted`)."""
    if config.ray.address or config.vllm.urls:  # an engine may land on another machine, or none starts
        return []
    on_gpu, env = _engine_env(config)
    # What the import itself reads must be set now: one OpenMP thread, as Ray gives an actor without CPUs.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}
    started: list[subprocess.Popen] = []
    try:
        for index in range(config.vllm.num_engines):
            started.append(prestart(run_dir / f"engine-{index}.log", on_cpu=not on_gpu, env=env))
    except OSError:  # a run directory without named pipes (some network file systems): the actors start them
        stop_prestarted(started)
        return []
    return started


def stop_prestarted(processes: list[subprocess.Popen]) -> None:
    """Stop and reap the servers `prestart_engines` started (their actors stop those they were handed)."""
    for process in processes:
        stop_process(process)
        Path(cast(list[str], process.args)[-1]).unlink(missing_ok=True)  # its pipe, if never handed flags


def launch_engines(
    model_dir: Path, config: Config, run_dir: Path, prestarted: list[int] | None = None
) -> list:
    """Start `--vllm.num_engines` engine actors (none where `--vllm.urls` attaches running servers); they
    load in the background (each actor's `url()` answers once its server does). `prestarted`: the pids of
    the servers `prestart_engines` started, one per engine, which the actors hand their flags."""
    from molt._sharding import adapter_config

    on_gpu, env = _engine_env(config)
    gpus = engine_gpus(config) if on_gpu else 0
    # No task events, as the actor's.
    remote = ray.remote(num_cpus=0, num_gpus=gpus, enable_task_events=False)(EngineActor)
    args = engine_extra_args(config, model_dir)
    adapter = adapter_config(config.actor.lora) if config.actor.lora.rank else None
    engines = range(0 if config.vllm.urls else config.vllm.num_engines)
    pids: list[int | None] = [*prestarted] if prestarted else [None for _ in engines]
    return [
        remote.remote(
            str(model_dir), args, str(run_dir / f"engine-{i}.log"), not on_gpu, env, adapter, pids[i]
        )
        for i in engines
    ]


def check_attached(urls: list[str], *, lora: bool = False) -> list[str]:
    """`--vllm.urls`: servers someone else started; each must answer `/health` now and, with `lora`
    (--actor.lora.rank), serve the adapter `ADAPTER` (started with `lora_flags`)."""
    import httpx

    for url in urls:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
            models = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).json()["data"] if lora else []
        except httpx.HTTPError as error:
            raise ValueError(f"--vllm.urls {url}: the server does not answer /health ({error})") from error
        if lora and ADAPTER not in [model["id"] for model in models]:
            raise ValueError(
                f"--vllm.urls {url} serves no LoRA adapter {ADAPTER!r}, which --actor.lora.rank refits: "
                "start it with the flags of molt._engines.lora_flags (--enable-lora ... --lora-modules), or "
                "drop the rank"
            )
    return [url.rstrip("/") for url in urls]


def stop_engines(actors: list) -> None:
    """Stop every server, then the actors; an actor that already died is skipped."""
    for actor in actors:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(actor.stop.remote(), timeout=60)
        ray.kill(actor)
