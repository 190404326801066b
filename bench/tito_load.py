"""The engine stand-in and the load generator of `tito_throughput.py`, each run in processes of its own.

The stand-in is a raw asyncio HTTP/1.1 server on an SO_REUSEPORT port that answers vLLM's token route
at once, always with the same tokens (and `/v1/models`, `/health`), so that a server in front of it
spends only its own CPU. The load generator speaks raw HTTP/1.1 over keep-alive connections, one
request at a time per conversation as an SDK client would, with the openai SDK's headers and body: a
tenth of the SDK's CPU per request, so that a few load processes can saturate many tito workers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

MODEL = "tiny"
WORDS = ("fox", "cat", "dog", "owl", "bee")
# The headers the openai SDK (AsyncOpenAI) sends with each request, so tito parses what it would.
SDK_HEADERS = (
    "Accept: application/json\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
    "Content-Type: application/json\r\nUser-Agent: AsyncOpenAI/Python 2.8.0\r\nX-Stainless-Lang: python\r\n"
    "X-Stainless-Package-Version: 2.8.0\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
    "X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.12.1\r\nAuthorization: Bearer x\r\n"
    "X-Stainless-Async: async:asyncio\r\nx-stainless-retry-count: 0\r\nx-stainless-read-timeout: 600\r\n"
)


def run_loop(main) -> object:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# ---- the engine stand-in -----------------------------------------------------------------------------


def _http_reply(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _EngineProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one canned reply per path, sent as soon as a request's body is in."""

    def __init__(self, replies: dict[bytes, bytes]) -> None:
        self.replies, self.buffer, self.transport = replies, b"", None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            path = head.split(b" ", 2)[1]
            self.transport.write(self.replies.get(path) or _http_reply(b"{}", "404 Not Found"))


def serve_engine(port: int, reply_ids: list[int]) -> None:
    """The engine stand-in's process: vLLM's token-route reply shape, the same tokens every time."""
    choice = {
        "index": 0,
        "token_ids": reply_ids,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in reply_ids]},
        "finish_reason": "stop",
        "stop_reason": reply_ids[-1],
        "weight_versions": [{"version": "default", "start": 0, "end": len(reply_ids)}],
    }
    models = {"data": [{"id": "stand-in", "max_model_len": 4096}]}
    replies = {
        b"/inference/v1/generate": _http_reply(json.dumps({"choices": [choice]}).encode()),
        b"/v1/models": _http_reply(json.dumps(models).encode()),
        b"/health": _http_reply(b"{}"),
    }

    async def main() -> None:
        listening = socket.socket()
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listening.bind(("127.0.0.1", port))
        listening.listen(4096)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _EngineProtocol(replies), sock=listening)
        await server.serve_forever()

    run_loop(main())


# ---- the load generator ------------------------------------------------------------------------------


class _Connection:
    """One keep-alive HTTP/1.1 connection; requests one at a time, as an SDK client sends them."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port, self.reader, self.writer = host, port, None, None

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{SDK_HEADERS}"
        if body is not None:
            head += f"Content-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value.strip().lower() == b"close"
        data = await self.reader.readexactly(length)
        if close:
            self.close()
        return int(lines[0].split(b" ", 2)[1]), data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def drive(target: str, port: int, num_conversations: int, num_turns: int, begin: float, end: float) -> dict:
    """One load process: conversations back to back until `end`; what completed in [begin, end]."""
    return run_loop(_drive(target, port, num_conversations, num_turns, begin, end))


async def _drive(target: str, port: int, num_conversations: int, num_turns: int, begin: float, end: float):
    import msgspec

    decode = msgspec.json.decode
    window = {"turns": 0, "errors": 0, "latencies": [], "prompt_tokens": 0, "completion_tokens": 0}

    async def conversation(index: int, front: _Connection) -> None:
        if target == "tito":  # a session per conversation; its turns go to its base_url
            status, data = await front.request("POST", "/sessions")
            assert status == 200, data
            session = decode(data)
            host_port, path = session["base_url"].removeprefix("http://").split("/", 1)
            chat = _Connection("127.0.0.1", int(host_port.rsplit(":", 1)[1]))
            prefix = f"/{path}"
        else:
            chat, prefix = front, "/v1"
        messages = [{"role": "system", "content": "answer with one word"}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": f"copy the word: {WORDS[(index + turn) % 5]}"})
            body = {"messages": messages, "model": MODEL, "max_tokens": 32, "temperature": 0.0}
            began = time.time()
            status, data = await chat.request("POST", f"{prefix}/chat/completions", msgspec.json.encode(body))
            now = time.time()
            if status != 200:
                raise RuntimeError(f"chat completion answered {status}: {data[:300]!r}")
            reply = decode(data)
            if begin <= now <= end:
                window["turns"] += 1
                window["latencies"].append(now - began)
                window["prompt_tokens"] += reply["usage"]["prompt_tokens"]
                window["completion_tokens"] += reply["usage"]["completion_tokens"]
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        if target == "tito":
            status, data = await chat.request("DELETE", f"/sessions/{session['id']}")
            assert status == 200, data
            chat.close()

    async def slot(index: int) -> None:
        front = _Connection("127.0.0.1", port)
        while time.time() < end:
            await conversation(index, front)
            index += num_conversations

    async def clock(at: float, key: str) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        window[key] = time.process_time()

    clocks = [asyncio.create_task(clock(begin, "cpu_begin")), asyncio.create_task(clock(end, "cpu_end"))]
    slots = [asyncio.create_task(slot(index)) for index in range(num_conversations)]
    await asyncio.wait(slots, timeout=max(0.0, end - time.time()) + 0.05)
    for task in slots:
        task.cancel()
    results = await asyncio.gather(*slots, *clocks, return_exceptions=True)
    failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
    if failures:
        raise RuntimeError(f"{len(failures)} conversations failed, the first with {failures[0]!r}")
    window["cpu"] = window.pop("cpu_end") - window.pop("cpu_begin")
    return window
