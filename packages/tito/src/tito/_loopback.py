"""Serve an ASGI app (tito's) with uvicorn on the caller's running event loop, on loopback.

A program that embeds tito (molt's trainer) keeps its sessions on its own event loop and hands their
URLs to agents in other processes; serving the app on that same loop avoids locks between two loops.
The host program keeps Ctrl-C: uvicorn's own signal capture is switched off.

Serving freezes the objects the process holds at that moment out of cyclic garbage collection
(`freeze_startup_objects`): on the one event loop that serves every session, a full collection of a
heap that imported torch and transformers stalls every request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator

import uvicorn

# How long the server keeps an idle client connection open. Well past the 5 s after which httpx's pool
# (under the openai and anthropic SDKs) drops an idle connection, so the client always closes first:
# at uvicorn's default of 5 s the server could close a connection just as a busy client, whose clock
# started later, sent its next request on it, and that request failed (httpx.ReadError).
KEEP_ALIVE_S = 75


def freeze_startup_objects() -> None:
    """Leave the objects that exist now out of cyclic garbage collection from here on (`gc.freeze`).

    What a server holds when it starts (modules, the tokenizer, the host program's setup) lives as long
    as it does, yet every full collection walks it: with torch and transformers imported that is
    hundreds of thousands of objects, and one collection held the serving loop for 270 ms on a 2-core
    machine while 64 requests waited. Objects made afterwards are collected as before.
    """
    gc.collect()
    gc.freeze()


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the embedding program decides what Ctrl-C does
        yield


@contextlib.asynccontextmanager
async def serve_on_loop(app, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """`async with serve_on_loop(app) as url:` serves `app` until the block ends. `port=0`: any free one.

    The app's lifespan is not run: whoever made the app's resources (a `Tito`) closes them.
    """
    freeze_startup_objects()
    listening = socket.create_server((host, port))  # bound here: a taken port is an OSError, not an exit
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
    server = _QuietServer(config)
    serving = asyncio.create_task(server.serve(sockets=[listening]), name="tito-http")
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError(f"tito's HTTP server on {host}:{port} stopped before it started")
        await asyncio.sleep(0.01)
    try:
        yield f"http://{host}:{listening.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving
        listening.close()
