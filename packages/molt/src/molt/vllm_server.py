"""Start one vLLM OpenAI-compatible server as a subprocess, with the flags Molt's engines need.

An engine for Molt must offer the token-level interface (`/inference/v1/generate`, which vLLM 0.26
serves with no flag), return processed (post-temperature) logprobs so they match the trainer's
recomputation, and expose the RL endpoints (pause, weight transfer, prefix-cache reset), which vLLM
only registers with `VLLM_SERVER_DEV_MODE=1`. On a CPU the fast-start settings below bring a tiny model
up in well under a minute. This module does not place engines (Ray does that); it only starts and
stops one server process and waits until it answers `/health`. The process runs this module
(`python -m molt.vllm_server FLAGS`: vLLM's server, imported so that it can fork its engine core, `serve`).
A process started ahead (`prestart`) imports vLLM first and is handed its flags later (`VLLMServer`'s
`prestarted`): the seconds of the import overlap whatever comes between (a run's Ray start).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["VLLMServer", "engine_args", "first_error", "free_port", "prestart", "stop_group", "stop_process"]


_PORTS = random.SystemRandom()
_START_TIMEOUT_S = 300.0  # a server not answering /health by then is stopped
# The server's environment where this process's does not set them (the RL endpoints, no downloads) ...
_ENV = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
# ... and on a CPU (one process, a small KV cache, one thread) ...
_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
# ... or on a GPU: the engine core forked from the server, which has vLLM imported already (`serve`).
_GPU_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
# An exception's closing line, after vLLM's optional "(EngineCore pid=N) " and "ERROR date time [file] ".
_EXCEPTION = re.compile(r"^(\(\w+ pid=\d+\) )?(ERROR \S+ \S+ \[[^\]]+\] )?[\w.]*(Error|Exception)\b")


def first_error(log: str, context: int = 6) -> str:
    """The first exception a server log names, with the lines above it (the frame that raised). A start
    that fails in the engine core logs its root cause there, well above the API server's closing
    traceback, which is all a log's tail shows. Empty when the log names none."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if _EXCEPTION.match(line):
            return "\n".join(lines[max(0, i - context) : i + 1])
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server started next. Drawn below Linux's ephemeral range
    (32768 and up), from which every outgoing connection takes its local port: a port from that range can
    be taken by someone's HTTP client between this check and the server's bind. The draw uses the OS's
    entropy, not the global `random` (which `molt train` seeds): runs with one seed started together on one
    machine must not try the same ports in the same order."""
    for _ in range(200):
        port = _PORTS.randrange(20000, 32768)
        with socket.socket() as sock, contextlib.suppress(OSError):  # one taken: draw another
            sock.bind((host, port))
            return port
    raise RuntimeError(f"no free TCP port found on {host} in 20000-32767")


_COMMAND = [sys.executable, "-m", "molt.vllm_server"]  # vLLM's server (`serve`); then its flags


def engine_args(model: str | Path, *, port: int, extra: Sequence[str], on_cpu: bool) -> list[str]:
    """The command line of one engine (see the module docstring for why each flag is there), then the
    `extra` flags; a context of 2,048 tokens unless they give `--max-model-len`."""
    context = [] if "--max-model-len" in extra else ["--max-model-len", "2048"]
    args = [
        *_COMMAND,
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        *context,
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if on_cpu:
        # Fast start on CPU (about 40 s instead of 200 s): no engine subprocess, no graph capture.
        args += ["--enforce-eager", "--distributed-executor-backend", "uni", "--dtype", "float32"]
    return args + list(extra)


def server_env(on_cpu: bool, env: dict[str, str] | None = None) -> dict[str, str]:
    """A server's environment: the settings above where this process's environment does not set them,
    then `env`."""
    return {**_ENV, **(_CPU_ENV if on_cpu else _GPU_ENV), **os.environ, **(env or {})}


def handoff_path(log_path: str | Path) -> Path:
    """The named pipe through which a server started ahead (`prestart`) is handed its flags."""
    return Path(log_path).with_suffix(".handoff")


def prestart(log_path: str | Path, *, on_cpu: bool, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server process that imports vLLM (seconds) and then waits for its flags, which
    `VLLMServer(..., prestarted=process.pid).start()` hands it (from any process of this machine) with the
    environment it is to run in. Start it before whatever the server would otherwise wait for (a run
    starts it before Ray and the engine's actor): the import runs meanwhile. What the environment sets
    for the import itself (`HF_HUB_OFFLINE`, `OMP_NUM_THREADS`) comes from `server_env(on_cpu, env)`, here.
    Its output goes to `log_path`, and it dies with this process; stopping it and reaping it are the
    caller's (`stop_process`)."""
    pipe = handoff_path(log_path)
    pipe.unlink(missing_ok=True)
    os.mkfifo(pipe, 0o600)
    return _spawn([*_COMMAND, "--handoff", str(pipe)], log_path, server_env(on_cpu, env))


