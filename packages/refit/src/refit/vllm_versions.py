"""Engine side of refit in vLLM's API server: weight versions, which vLLM 0.26 does not keep.

Loaded with `--middleware refit.vllm_versions.WeightVersions` (one of `refit.engine_flags()`). vLLM 0.26
runs the weight-transfer lifecycle but has no weight version: `/finish_weight_update` takes no label,
there is no `/weight_info`, and `/inference/v1/generate` does not say which weights sampled which token.
This ASGI middleware adds the three in the server process, with the semantics later vLLM releases have:
- `POST /finish_weight_update {"weight_version": v}`: once vLLM has answered 200, and before that answer
  leaves (the trainer resumes the engine only after it), every generate request in flight notes how many
  tokens it has sampled so far (vLLM's output processor counts them), and the label becomes `v`.
- `GET /weight_info` answers `{"weight_version": v}` ("default" until the first refit).
- every choice of a generate reply, and of each streamed chunk, carries `weight_versions`: spans
  `{version, start, end}` (token positions in the whole output) saying which weights sampled its tokens.
It also serves `POST /refit/generate`: the same requests, streamed in compact events
(`refit.vllm_compact`), their choices labelled alike.

Why the counts are right: the engine samples nothing between `/pause` and `/resume`, and the outputs
of every step before the pause reach the server ahead of the pause's own reply, so the output processor
has counted them long before the transfer's round trips are over. A request that arrives while the engine
is paused has sampled nothing yet: all its tokens carry the new label. It assumes one API-server process
(several would each keep a label of their own); Molt starts one (vLLM's OpenAI server).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import msgspec

__all__ = ["WeightVersions"]

GENERATE = "/inference/v1/generate"
COMPACT = "/refit/generate"  # GENERATE's requests, streamed compactly (refit.vllm_compact)
INITIAL = "default"  # the label of the weights the server loaded, as later vLLM releases name it


@dataclass
class _InFlight:
    """One generate request: the label when it arrived and each refit it saw, per choice index."""

    label: str
    switches: list[tuple[dict[int, int], str]] = field(default_factory=list)  # (tokens so far, new label)

    def spans(self, index: int, start: int, end: int) -> list[dict]:
        """Spans over output positions [start, end) of choice `index`. A choice missing from a refit's
        counts while others of its request are there had finished (vLLM's output processor drops a
        finished choice): none of its tokens is newer."""
        switches = [(counts.get(index, math.inf if counts else 0), label) for counts, label in self.switches]
        bounds = [(0, self.label), *switches]
        spans: list[dict] = []
        for (begin, label), (next_begin, _) in zip(bounds, [*bounds[1:], (end, "")], strict=True):
            lo, hi = max(begin, start), min(next_begin, end)
            if lo >= hi:
                continue
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = hi
            else:
                spans.append({"version": label, "start": lo, "end": hi})
        return spans


class WeightVersions:
    """The ASGI middleware (module docstring). vLLM builds it with the app it wraps."""

    def __init__(self, app) -> None:
        self.app = app
        self.label = INITIAL
        self.in_flight: dict[str, _InFlight] = {}  # by vLLM's external request id

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path == GENERATE:
            await self._generate(scope, receive, send, self.app)
        elif path == COMPACT and scope["method"] == "POST":
            from refit.vllm_compact import serve_compact  # vLLM's serving modules: in its server only

            await self._generate(scope, receive, send, serve_compact)
        elif path == "/finish_weight_update":
            await self._finish(scope, receive, send)
        elif path == "/weight_info" and scope["method"] == "GET":
            await _send_json(send, 200, {"weight_version": self.label})
        else:
            await self.app(scope, receive, send)

    async def _generate(self, scope, receive, send, app) -> None:
        """A generate request served by `app` (vLLM's, or the compact one), its choices labelled."""
        # vLLM names the request after the X-Request-Id header: ours, so the output processor can be asked.
        request_id = uuid.uuid4().hex
        headers = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
        scope = {**scope, "headers": [*headers, (b"x-request-id", request_id.encode())]}
        key = f"generate-tokens-{request_id}"
        request = self.in_flight[key] = _InFlight(self.label)
        try:
            await app(scope, receive, _Labeller(request, send).send)
        finally:
            del self.in_flight[key]

    async def _finish(self, scope, receive, send) -> None:
        body = await _read_body(receive)
        asked = msgspec.json.decode(body) if body.strip() else {}
        version = asked.get("weight_version") if isinstance(asked, dict) else None
        engine = scope["app"].state.engine_client

        async def finished(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200 and version:
                self._switch(engine.output_processor, str(version))
            await send(message)

        await self.app(scope, _replay(body, receive), finished)

    def _switch(self, processor, version: str) -> None:
        """Note each request's tokens so far, then relabel (runs while the engine is paused)."""
        for key, request in self.in_flight.items():
            counts = {}
            for internal_id in processor.external_req_ids.get(key, ()):
                if (state := processor.request_states.get(internal_id)) is not None:
                    counts[state.request_index] = state.detokenizer.num_output_tokens()
            request.switches.append((counts, version))
        self.label = version


class _Labeller:
    """Adds `weight_versions` to each choice of a generate reply (whole, or one SSE event at a time)."""

    def __init__(self, request: _InFlight, send) -> None:
        self.request: _InFlight | None = request
        self._send = send
        self.start: dict | None = None
        self.stream = False
        self.body = b""
        self.offsets: dict[int, int] = {}  # tokens already sent, per choice index

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            self.stream = content_type.startswith(b"text/event-stream")
            if message["status"] != 200:
                self.request = None  # an error reply passes as it is
            if self.stream or self.request is None:
                await self._send(message)
            else:
                self.start = message  # its content-length changes: sent with the body
            return
        if message["type"] != "http.response.body" or self.request is None:
            await self._send(message)
        elif self.stream:
            await self._send({**message, "body": self._events(message.get("body", b""))})
        else:
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                body = msgspec.json.encode(self._label(msgspec.json.decode(self.body)))
                assert self.start is not None  # held back at http.response.start
                headers = [(k, v) for k, v in self.start["headers"] if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await self._send({**self.start, "headers": headers})
                await self._send({"type": "http.response.body", "body": body})

    def _events(self, body: bytes) -> bytes:
        events = []
        for event in body.split(b"\n\n"):
            if event.startswith(b"data: {"):
                event = b"data: " + msgspec.json.encode(self._label(msgspec.json.decode(event[6:])))
            events.append(event)
        return b"\n\n".join(events)

    def _label(self, reply: dict) -> dict:
        assert self.request is not None  # an error reply is not labelled
        for choice in reply.get("choices") or ():
            index, num_tokens = choice.get("index", 0), len(choice.get("token_ids") or ())
            start = self.offsets.get(index, 0)
            self.offsets[index] = start + num_tokens
            choice["weight_versions"] = self.request.spans(index, start, start + num_tokens)
        return reply


async def _read_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def _replay(body: bytes, receive):
    """`receive` for the wrapped app: the body already read, then whatever the client sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def _send_json(send, status: int, content: dict) -> None:
    body = msgspec.json.encode(content)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
