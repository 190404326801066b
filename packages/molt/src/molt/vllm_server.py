"""Start one vLLM OpenAI-compatible server as a subprocess, with the flags Molt's engines need.

An engine for Molt must offer the token-level interface (`/inference/v1/generate`, which vLLM 0.26
serves with no flag), return processed (post-temperature) logprobs so they match the trainer's
recomputation, and expose the RL endpoints (pause, weight transfer, prefix-cache reset), which vLLM
only registers with `VLLM_SERVER_DEV_MODE=1`. On a CPU the fast-start settings below bring a tiny model
up in well under a minute. This module does not place engines (Ray does that); it only starts and
stops one server process and waits until it answers `/health`. The process runs this module
(`python -m molt.vllm_server FLAGS`: vLLM's server, imported so that it can fork its engine core, `serve`).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["VLLMServer", "engine_args", "first_error", "free_port"]


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


def engine_args(model: str | Path, *, port: int, extra: Sequence[str], on_cpu: bool) -> list[str]:
    """The command line of one engine (see the module docstring for why each flag is there), then the
    `extra` flags; a context of 2,048 tokens unless they give `--max-model-len`."""
    context = [] if "--max-model-len" in extra else ["--max-model-len", "2048"]
    args = [
        sys.executable, "-m", "molt.vllm_server",  # vLLM's server (`serve`)
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
    the server's environment on top of this process's (e.g. `refit.engine_env`).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        on_cpu: bool | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if on_cpu is None:
            import torch

            on_cpu = not torch.cuda.is_available()
        self.args = engine_args(model, port=self.port, extra=extra_args, on_cpu=on_cpu)
        self.log_path = Path(log_path or f"/tmp/molt-vllm-{self.port}.log")
        self.env = {**_ENV, **(_CPU_ENV if on_cpu else _GPU_ENV), **os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        """Start the server and wait until it answers `/health` (an exit or a timeout raises with its log)."""
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()  # what it started may live on (a GPU engine core)
                raise RuntimeError(f"vLLM server exited with {self.process.returncode} {self.log_report()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {_START_TIMEOUT_S:.0f} s {self.log_report()}")

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
        """Terminate the whole process group (the server may have children), then reap it."""
        if self.process is None:
            return
        if self.process.poll() is not None:  # it died: what it started may live on (a GPU engine core)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

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
    Its log's first line says when the process started and how long vLLM's import took: with the run's
    start-up line (its engines stage), where an engine's start went before vLLM logs anything."""
    started, began = time.strftime("%H:%M:%S"), time.monotonic()
    api_server = import_server()
    print(
        f"molt.vllm_server: started {started}, vLLM's server imported in {time.monotonic() - began:.1f} s",
        flush=True,
    )
    import uvloop
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM's OpenAI server, for Molt"))
    args = parser.parse_args(list(argv))
    validate_parsed_serve_args(args)
    uvloop.run(api_server.run_server(args))


if __name__ == "__main__":
    serve(sys.argv[1:])