def _spawn(argv: list[str], log_path: str | Path, env: dict[str, str]) -> subprocess.Popen:
    """A server process running `argv` in `env`, its output into `log_path`, leading a process group of its
    own (`stop_group`) and dying with this process."""
    with Path(log_path).open("wb") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def stop_group(pid: int, exited: Callable[[], bool]) -> None:
    """Terminate the process group that `pid` leads (a server and what it started: a GPU engine core), and
    kill it if it is still there after 20 s. `exited()`: whether the leader has exited (where this process
    is its parent, `Popen.poll`, which also reaps it)."""
    if exited():  # what it started may live on
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return
    os.killpg(pid, signal.SIGTERM)
    if not _waited(exited, 20.0):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _waited(exited, 20.0)


def stop_process(process: subprocess.Popen) -> None:
    """`stop_group` for a process this process started (`prestart`)."""
    stop_group(process.pid, lambda: process.poll() is not None)


def _waited(exited: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not exited():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (an exited one this process did not start stays a zombie until its
    parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _die_with_parent() -> None:
    """Ask Linux to stop the server when the process that started it dies (a killed trainer or Ray
    actor must not leave an engine behind)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class VLLMServer:
    """One vLLM server process. `with VLLMServer(model) as server:` waits for `/health`; `server.url`.

    The server's output goes to `log_path` (a temporary file by default) so a failed start can show
    its last lines in the error. `on_cpu`: whether it runs the CPU build; None asks torch (a process that
    only starts servers need not load it: molt's engine actors pass what the trainer found). `env`: set in
    the server's environment on top of this process's (e.g. `refit.engine_env`). `prestarted`: the pid of a
    server process started ahead with this `log_path` (`prestart`), which `start` hands these flags and
    environment instead of starting one; it may have been started by another process.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        on_cpu: bool | None = None,
        env: dict[str, str] | None = None,
        prestarted: int | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if on_cpu is None:
            import torch

            on_cpu = not torch.cuda.is_available()
        self.args = engine_args(model, port=self.port, extra=extra_args, on_cpu=on_cpu)
        self.log_path = Path(log_path or f"/tmp/molt-vllm-{self.port}.log")
        self.env = server_env(on_cpu, env)
        self.process: subprocess.Popen | None = None  # where this process started the server
        self.pid = prestarted  # the server's process, leading its process group

    def start(self) -> VLLMServer:
        """Start the server (or hand the one started ahead its flags) and wait until it answers `/health`
        (an exit or a timeout raises with its log)."""
        if self.pid is None:
            self.process = _spawn(self.args, self.log_path, self.env)
            self.pid = self.process.pid
        else:
            self._hand_off()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._exited():
                self.stop()  # what it started may live on (a GPU engine core)
                status = f" with {self.process.returncode}" if self.process else ""
                raise RuntimeError(f"vLLM server exited{status} {self.log_report()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {_START_TIMEOUT_S:.0f} s {self.log_report()}")

    def _hand_off(self) -> None:
        """Hand the server started ahead its flags and environment, one line of JSON through its pipe,
        which it holds open from its start (`serve`); no reader there means it has exited."""
        assert self.pid is not None
        line = json.dumps({"argv": self.args[len(_COMMAND) :], "env": self.env}).encode() + b"\n"
        while True:
            try:
                pipe = os.open(handoff_path(self.log_path), os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as error:  # not open yet (a process started this instant), or gone with its server
                if self._exited():
                    self.stop()
                    raise RuntimeError(
                        f"vLLM server exited before it was handed its flags {self.log_report()}"
                    ) from error
                time.sleep(0.05)
        try:
            os.set_blocking(pipe, True)
            with open(pipe, "wb", closefd=False) as stream:
                stream.write(line)
        finally:
            os.close(pipe)

    def _exited(self) -> bool:
        assert self.pid is not None
        return self.process.poll() is not None if self.process else not _alive(self.pid)

    def log_report(self, num_lines: int = 20) -> str:
        """Where the server's log is, the first error it names (a failed engine core's root cause) and its
        last lines."""
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        tail = "\n".join(log.splitlines()[-num_lines:])
        return (
            f"(whole log: {self.log_path}); the first error it logged:\n{first_error(log)}\n"
            f"... its last lines:\n{tail}"
        )

    def stop(self) -> None:
        """Terminate the whole process group (the server may have children), then reap it where this
        process started it."""
        if self.pid is not None:
            stop_group(self.pid, self._exited)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def import_server() -> ModuleType:
    """vLLM's OpenAI server module, imported without starting CUDA in this process.

    vLLM forks its engine core where CUDA has not started in the server, and otherwise spawns it: a fresh
    interpreter that imports vLLM again (about 10 s of an engine's start on an H100). Importing the
    server starts CUDA wherever torchao is installed (AutoModel needs it): transformers imports torchao's
    safetensors support, and torchao asks torch at import for the device's compute capability (and whether
    Triton runs on it), questions torch answers by opening a CUDA context. So the import runs with torchao
    blocked, which transformers reads as "not installed" (an answer it keeps in this process and in the
    engine core forked from it: Molt's engines serve no torchao weights); vLLM's own import of it, were
    a model to ask for it later, is not blocked."""
    blocked = "torchao" not in sys.modules
    if blocked:
        sys.modules["torchao"] = None  # type: ignore[assignment]  # Python's way to make an import fail
    try:
        from vllm.entrypoints.openai import api_server
    finally:
        if blocked:
            del sys.modules["torchao"]
    return api_server


def serve(argv: Sequence[str]) -> None:
    """Run vLLM's OpenAI server with the command line `argv`, as vLLM's own `python -m
    vllm.entrypoints.openai.api_server` would, from a process that has not started CUDA (`import_server`).
    `argv` of `--handoff PIPE` (`prestart`): the command line comes through that named pipe once vLLM is
    imported, with the environment to run in (`VLLMServer._hand_off`). Its log's first line says when the
    process started, how long vLLM's import took and how long it then waited for its flags: with the run's
    start-up line (its engines stage), where an engine's start went before vLLM logs anything."""
    now, began = time.time(), time.monotonic()
    started = f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 10)}"  # to a tenth
    initial_env = dict(os.environ)
    pipe = os.open(argv[1], os.O_RDWR) if argv[:1] == ["--handoff"] else None  # held: a writer finds it
    api_server = import_server()
    imported, waited = time.monotonic(), ""
    if pipe is not None:
        argv = _handed_flags(pipe, argv[1], initial_env)
        waited = f", handed its flags {time.monotonic() - imported:.1f} s later"
    print(
        f"molt.vllm_server: started {started}, vLLM's server imported in {imported - began:.1f} s{waited}",
        flush=True,
    )
    import uvloop
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM's OpenAI server, for Molt"))
    args = parser.parse_args(list(argv))
    validate_parsed_serve_args(args)
    uvloop.run(api_server.run_server(args))


def _handed_flags(pipe: int, path: str, initial_env: dict[str, str]) -> list[str]:
    """Wait for the one line `VLLMServer._hand_off` writes into `pipe`; apply its environment where it
    differs from the one this process started with (so what vLLM's import set for itself stays, unless
    the handed environment says otherwise), and return its flags."""
    line = b""
    while not line.endswith(b"\n"):
        line += os.read(pipe, 1 << 16)
    os.close(pipe)
    Path(path).unlink(missing_ok=True)
    handed = json.loads(line)
    os.environ.update({key: value for key, value in handed["env"].items() if initial_env.get(key) != value})
    return handed["argv"]


if __name__ == "__main__":
    serve(sys.argv[1:])
