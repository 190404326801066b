"""vLLM engines spoken to through their token-level interface, and session-sticky routing.

An engine is a vLLM server started with `--enable-scale-out` (for `POST /inference/v1/generate`) and,
for training, `--logprobs-mode processed_logprobs`. tito sends token ids and receives token ids, the
logprob of each sampled token and the weight version that sampled it; it never asks an engine to
apply a chat template. An engine that stops answering fails only the requests sent to it
(`EngineUnavailable`), and new sessions stop going to it.

Images: tito's prompt holds each image's placeholder expanded (the token layout the trainer sees). The
engine expands placeholders itself when it processes the image bytes, so it is sent the prompt with
each image's span collapsed back to one placeholder, the images as `content_parts` (data URLs), and
`return_token_ids`; its reply's expanded prompt and placeholder ranges must equal tito's, or the turn
fails with `ExpansionMismatch` (tito and the engine would otherwise train and sample on different
token layouts).

Engine traffic goes over tito's own keep-alive HTTP/1.1 client (`_wire.py`): per request it costs
less than half of aiohttp's CPU, and a small fraction of httpx's, whose connection pool scans every
connection for each queued request. Tests that hand `Router` an httpx transport (a fake engine in the same
process) are served through httpx instead, behind the same calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import msgspec

from ._wire import Http1Wire

__all__ = ["Engine", "EngineRejected", "EngineUnavailable", "ExpansionMismatch", "Generation", "Router"]

# What a request that broke off raises, from either client (`TimeoutError` is an `OSError`).
_BROKEN = (OSError, EOFError, httpx.TransportError)
_JSON = {"content-type": "application/json"}


class EngineUnavailable(RuntimeError):
    """The engine a session is bound to did not answer."""


class EngineRejected(ValueError):
    """The engine refused the request as malformed (a 4xx): the client's mistake, not the engine's."""


class ExpansionMismatch(RuntimeError):
    """The engine expanded a prompt's image placeholders differently from tito's processor."""


@dataclass
class Generation:
    """Sampled tokens of one turn, or one streamed chunk of it.

    vLLM reports weight versions as spans over the whole output (`[start, end)` sampled by `version`),
    and a stream reports them only in its last chunk: `versions` is complete once the turn is.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, when one ended the turn
    routed_experts: str | None = None  # MoE routes of the whole request, last chunk only (`_Choice`)

    @property
    def versions(self) -> list[int]:
        """The weight version of each sampled token (0 where the engine reported none: initial weights)."""
        versions = [0] * len(self.token_ids)
        for version, start, end in self.spans:
            versions[start:end] = [version] * (end - start)
        assert len(versions) == len(self.token_ids), "weight-version spans run past the sampled tokens"
        return versions

    def extend(self, chunk: Generation) -> None:
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.spans += chunk.spans
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.stop_reason = chunk.stop_reason if chunk.stop_reason is not None else self.stop_reason
        self.routed_experts = chunk.routed_experts or self.routed_experts


# The fields of vLLM's generate reply that tito reads; msgspec skips the rest without building it.
class _Logprob(msgspec.Struct):
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _Span(msgspec.Struct):
    version: str | int
    start: int
    end: int


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[_Span] | None = None
    # An engine started with `--enable-return-routed-experts`: base64 `.npy`, (tokens, layers, top_k),
    # the experts every forwarded token of the request went to, from `routed_experts_prompt_start` on.
    routed_experts: str | None = None


class _Placeholder(msgspec.Struct):
    offset: int
    length: int


class _Reply(msgspec.Struct):
    choices: list[_Choice] = []
    prompt_token_ids: list[int] | None = None  # asked for with images: the engine's expanded prompt
    mm_placeholders: dict[str, list[_Placeholder]] | None = None


_decode_reply = msgspec.json.Decoder(_Reply).decode


def _version(label: str | int) -> int:
    """Trainers label weight versions with integers; vLLM labels its initial weights "default" (0)."""
    if isinstance(label, int):
        return label
    return int(label) if label.lstrip("-").isdigit() else 0


def _generation(reply: _Reply) -> Generation | None:
    if not reply.choices:
        return None
    choice = reply.choices[0]
    return Generation(
        token_ids=choice.token_ids or [],
        logprobs=[entry.logprob for entry in (choice.logprobs and choice.logprobs.content) or ()],
        spans=[(_version(s.version), s.start, s.end) for s in choice.weight_versions or ()],
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        routed_experts=choice.routed_experts,
    )


