"""A CUDA MPS server of the run's own, for an engine and an actor that share one GPU (`--vllm.mps`).

Without MPS the processes on one GPU take turns: each gets time slices in which its kernels alone run, so
the engine's decoding (bound by memory bandwidth, few thread blocks at a time) and the actor's matmuls
(bound by arithmetic) add up instead of overlapping. As clients of one MPS server, their kernels run on
the GPU's multiprocessors at the same time. The run starts its own control daemon with a pipe directory of
its own, so it neither needs nor touches a daemon the machine may run already, puts that directory in its
environment before Ray starts (Ray's workers, the engines' servers and the actor ranks inherit it), and
quits the daemon when the run ends. It changes no GPU setting (the compute mode stays as it is). The
daemon's and server's logs go to `<run_dir>/mps/`. The price is MPS's containment: a fatal GPU fault in
one client (an illegal address, say) ends every client of the server, so an engine that dies that way
takes the actor with it, and the run stops instead of restarting the engine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from molt._log import progress
from molt.config import Config, ConfigError

CONTROL = "nvidia-cuda-mps-control"  # ships with NVIDIA's driver utilities, beside nvidia-smi
DEFAULT_PIPE = "/tmp/nvidia-mps"  # where CUDA looks for a server when CUDA_MPS_PIPE_DIRECTORY is unset


def uses_mps(config: Config) -> bool:
    """Whether the run starts an MPS server: --vllm.mps on, or auto where the engine molt starts shares the
    actor's GPU on a local Ray, the control binary is on PATH and the run's processes are not clients of
    an MPS server already (call once the placement is decided)."""
    vllm = config.vllm
    if vllm.mps != "auto":
        return vllm.mps == "on"
    shared = vllm.placement == "shared" and not vllm.urls and not config.ray.address
    return shared and shutil.which(CONTROL) is not None and not _under_mps()


def _under_mps() -> bool:
    """Whether a CUDA process started here would be a client of an MPS server already: one named by the
    environment, or a daemon at the default pipe directory (the machine's own)."""
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or Path(DEFAULT_PIPE, "control").exists()


def check_mps(config: Config) -> None:
    """Refuses --vllm.mps on where it cannot act; call once a local run's placement is decided."""
    vllm = config.vllm
    if vllm.mps != "on":
        return
    if config.ray.address:
        raise ConfigError(
            "--vllm.mps on starts an MPS server for the processes a local Ray starts, and --ray.address "
            "joins a cluster whose Ray starts them: drop one of the two"
        )
    if vllm.placement != "shared":
        raise ConfigError(
            f"--vllm.mps on lets the engine and the actor share one GPU, and this run gives them GPUs of "
            f"their own (--vllm.placement {vllm.placement}): pass --vllm.placement shared, or drop --vllm.mps"
        )
    if shutil.which(CONTROL) is None:
        raise ConfigError(
            f"--vllm.mps on needs NVIDIA's {CONTROL} on PATH (it ships with the driver's utilities, beside "
            "nvidia-smi), and none is found: add its folder to PATH, or drop --vllm.mps"
        )


def mps_report(run_dir: Path) -> str:
    """A line on the run's MPS server (call inside `mps_server`, once the engines and actors are up): how
    many processes are its clients, as its control daemon lists them. None means they all run outside it
    and take turns on the GPU, as without MPS."""
    servers = _control("get_server_list").split()
    clients = [pid for server in servers for pid in _control(f"get_client_list {server}").split()]
    if not clients:
        return (
            f"note: no process is a client of the run's MPS server (its logs: {run_dir}/mps): they take turns"
        )
    return f"{len(clients)} processes share the GPU under MPS (server {', '.join(servers)})"


def _control_binary() -> str:
    """The control binary's path: a run reaches its MPS server only with one on PATH (validate refuses
    --vllm.mps on without it, auto is off)."""
    control = shutil.which(CONTROL)
    assert control, f"{CONTROL} is not on PATH: validate refuses --vllm.mps on without it, auto is off"
    return control


def _control(command: str, env: dict[str, str] | None = None) -> str:
    """What the control daemon of `env` (else this process's environment) answers `command` (nothing where
    it fails: a daemon that is gone lists no server)."""
    answer = subprocess.run(
        [_control_binary()], input=f"{command}\n", env=env, capture_output=True, text=True, timeout=60
    )
    return answer.stdout if answer.returncode == 0 else ""


@contextlib.contextmanager
def mps_server(run_dir: Path, *, required: bool = True) -> Iterator[bool]:
    """While open, every CUDA process this one starts from now on (Ray, and all Ray starts) is a client of
    a fresh MPS control daemon's server; on exit the daemon quits and the environment is as it was. Yields
    whether it runs: a daemon that fails to start stops the run when `required` (--vllm.mps on), else it
    is noted and the processes take turns (auto)."""
    control = _control_binary()
    pipe = Path(tempfile.mkdtemp(prefix="molt-mps-"))  # the daemon's sockets: a short path, theirs alone
    logs = (run_dir / "mps").resolve()
    logs.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    daemon = [control, "-d"]
    started = subprocess.run(daemon, env=os.environ | env, capture_output=True, text=True, timeout=60)
    if started.returncode:
        shutil.rmtree(pipe, ignore_errors=True)
        failed = f"{control} -d failed ({started.returncode}: {(started.stdout + started.stderr).strip()})"
        if required:
            raise RuntimeError(
                f"{failed}; its log is in {logs}; pass --vllm.mps off to share the GPU without MPS"
            )
        progress(f"note: {failed} (its log is in {logs}): the engine and the actor take turns on the GPU")
        yield False
        return
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield True
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # The daemon stops its server once the clients are gone (the engines and actors stopped first); a
        # client left behind keeps it waiting, and it is not this run's to kill.
        with contextlib.suppress(subprocess.TimeoutExpired):
            _control("quit", os.environ | env)
        shutil.rmtree(pipe, ignore_errors=True)
