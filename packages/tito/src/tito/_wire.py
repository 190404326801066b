"""HTTP/1.1 to the engines: keep-alive connections, whole replies and streamed ones, nothing else.

Every turn costs one engine request, so the client's own CPU per request is part of tito's: aiohttp's
was 0.17-0.19 ms here (URL and header objects, cookies, tracing, a timer per read), this one's 0.08 ms.
It speaks exactly what a vLLM server answers tito (uvicorn behind FastAPI): a
`Content-Length` or chunked body, keep-alive unless the server says `Connection: close`. A request that
breaks off raises an `OSError` (`ConnectionError`, or `TimeoutError` past the timeout) or an `EOFError`.

A connection idle for `KEEP_IDLE_S` is not reused: vLLM's server closes idle connections after 5 s, and
a request sent on one just as it closes would break off. One that failed or was abandoned mid-reply is
closed, never pooled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from functools import lru_cache
from urllib.parse import urlsplit

KEEP_IDLE_S = 2.0
CONNECT_TIMEOUT_S = 5.0


@lru_cache(maxsize=256)
def _target(url: str) -> tuple[str, int, str, bytes]:
    """(host, port, path with query, the request's Host header line) of an http URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"engine URL {url!r}: tito speaks plain http to engines (http://host:port)")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, path, f"Host: {parts.netloc}\r\n".encode()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0


class Http1Wire:
    """Engine traffic over keep-alive HTTP/1.1 connections. `timeout`: seconds a reply may keep the
    client waiting for its next byte."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def request(
        self, method: str, url: str, body: bytes | None = None, *, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """One request and its whole reply: (status, body)."""
        host, port, path, host_line = _target(url)
        connection = await self._connection(host, port)
        try:
            async with asyncio.timeout(timeout or self.timeout):  # the whole exchange, on this task
                status, length, chunked, keep = await _exchange(connection, method, path, host_line, body)
                if length is not None and not chunked:
                    data = await connection.reader.readexactly(length)
                else:
                    data = b"".join([chunk async for chunk in _chunks(connection.reader, chunked, None, [])])
        except BaseException:
            connection.writer.close()
            raise
        self._release(host, port, connection, keep)
        return status, data

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: bytes) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """A POST whose reply is read as it arrives: (status, its body's lines). Each read waits at most
        `timeout`: a timer per read, not one around the body, which is read on whichever task serves
        the client. The connection is pooled again only if the body was read to its end."""
        host, port, path, host_line = _target(url)
        connection = await self._connection(host, port)
        done: list[bool] = []
        try:
            exchange = _exchange(connection, "POST", path, host_line, body)
            status, length, chunked, keep = await asyncio.wait_for(exchange, self.timeout)
            # What the caller raises while reading (an engine's refusal) reaches it as it was raised.
            yield status, _lines(_chunks(connection.reader, chunked, length, done, self.timeout))
        except BaseException:
            connection.writer.close()
            raise
        self._release(host, port, connection, keep and bool(done))

    async def aclose(self) -> None:
        for pool in self._idle.values():
            for connection in pool:
                connection.writer.close()
        self._idle.clear()

    def _release(self, host: str, port: int, connection: _Connection, keep: bool) -> None:
        if not keep:
            connection.writer.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault((host, port), []).append(connection)

    async def _connection(self, host: str, port: int) -> _Connection:
        pool = self._idle.get((host, port), [])
        while pool:
            connection = pool.pop()
            if time.monotonic() - connection.idle_since < KEEP_IDLE_S and not connection.reader.at_eof():
                return connection
            connection.writer.close()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        return _Connection(reader, writer)


async def _exchange(connection: _Connection, method: str, path: str, host_line: bytes, body: bytes | None):
    """Send the request; read the reply's status line and headers: (status, content length or None,
    chunked, keep-alive). A head that is not HTTP as this client reads it is a broken reply."""
    head = f"{method} {path} HTTP/1.1\r\n".encode() + host_line
    if body is not None:
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    connection.writer.write(head + b"\r\n" + (body or b""))
    lines = (await connection.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
    try:
        version, status = lines[0].split(b" ", 2)[:2]
        length, chunked, keep = None, False, version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"connection":
                keep = value == b"keep-alive" or (keep and value != b"close")
        if length is not None and length < 0:
            raise ValueError(f"negative content-length {length}")
        return int(status), length, chunked, keep and (chunked or length is not None)
    except ValueError as error:
        raise ConnectionError(f"malformed reply head ({host_line.decode().strip()}): {error}") from error


async def _chunks(reader, chunked: bool, length: int | None, done: list, timeout: float | None = None):
    """A reply body's chunks as they arrive, each read within `timeout` (None: the caller times the
    whole exchange); `done` gets an entry once the body was read to its end."""

    def within(step):
        return step if timeout is None else asyncio.wait_for(step, timeout)

    if not chunked:
        if length is None:
            yield await within(reader.read())  # the server closes the connection at the end
        elif length:
            yield await within(reader.readexactly(length))
        done.append(True)
        return
    while size := _chunk_size(await within(reader.readuntil(b"\r\n"))):
        chunk = await within(reader.readexactly(size + 2))
        if chunk[size:] != b"\r\n":  # a size line that miscounts its data would read on as other bytes
            raise ConnectionError(f"malformed chunk: {size} bytes, then {chunk[size:]!r} where CRLF ends it")
        yield chunk[:size]
    while await within(reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
        pass
    done.append(True)


def _chunk_size(line: bytes) -> int:
    """A chunk's size line (hex digits, maybe extensions after `;`); anything else is a broken reply."""
    with contextlib.suppress(ValueError):
        if (size := int(line.split(b";", 1)[0], 16)) >= 0:  # `int` reads a sign, which no chunk size has
            return size
    raise ConnectionError(f"malformed chunk size {line[:40]!r}")


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Body chunks re-cut into lines (without their line ends), as an SSE stream is read."""
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r")
    if pending:
        yield pending
