"""`tito serve --workers N`: bind the sockets, start the N worker processes, stop them together.

How the workers share the sessions (a port of their own each, one shared port, forwarding to a session's
owner) is `_workers`'s; this module sits above the server: each worker builds its own `Tito` and app
(`_server.create_app`) and serves them with uvicorn.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import socket
from multiprocessing.connection import wait

import uvicorn

from ._loopback import KEEP_ALIVE_S, freeze_startup_objects
from ._server import create_app
from ._service import Tito
from ._workers import Workers


def serve_workers(num_workers: int, host: str, port: int, tito_args: dict, api_key: str | None) -> None:
    """Bind every socket here (a port in use fails before anything loads), start the workers, and run
    until one of them ends (then stop the others) or this process is told to stop."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shared, own = [], []
    for index in range(num_workers):
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listening.bind((host, port))
        shared.append(listening)
        own.append(socket.create_server((host, port + 1 + index), family=family))
    for listening in shared:
        listening.listen(2048)
    ports = tuple(port + 1 + index for index in range(num_workers))
    spawn = multiprocessing.get_context("spawn")  # each worker imports and loads on its own
    processes = [
        spawn.Process(
            target=_worker,
            args=(Workers(index, host, ports), shared[index], own[index], tito_args, api_key),
            name=f"tito-worker-{index}",
        )
        for index in range(num_workers)
    ]
    for process in processes:
        process.start()
    for listening in shared + own:
        listening.close()  # the workers hold their own copies
    signal.signal(signal.SIGTERM, _exit)  # so that `finally` below stops the workers
    try:
        wait([process.sentinel for process in processes])
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn shuts down, closing engine connections
        for process in processes:
            process.join(timeout=30)
    codes = [process.exitcode for process in processes]
    if any(code not in (0, -15) for code in codes):
        raise SystemExit(f"tito workers ended with exit codes {codes}")


def _exit(*_) -> None:
    raise SystemExit(0)


def _worker(workers: Workers, shared: socket.socket, own: socket.socket, tito_args: dict, api_key) -> None:
    PR_SET_PDEATHSIG = 1  # a worker stops when the process that started it dies, even by SIGKILL
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    tito = Tito(**tito_args, worker=(workers.index, len(workers.ports)))
    app = create_app(tito, api_key=api_key, workers=workers)
    freeze_startup_objects()
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    uvicorn.Server(config).run(sockets=[shared, own])
