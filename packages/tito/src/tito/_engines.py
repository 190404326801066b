"""vLLM engines spoken to through their token-level interface, and session-sticky routing.

An engine is a vLLM server (it serves `POST /inference/v1/generate` as it is) started, for training,
with `--logprobs-mode processed_logprobs`. tito sends token ids and receives token ids, the logprob of
each sampled token and, from an engine with refit's flags (`refit.engine_flags`: vLLM 0.26 keeps no
weight version itself), the weight version that sampled it; it never asks an engine to apply a chat
template. With `engine_model`, every request names that model: a LoRA adapter the engines serve
(vLLM's `--lora-modules NAME=DIR`), which a trainer refits in place. An engine that stops answering
fails only the requests sent to it (`EngineUnavailable`), and new sessions stop going to it; one
restarted by its owner takes its place (`Router.replace`).

Images: tito's prompt holds each image's placeholder expanded (the token layout the trainer sees), and
goes to the engine as it is, with the images as vLLM's processed features (`features`: their tensors
and hashes, placed at tito's placeholder ranges). The features are the engine's own: its render
endpoint (`/v1/chat/completions/render`) processes the images alone, once per image (kept by hash).
The length it gives each image's placeholder must be tito's, or the turn fails with `ExpansionMismatch`
(tito and the engine would otherwise train and sample on different token layouts).

Engine traffic goes over tito's own keep-alive HTTP/1.1 client (`_wire.py`, which says why; httpx's pool
scans every connection for each queued request). Tests that hand `Router` an httpx transport (a fake
engine in the same process) are served through httpx instead, behind the same calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import msgspec

from ._wire import Http1Wire

if TYPE_CHECKING:
    from ._trajectory import ImageSpan

# What a request that broke off raises, from either client (`TimeoutError` is an `OSError`).
_BROKEN = (OSError, EOFError, httpx.TransportError)
_JSON = {"content-type": "application/json"}


class EngineUnavailable(RuntimeError):
    """The engine a session is bound to did not answer."""


class EngineRejected(ValueError):
    """The engine refused the request as malformed (a 4xx): the client's mistake, not the engine's."""


class EngineNonFinite(RuntimeError):
    """The engine sampled a token whose logprob it could not give (vLLM writes a NaN or inf one as null)."""


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
    # The stop string that ended the turn: found by the chat turn in its text (`TextStream.finish`), as
    # vLLM 0.26's token interface does not say.
    stop_reason: str | None = None
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
        self.routed_experts = chunk.routed_experts or self.routed_experts


# The fields of vLLM's generate reply that tito reads; msgspec skips the rest without building it.
class _Logprob(msgspec.Struct):
    logprob: float | None  # None: vLLM's JSON for a NaN or inf (`_generation` refuses it)


class _Logprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _Span(msgspec.Struct):
    version: str | int
    start: int
    end: int


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    token_logprobs: list[float | None] | None = None  # the compact stream's (`Engine`'s `compact_stream`)
    finish_reason: str | None = None
    weight_versions: list[_Span] | None = None  # per chunk, from refit's middleware (refit.vllm_versions)
    # An engine started with `--enable-return-routed-experts`: base64 `.npy`, (tokens, layers, top_k),
    # the experts every forwarded token of the request went to, from `routed_experts_prompt_start` on.
    routed_experts: str | None = None


class _Reply(msgspec.Struct):
    choices: list[_Choice] = []


_decode_reply = msgspec.json.Decoder(_Reply).decode
_MAX_KEPT_IMAGES = 64  # processed images an engine client keeps, by hash (each up to a few MB)


def _version(label: str | int) -> int:
    """Trainers label weight versions with integers; vLLM labels its initial weights "default" (0)."""
    return int(label) if str(label).lstrip("-").isdigit() else 0


def _generation(reply: _Reply) -> Generation | None:
    if not reply.choices:
        return None
    choice = reply.choices[0]
    logprobs = choice.token_logprobs  # the compact route's; vLLM's endpoint gives an object a token
    if logprobs is None:
        logprobs = [entry.logprob for entry in (choice.logprobs and choice.logprobs.content) or ()]
    if None in logprobs:  # a token trained with no logprob would break every ratio of its step
        position = logprobs.index(None)
        raise EngineNonFinite(
            f"the engine gave no logprob for token {position} of a reply chunk "
            f"(id {(choice.token_ids or [])[position : position + 1]}): "
            "vLLM writes a NaN or infinite logprob as null, so its weights or its forward hold non-finite "
            "values (weights sent with NaN in them do this); the request was not captured"
        )
    return Generation(
        token_ids=choice.token_ids or [],
        logprobs=logprobs,  # type: ignore[arg-type]  # no None, checked above
        spans=[(_version(s.version), s.start, s.end) for s in choice.weight_versions or ()],
        finish_reason=choice.finish_reason,
        routed_experts=choice.routed_experts,
    )


class Engine:
    """One vLLM server. Counts the sessions bound to it and the requests it is serving.

    `stream_replies`: ask for every reply streamed, also those the caller takes whole (`generate` then
    gathers the chunks). vLLM's token endpoint builds a whole reply's per-token logprob objects when the
    request finishes, so replies that finish in one step are answered one after another while the engine
    waits; streamed, they are built as the engine decodes (a server started with `--stream-interval N`
    sends N tokens at a time).

    `compact_stream`: the engine runs refit's middleware (`refit.engine_flags`), and streamed replies come
    from its compact route (`refit.vllm_compact`: the same request and tokens, each token's logprob a bare
    float instead of the two JSON objects vLLM's endpoint builds for it one by one)."""

    def __init__(
        self,
        url: str,
        wire: Http1Wire | _HttpxWire,
        model: str | None = None,
        *,
        stream_replies: bool = False,
        compact_stream: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model  # named in every generate request: a LoRA adapter the engine serves
        self.stream_replies = stream_replies
        self.compact_stream = compact_stream
        self.generate_url = f"{self.url}/inference/v1/generate"
        self.stream_url = f"{self.url}/refit/generate" if compact_stream else self.generate_url
        self.wire = wire
        self.num_sessions = self.num_in_flight = 0
        self.alive = True
        self._max_model_len: int | None = None
        self._features: dict[str, tuple[str, int, str]] = {}  # image sha256 -> (hash, length, tensors)

    async def generate(
        self,
        token_ids: list[int],
        sampling: dict,
        *,
        images: Sequence[ImageSpan] = (),
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
        if self.model is not None:
            body["model"] = self.model
        if images:
            body["features"] = await self._image_features(images)
        if stream:
            return self._stream(body)
        if self.stream_replies:
            gathered = Generation()
            async for chunk in self._stream({**body, "stream": True}):
                gathered.extend(chunk)
            return gathered
        self.num_in_flight += 1  # while the engine serves it (`Router.assign` weighs this first)
        try:
            generation = _generation(_decode_reply(await self._request(self.generate_url, body)))
        finally:
            self.num_in_flight -= 1
        assert generation is not None, "the engine's reply has no choices"
        return generation

    async def _stream(self, body: dict) -> AsyncIterator[Generation]:
        if self.compact_stream:  # the engine keeps a request's logprobs in flat lists too
            body = {**body, "sampling_params": {**body["sampling_params"], "flat_logprobs": True}}
        self.num_in_flight += 1
        try:
            async with self.wire.stream(self.stream_url, msgspec.json.encode(body)) as (status, lines):
                if status != 200:
                    self._check(status, b"".join([line async for line in lines]))
                async for line in lines:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    if (chunk := _generation(_decode_reply(line[len(b"data: ") :]))) is not None:
                        yield chunk
        except _BROKEN as error:
            raise await self._failed(error) from error
        finally:
            self.num_in_flight -= 1

    async def _image_features(self, images: Sequence[ImageSpan]) -> dict:
        """`features` for the prompt's images (module docstring), their placeholders where tito's are."""
        if new := list({i.sha256: i for i in images if i.sha256 not in self._features}.values()):
            await self._render(new)
        kept = [self._features[image.sha256] for image in images]
        theirs, ours = [length for _, length, _ in kept], [image.length for image in images]
        if theirs != ours:
            raise ExpansionMismatch(
                f"the engine expands this prompt's images to {theirs} placeholder tokens; tito's processor "
                f"gave {ours}: serve the engine and tito from the same model directory"
            )
        return {
            "mm_hashes": {"image": [digest for digest, _, _ in kept]},
            "mm_placeholders": {"image": [{"offset": i.offset, "length": i.length} for i in images]},
            "kwargs_data": {"image": [tensors for _, _, tensors in kept]},
        }

    async def _render(self, images: Sequence[ImageSpan]) -> None:
        """Have the engine process `images` (alone, in one user turn) and keep what it made of each."""
        content = [{"type": "image_url", "image_url": {"url": image.data_url}} for image in images]
        body = {"messages": [{"role": "user", "content": content}]}
        made = msgspec.json.decode(await self._request(f"{self.url}/v1/chat/completions/render", body))
        features = made["features"]
        lengths = [place["length"] for place in features["mm_placeholders"]["image"]]
        kept = zip(features["mm_hashes"]["image"], lengths, features["kwargs_data"]["image"], strict=True)
        self._features.update(zip([image.sha256 for image in images], kept, strict=True))
        while len(self._features) > _MAX_KEPT_IMAGES:
            del self._features[next(iter(self._features))]  # the oldest first

    async def _failed(self, error: Exception) -> EngineUnavailable:
        """A request broke off. The engine counts as dead only if `/health` does not answer either: a
        dropped connection fails that request, not every later session."""
        self.alive = await self.healthy()
        state = "dropped the request" if self.alive else "is not answering"
        return EngineUnavailable(f"engine {self.url} {state} ({type(error).__name__})")

    async def _request(self, url: str, body: dict | None = None) -> bytes:
        """The body of the engine's reply to a GET, or with `body` a POST; a failure raises."""
        encoded = None if body is None else msgspec.json.encode(body)
        try:
            status, data = await self.wire.request("GET" if encoded is None else "POST", url, encoded)
        except _BROKEN as error:
            raise await self._failed(error) from error
        self._check(status, data)
        return data

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
            data = await self._request(f"{self.url}/v1/models")
            self._max_model_len = int(msgspec.json.decode(data)["data"][0]["max_model_len"])
        return self._max_model_len


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
        self,
        urls: list[str],
        *,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        model: str | None = None,
        stream_replies: bool = False,
        compact_stream: bool = False,
    ) -> None:
        if not urls:
            raise ValueError("tito needs at least one engine URL")
        self.wire = Http1Wire(timeout) if transport is None else _HttpxWire(timeout, transport)
        # every engine's, a restarted one's too (`replace`)
        self.engine_flags = {"stream_replies": stream_replies, "compact_stream": compact_stream}
        self.engines = [Engine(url, self.wire, model, **self.engine_flags) for url in urls]

    def assign(self) -> Engine:
        live = [engine for engine in self.engines if engine.alive]
        if not live:
            raise EngineUnavailable("no engine is answering")
        engine = min(live, key=lambda e: (e.num_in_flight, e.num_sessions))
        engine.num_sessions += 1
        return engine

    def release(self, engine: Engine) -> None:
        engine.num_sessions -= 1

    def replace(self, engine: Engine, url: str) -> Engine:
        """A restarted engine, at `url`, takes `engine`'s place. It takes no session until its owner marks
        it `alive` (once it serves the current weights); the sessions bound to the old one stay bound to
        it, and fail."""
        new = Engine(url, self.wire, engine.model, **self.engine_flags)
        new.alive = False
        self.engines[self.engines.index(engine)] = new
        return new

    async def aclose(self) -> None:
        await self.wire.aclose()
