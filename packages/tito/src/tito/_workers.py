"""`tito serve --workers N`: N processes, each owning the sessions it creates, for N cores' throughput.

A session's trajectory lives in one process's memory, so every request naming the session must reach
that process. Worker i listens on a port of its own (`--port` + 1 + i) and, with every other worker,
on `--port` itself (SO_REUSEPORT: the kernel hands each new connection to one of them). `POST /sessions`
on the shared port creates the session in whichever worker took that connection, and answers with a
`base_url` and `session_url` on that worker's own port, so a client's SDK talks to the owner directly;
that reply closes its connection, so a client that creates its sessions over one kept-alive connection
still spreads them over the workers. A session's id names its owner (`int(id, 16) % N`): a request that
names a session on any other port (a `DELETE` on the shared port, as in the quickstart) is forwarded to
the owner over loopback and its reply relayed, and a client that leaves a forwarded request leaves the
owner's request too (so its turn is not captured, as without workers).

Each worker has its own `Tito` (tokenizer, engine connections, sessions): `--max-sessions` and
`--idle-timeout` hold per worker, and every worker appends whole lines to the one `--dump` file.
This module is what a worker's app needs (`Forward`, `Workers`); `_launch` binds the sockets and starts
the processes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

# Headers that describe one connection, not the request or reply: never passed on (and those the
# relaying server writes itself).
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"date", b"server"}


def session_owner(session_id: str, num_workers: int) -> int | None:
    """The worker that owns `session_id` (None: not a session id tito makes)."""
    if len(session_id) != 32:
        return None
    try:
        return int(session_id, 16) % num_workers
    except ValueError:
        return None


@dataclass(frozen=True)
class Workers:
    """This worker's place among the others: its index, and where worker i listens (`host`, `ports[i]`)."""

    index: int
    host: str
    ports: tuple[int, ...]

    def url(self, index: int) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return f"http://[{host}]:{self.ports[index]}" if ":" in host else f"http://{host}:{self.ports[index]}"


class Forward:
    """ASGI: a request naming a session another worker owns goes to that worker, whole, and its reply
    comes back as it arrives. Everything else is this worker's app."""

    def __init__(self, app, workers: Workers, error, max_body: int) -> None:
        self.app, self.workers, self.error, self.max_body = app, workers, error, max_body
        self.client: httpx.AsyncClient | None = None  # made on the serving loop, on first use

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # the forwarding connections close with the server

            async def closing(message) -> None:
                if message["type"] == "lifespan.shutdown.complete" and self.client is not None:
                    await self.client.aclose()
                await send(message)

            await self.app(scope, receive, closing)
            return
        parts = scope["path"].split("/", 3)  # "", "s" or "sessions", the id, the rest
        named = scope["type"] == "http" and len(parts) > 2 and parts[1] in ("s", "sessions")
        owner = session_owner(parts[2], len(self.workers.ports)) if named else None
        if owner is None or owner == self.workers.index:
            await self.app(scope, receive, send)
        else:
            await self._forward(owner, scope, receive, send)

    async def _forward(self, owner: int, scope, receive, send) -> None:
        from fastapi import Request

        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                refusal = self.error(Request(scope), 413, f"request body over {self.max_body} bytes")
                await refusal(scope, receive, send)
                return
        query = scope["query_string"].decode()
        url = self.workers.url(owner) + scope["raw_path"].decode() + (f"?{query}" if query else "")
        headers = [(name, value) for name, value in scope["headers"] if name not in _HOP]
        if self.client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        gone = asyncio.ensure_future(_disconnect(receive))  # the client leaving ends the owner's request
        replying = asyncio.ensure_future(self.client.send(request, stream=True))
        try:
            await asyncio.wait([gone, replying], return_when=asyncio.FIRST_COMPLETED)
            if not replying.done():
                return
            reply = replying.result()
            try:
                kept = [
                    (n, v) for n, v in reply.headers.raw if n.lower() not in _HOP or n == b"content-length"
                ]
                await send({"type": "http.response.start", "status": reply.status_code, "headers": kept})
                async for chunk in reply.aiter_raw():
                    if gone.done():
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await reply.aclose()
        except httpx.HTTPError as error:
            if not gone.done():
                message = f"worker {owner}, which holds this session, did not answer ({type(error).__name__})"
                await self.error(Request(scope), 503, message, "worker_unavailable")(scope, receive, send)
        finally:
            replying.cancel()
            gone.cancel()


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
