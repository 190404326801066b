"""vLLM engines spoken to through their token-level interface, and session-sticky routing.

An engine is a vLLM server started with `--enable-scale-out` (for `POST /inference/v1/generate`) and,
for training, `--logprobs-mode processed_logprobs`. tito sends token ids and receives token ids, the
logprob of each sampled token and the weight version that sampled it; it never asks an engine to
apply a chat template. An engine that stops answering fails only the requests sent to it
(`EngineUnavailable`), and new sessions stop going to it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

__all__ = ["Engine", "EngineRejected", "EngineUnavailable", "Generation", "Router"]


class EngineUnavailable(RuntimeError):
    """The engine a session is bound to did not answer."""


class EngineRejected(ValueError):
    """The engine refused the request as malformed (a 4xx): the client's mistake, not the engine's."""


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


def _version(label: str) -> int:
    """Trainers label weight versions with integers; vLLM labels its initial weights "default" (0)."""
    return int(label) if label.lstrip("-").isdigit() else 0


def _parse_choice(choice: dict) -> Generation:
    content = (choice.get("logprobs") or {}).get("content") or []
    spans = [(_version(s["version"]), s["start"], s["end"]) for s in choice.get("weight_versions") or []]
    return Generation(
        token_ids=list(choice.get("token_ids") or []),
        logprobs=[entry["logprob"] for entry in content],
        spans=spans,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
    )


class Engine:
    """One vLLM server. Counts the sessions bound to it and the requests it is serving."""

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self.generate_url = f"{self.url}/inference/v1/generate"
        self.client = client
        self.num_sessions = 0
        self.num_in_flight = 0
        self.alive = True
        self._max_model_len: int | None = None

    async def generate(self, token_ids: list[int], sampling: dict, *, stream: bool = False):
        """Sample on this engine: one `Generation`, or with `stream` an async iterator of chunks."""
        body = {"token_ids": token_ids, "sampling_params": {**sampling, "logprobs": 0}, "stream": stream}
        return self._stream(body) if stream else await self._whole(body)

    async def _whole(self, body: dict) -> Generation:
        with self._serving():
            try:
                reply = await self.client.post(self.generate_url, json=body)
            except httpx.TransportError as error:
                raise await self._failed(error) from error
            self._check(reply.status_code, reply.text)
            return _parse_choice(reply.json()["choices"][0])

    async def _stream(self, body: dict) -> AsyncIterator[Generation]:
        with self._serving():
            try:
                async with self.client.stream("POST", self.generate_url, json=body) as reply:
                    if reply.status_code != 200:
                        self._check(reply.status_code, (await reply.aread()).decode(errors="replace"))
                    async for line in reply.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            choices = json.loads(line[len("data: ") :]).get("choices") or []
                            if choices:
                                yield _parse_choice(choices[0])
            except httpx.TransportError as error:
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

    def _check(self, status: int, detail: str) -> None:
        if 400 <= status < 500:
            raise EngineRejected(f"the engine refused the request ({status}): {detail[:500]}")
        if status != 200:
            raise EngineUnavailable(f"engine {self.url} answered {status}: {detail[:500]}")

    async def healthy(self) -> bool:
        try:
            return (await self.client.get(f"{self.url}/health", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    async def max_model_len(self) -> int:
        """The engine's context length (asked once)."""
        if self._max_model_len is None:
            try:
                reply = await self.client.get(f"{self.url}/v1/models")
            except httpx.TransportError as error:
                raise await self._failed(error) from error
            self._check(reply.status_code, reply.text)
            self._max_model_len = int(reply.json()["data"][0]["max_model_len"])
        return self._max_model_len


class Router:
    """Binds each new session to the least-loaded live engine; a session never moves."""

    def __init__(
        self, urls: list[str], *, timeout: float = 600.0, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        if not urls:
            raise ValueError("tito needs at least one engine URL")
        # Idle connections are dropped before vLLM's server closes them (its keep-alive is 5 s): reusing
        # one the server is closing at that moment breaks the request off. A small idle pool: httpcore
        # scans every pooled connection per queued request, which at 256 cost ~5 ms of CPU per request.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=5.0), limits=limits, transport=transport
        )
        self.engines = [Engine(url, self.client) for url in urls]

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
        await self.client.aclose()