class Engine:
    """One vLLM server. Counts the sessions bound to it and the requests it is serving."""

    def __init__(self, url: str, wire: Http1Wire | _HttpxWire) -> None:
        self.url = url.rstrip("/")
        self.generate_url = f"{self.url}/inference/v1/generate"
        self.wire = wire
        self.num_sessions = 0
        self.num_in_flight = 0
        self.alive = True
        self._max_model_len: int | None = None

    async def generate(
        self,
        token_ids: list[int],
        sampling: dict,
        *,
        images: list = (),
        stream: bool = False,
        routes_from: int = 0,
    ):
        """Sample on this engine: one `Generation`, or with `stream` an async iterator of chunks.
        `images`: the prompt's `ImageSpan`s (module docstring). `routes_from`: the leading prompt tokens
        whose MoE routes the caller already holds; an engine that returns routes skips those."""
        # tito reads token ids only, so the engine skips detokenizing, unless stop strings need the text.
        params = {**sampling, "logprobs": 0, "detokenize": bool(sampling.get("stop"))}
        if routes_from:
            params["routed_experts_prompt_start"] = routes_from
        body = {"token_ids": token_ids, "sampling_params": params, "stream": stream}
        if images:
            body["token_ids"] = _collapsed(token_ids, images)
            body["content_parts"] = [{"type": "image_url", "url": image.data_url} for image in images]
            body["return_token_ids"] = True
        expected = (token_ids, images) if images else None
        return self._stream(body, expected) if stream else await self._whole(body, expected)

    async def _whole(self, body: dict, expected: tuple | None) -> Generation:
        with self._serving():
            try:
                status, data = await self.wire.request("POST", self.generate_url, msgspec.json.encode(body))
            except _BROKEN as error:
                raise await self._failed(error) from error
            self._check(status, data)
            reply = _decode_reply(data)
            _check_expansion(reply, expected)
            generation = _generation(reply)
            assert generation is not None, "the engine's reply has no choices"
            return generation

    async def _stream(self, body: dict, expected: tuple | None) -> AsyncIterator[Generation]:
        with self._serving():
            try:
                async with self.wire.stream(self.generate_url, msgspec.json.encode(body)) as (status, lines):
                    if status != 200:
                        self._check(status, b"".join([line async for line in lines]))
                    async for line in lines:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        reply = _decode_reply(line[len(b"data: ") :])
                        _check_expansion(reply, expected)  # the first chunk carries the prompt
                        expected = None
                        if (chunk := _generation(reply)) is not None:
                            yield chunk
            except _BROKEN as error:
                raise await self._failed(error) from error

    @contextlib.contextmanager
    def _serving(self):
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    async def _failed(self, error: Exception) -> EngineUnavailable:
        """A request broke off. The engine counts as dead only if `/health` does not answer either: a
        dropped connection fails that request, not every later session."""
        self.alive = await self.healthy()
        state = "dropped the request" if self.alive else "is not answering"
        return EngineUnavailable(f"engine {self.url} {state} ({type(error).__name__})")

    def _check(self, status: int, body: bytes) -> None:
        detail = body[:500].decode(errors="replace")
        if 400 <= status < 500:
            raise EngineRejected(f"the engine refused the request ({status}): {detail}")
        if status != 200:
            raise EngineUnavailable(f"engine {self.url} answered {status}: {detail}")

    async def healthy(self) -> bool:
        try:
            status, _ = await self.wire.request("GET", f"{self.url}/health", timeout=5.0)
        except _BROKEN:
            return False
        return status == 200

    async def max_model_len(self) -> int:
        """The engine's context length (asked once)."""
        if self._max_model_len is None:
            try:
                status, data = await self.wire.request("GET", f"{self.url}/v1/models")
            except _BROKEN as error:
                raise await self._failed(error) from error
            self._check(status, data)
            self._max_model_len = int(msgspec.json.decode(data)["data"][0]["max_model_len"])
        return self._max_model_len


def _collapsed(token_ids: list[int], images: list) -> list[int]:
    """The prompt with each image's placeholder span reduced to its first token, as the engine takes it."""
    collapsed, start = [], 0
    for image in images:
        collapsed += token_ids[start : image.offset + 1]
        start = image.offset + image.length
    return collapsed + token_ids[start:]


def _check_expansion(reply: _Reply, expected: tuple | None) -> None:
    """The engine's expanded prompt and image ranges must be tito's (module docstring)."""
    if expected is None:
        return
    token_ids, images = expected
    ours = [(image.offset, image.length) for image in images]
    theirs = [(p.offset, p.length) for p in (reply.mm_placeholders or {}).get("image", [])]
    if reply.prompt_token_ids != token_ids or theirs != ours:
        raise ExpansionMismatch(
            f"the engine expanded this prompt's images to (offset, length) {theirs} and "
            f"{len(reply.prompt_token_ids or [])} prompt tokens; tito's processor gave {ours} and "
            f"{len(token_ids)}: serve the engine and tito from the same model directory"
        )


class _HttpxWire:
    """Engine traffic over httpx, for an httpx transport (tests: a fake engine in the same process)."""

    def __init__(self, timeout: float, transport: httpx.AsyncBaseTransport) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), transport=transport)

    async def request(
        self, method: str, url: str, body: bytes | None = None, *, timeout: float | None = None
    ) -> tuple[int, bytes]:
        headers = _JSON if body is not None else None
        reply = await self.client.request(method, url, content=body, headers=headers, timeout=timeout)
        return reply.status_code, reply.content

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: bytes) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        async with self.client.stream("POST", url, content=body, headers=_JSON) as reply:
            yield reply.status_code, (line.encode() async for line in reply.aiter_lines())

    async def aclose(self) -> None:
        await self.client.aclose()


class Router:
    """Binds each new session to the least-loaded live engine; a session never moves."""

    def __init__(
        self, urls: list[str], *, timeout: float = 600.0, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        if not urls:
            raise ValueError("tito needs at least one engine URL")
        self.wire = Http1Wire(timeout) if transport is None else _HttpxWire(timeout, transport)
        self.engines = [Engine(url, self.wire) for url in urls]

    def assign(self) -> Engine:
        live = [engine for engine in self.engines if engine.alive]
        if not live:
            raise EngineUnavailable("no engine is answering")
        engine = min(live, key=lambda e: (e.num_in_flight, e.num_sessions))
        engine.num_sessions += 1
        return engine

    def release(self, engine: Engine) -> None:
        engine.num_sessions -= 1

    async def aclose(self) -> None:
        await self.wire.aclose()
