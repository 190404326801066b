"""tito's HTTP/1.1 client to the engines (`tito._wire`), against a raw socket server that answers what each
test scripts: bodies by length and chunked, keep-alive and `Connection: close`, replies that stall or
break off. The whole path through it (tito over a fake engine on loopback) runs in the transaction
tests' `live_engine_tito`."""

from __future__ import annotations

import asyncio

import pytest

from tito._engines import Engine, EngineRejected
from tito._wire import Http1Wire

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class RawServer:
    """Answers each request with the next scripted bytes; None closes the connection without a reply, and
    ("close", bytes) closes it after the reply."""

    def __init__(self, replies: list) -> None:
        self.replies = replies
        self.requests: list[bytes] = []
        self.connections = 0
        self.handlers: list[asyncio.Task] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc_info) -> None:
        self.server.close()
        await asyncio.wait_for(asyncio.gather(*self.handlers), 5.0)  # each ends when its client closes

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        self.handlers.append(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line[15:])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply is None:
                    break
                writer.write(reply[1] if isinstance(reply, tuple) else reply)
                if isinstance(reply, tuple):
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()


def reply(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{header}\r\n" for header in headers)
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body


def chunked(*chunks: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


async def test_whole_replies_share_one_keep_alive_connection():
    server = RawServer([reply(b'{"a": 1}'), reply(b"", "x-empty: 1"), reply(b"third")])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        assert await wire.request("POST", f"{url}/generate", b'{"q": 1}') == (200, b'{"a": 1}')
        assert await wire.request("GET", f"{url}/health") == (200, b"")
        assert await wire.request("GET", f"{url}/v1/models?x=1") == (200, b"third")
        await wire.aclose()
    assert server.connections == 1
    first, second, third = server.requests
    assert first.startswith(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 8\r\n" in first and first.endswith(b'\r\n\r\n{"q": 1}')
    assert second.startswith(b"GET /health HTTP/1.1") and b"Content-Length" not in second
    assert third.startswith(b"GET /v1/models?x=1 HTTP/1.1")


async def test_a_chunked_stream_arrives_as_lines():
    events = chunked(b"data: 1\n\n", b"data: 2\n", b"\ndata: [DO", b"NE]\n\n")
    server = RawServer([events, reply(b"after")])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        async with wire.stream(f"{url}/generate", b"{}") as (status, lines):
            assert status == 200
            assert [line async for line in lines] == [b"data: 1", b"", b"data: 2", b"", b"data: [DONE]", b""]
        assert await wire.request("GET", f"{url}/health") == (200, b"after")  # the same connection
        await wire.aclose()
    assert server.connections == 1


async def test_a_connection_the_server_closes_is_not_reused():
    said = ("close", reply(b"one", "connection: close"))  # the server says it closes
    silent = ("close", reply(b"two"))  # it closes without saying so, before the next request
    server = RawServer([said, silent, reply(b"three"), reply(b"four")])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        assert await wire.request("GET", f"{url}/a") == (200, b"one")
        assert await wire.request("GET", f"{url}/b") == (200, b"two")
        await asyncio.sleep(0.1)  # the server's close reaches the pooled connection
        assert await wire.request("GET", f"{url}/c") == (200, b"three")
        assert await wire.request("GET", f"{url}/d") == (200, b"four")
        await wire.aclose()
    assert server.connections == 3


async def test_a_reply_that_breaks_off_or_stalls_raises_and_is_not_pooled():
    server = RawServer([None, b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", reply(b"ok")])
    async with server as url:
        wire = Http1Wire(timeout=0.3)
        with pytest.raises(EOFError):  # closed before any reply
            await wire.request("GET", f"{url}/a")
        with pytest.raises(TimeoutError):  # five of ten bytes, then silence
            await wire.request("GET", f"{url}/b")
        assert await wire.request("GET", f"{url}/c") == (200, b"ok")
        await wire.aclose()
    assert server.connections == 3


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    ],
    ids=["no-status", "length-not-a-number", "negative-length"],
)
async def test_a_reply_head_that_is_not_http_is_a_broken_connection_and_is_not_pooled(head):
    server = RawServer([head, head, reply(b"ok")])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        with pytest.raises(ConnectionError, match="malformed reply head"):  # an engine's fault: OSError
            await wire.request("GET", f"{url}/a")
        with pytest.raises(ConnectionError, match="malformed reply head"):
            async with wire.stream(f"{url}/generate", b"{}"):
                pass
        assert await wire.request("GET", f"{url}/c") == (200, b"ok")
        await wire.aclose()
    assert server.connections == 3


@pytest.mark.parametrize(
    "chunks",
    [
        b"-5\r\nhello\r\n0\r\n\r\n",
        b"-1\r\nx0\r\n\r\n",  # reads on as an empty body
        # five bytes sent as a chunk of four: the fifth stands where the chunk's CRLF belongs, and the rest
        # ("\n0\r\n") reads as the last chunk's size line, so unchecked it ends a body one byte short
        b"4\r\nabcde\r\n0\r\n\r\n",
    ],
    ids=["minus-five", "minus-one", "size-line-miscounts"],
)
async def test_a_malformed_chunk_is_a_broken_reply(chunks):
    body = ("close", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks)
    server = RawServer([body, body])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        with pytest.raises(ConnectionError, match="malformed chunk"):
            await wire.request("GET", f"{url}/a")
        with pytest.raises(ConnectionError, match="malformed chunk"):
            async with wire.stream(f"{url}/generate", b"{}") as (_, lines):
                assert [line async for line in lines]
        await wire.aclose()


async def test_a_stream_left_before_its_end_closes_its_connection():
    server = RawServer([chunked(b"data: 1\n\n", b"data: 2\n\n"), reply(b"after")])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        async with wire.stream(f"{url}/generate", b"{}") as (_, lines):
            assert await anext(lines) == b"data: 1"
        assert await wire.request("GET", f"{url}/health") == (200, b"after")  # not the unread remains
        await wire.aclose()
    assert server.connections == 2


async def test_an_error_raised_while_reading_a_stream_reaches_the_caller_as_it_was():
    refusal = b'HTTP/1.1 400 Bad Request\r\ncontent-length: 14\r\n\r\n{"error": "x"}'
    broken = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
    server = RawServer([refusal, broken])
    async with server as url:
        wire = Http1Wire(timeout=5.0)
        with pytest.raises(ValueError, match="refused"):  # e.g. the engine client's EngineRejected
            async with wire.stream(f"{url}/generate", b"{}") as (status, lines):
                assert status == 400 and [line async for line in lines] == [b'{"error": "x"}']
                raise ValueError("refused")
        with pytest.raises(ConnectionError, match="malformed chunk size"):  # a broken reply is OSError
            async with wire.stream(f"{url}/generate", b"{}") as (status, lines):
                assert [line async for line in lines]
        await wire.aclose()


async def test_an_engine_that_refuses_a_streamed_request_is_a_refusal_not_a_dead_engine():
    refusal = b'HTTP/1.1 400 Bad Request\r\ncontent-length: 23\r\n\r\n{"error": "bad prompt"}'
    async with RawServer([refusal]) as url:
        engine = Engine(url, Http1Wire(timeout=5.0))
        chunks = await engine.generate([1, 2], {"max_tokens": 4}, stream=True)
        with pytest.raises(EngineRejected, match="refused the request .400.: .*bad prompt"):
            async for _ in chunks:
                pass
        assert engine.alive
        await engine.wire.aclose()
