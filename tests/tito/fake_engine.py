"""A fake vLLM engine for tito's unit tests: the token-level endpoint, with scripted replies.

It stands in for a real engine only where a test must choose exactly which tokens are "sampled" (a
reply that is not the canonical tokenization of its text, a well-formed tool call); everything else
runs against a real vLLM server in test_real_engine.py. Replies follow the wire format of vLLM 0.26
with refit's middleware: tokens, logprobs and weight-version spans per chunk (no stop reason), also
from the middleware's compact route (`POST /refit/generate`: always streamed, each logprob a bare float).
Images come as processed features, which a test's `render` hook makes (vLLM's
`/v1/chat/completions/render`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MAX_MODEL_LEN = 4096


class FakeEngine:
    def __init__(self, eos_id: int, version: str = "default") -> None:
        self.eos_id = eos_id
        self.version = version
        self.script: list[list[int]] = []  # replies to give, in order; then a default reply
        self.prompts: list[list[int]] = []  # every prompt received
        self.requests: list[dict] = []  # every request body received
        self.paths: list[str] = []  # the route of each
        self.render = None  # render body -> its reply (features of the images it was sent)
        self.rendered: list[dict] = []  # every render request body received
        self.route_shape: tuple[int, int] | None = None  # (layers, top_k): reply with MoE routes
        self.fail_next = 0  # answer this many of the next generate requests with a 503
        self.break_after: int | None = None  # a stream drops its connection after this many tokens
        self.token_delay = 0.0  # seconds between streamed tokens
        self.null_logprob_from: int | None = None  # a reply's tokens from here on get null (vLLM's NaN)
        self.max_model_len = MAX_MODEL_LEN
        self.app = self._build()

    def reply_for(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        tokens = self.script.pop(0) if self.script else [prompt[-1], self.eos_id]
        if len(tokens) > max_tokens:
            return tokens[:max_tokens], "length"
        return tokens, "stop"

    def routes(self, tokens: list[int], start: int) -> str:
        """vLLM's `routed_experts` for a request whose whole trace is `tokens`, from token `start`: the
        expert of (token, position, layer, slot) is a fixed function of them, as a prefix-cached engine's
        is of the cached tokens."""
        layers, top_k = self.route_shape
        token_T = np.array(tokens[start:-1])[:, None, None]
        position_T = np.arange(start, len(tokens) - 1)[:, None, None]
        experts = (token_T * 7 + position_T * 3 + np.arange(layers)[:, None] * 5 + np.arange(top_k)) % 64
        buffer = io.BytesIO()
        np.save(buffer, experts.astype(np.uint8))
        return base64.b64encode(buffer.getvalue()).decode()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.get("/v1/models")
        async def models():
            return {"data": [{"id": "fake", "max_model_len": self.max_model_len}]}

        @app.post("/v1/chat/completions/render")
        async def render(request: Request):
            body = await request.json()
            self.rendered.append(body)
            return JSONResponse(self.render(body))

        @app.post("/refit/generate")
        async def compact(request: Request):
            return await generate(request, compact=True)

        @app.post("/inference/v1/generate")
        async def generate(request: Request, compact: bool = False):
            body = await request.json()
            self.requests.append(body)
            self.paths.append(request.url.path)
            if self.fail_next:
                self.fail_next -= 1
                return JSONResponse({"error": "engine overloaded"}, status_code=503)
            self.prompts.append(body["token_ids"])
            tokens, finish = self.reply_for(body["token_ids"], body["sampling_params"].get("max_tokens", 16))
            start = body["sampling_params"].get("routed_experts_prompt_start", 0)
            routes = self.routes(body["token_ids"] + tokens, start) if self.route_shape else None

            def choice(ids, start, last):
                null_from = len(tokens) if self.null_logprob_from is None else self.null_logprob_from
                values = [None if start + i >= null_from else -0.5 for i in range(len(ids))]
                entries = [{"token_id": t, "logprob": v} for t, v in zip(ids, values, strict=True)]
                logprobs = {"token_logprobs": values} if compact else {"logprobs": {"content": entries}}
                return {
                    "index": 0,
                    "token_ids": ids,
                    **logprobs,
                    "finish_reason": finish if last else None,
                    "weight_versions": [{"version": self.version, "start": start, "end": start + len(ids)}],
                    "routed_experts": routes if last else None,
                }

            if not body.get("stream") and not compact:
                return JSONResponse({"choices": [choice(tokens, 0, True)]})

            async def events():
                for position, token in enumerate(tokens):
                    if position == self.break_after:
                        raise ConnectionResetError("the fake engine dropped the stream")
                    await asyncio.sleep(self.token_delay)
                    data = {"choices": [choice([token], position, position == len(tokens) - 1)]}
                    yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app
