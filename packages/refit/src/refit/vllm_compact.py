"""vLLM's token endpoint with compact streamed replies: each token's logprob a bare float.

`POST /refit/generate` (`refit.vllm_versions.COMPACT`, served by refit's middleware in vLLM's API server)
takes the body of vLLM 0.26's `POST /inference/v1/generate` and answers it streamed, always. vLLM's own
request handling runs unchanged (`ServingTokens.serve_tokens`: the model or LoRA adapter, image features,
the default `max_tokens`, request ids, refusals); only the events differ. vLLM's endpoint builds two
pydantic objects per token's logprob and dumps them to JSON: most of what a token's logprob costs the API
server process (`bench/token_endpoint.py`), which was busy most of a sampling-heavy step on one H100.
Here an event is one choice's new tokens:

    data: {"choices": [{"index": 0, "token_ids": [...], "token_logprobs": [...], "finish_reason": null}]}

`token_logprobs`: the sampled tokens' logprobs (asked with `logprobs: 0`; clamped at -9999, and -9999
where the engine gave none, as vLLM's endpoint does), absent when no logprob was asked. A choice also
carries `routed_experts` (base64 `.npy`) where vLLM's would, and refit's middleware adds
`weight_versions`. A request that fails mid-stream ends with vLLM's error event, then `data: [DONE]`, as
vLLM's endpoint does. Ask `flat_logprobs: true` as well: vLLM then keeps a request's logprobs in flat
lists, not a dict and an object per token.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncGenerator

import msgspec
import numpy as np
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request
from vllm.entrypoints.openai.engine.protocol import ErrorResponse, GenerationError
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
from vllm.logger import init_logger
from vllm.logprobs import FlatLogprobs
from vllm.outputs import CompletionOutput

from refit.vllm_versions import _read_body

logger = init_logger(__name__)


class CompactTokens(ServingTokens):
    """vLLM's token endpoint handler with the compact stream (module docstring)."""

    @classmethod
    def of(cls, handler: ServingTokens) -> CompactTokens:
        """A handler with the state of the server's own `handler` (its engine client, models, renderer)."""
        compact = object.__new__(cls)
        compact.__dict__.update(vars(handler))
        return compact

    async def serve_tokens_stream_generator(
        self, request, result_generator, request_id, model_name, request_metadata
    ) -> AsyncGenerator[bytes, None]:
        """The events of one request (module docstring), `[DONE]` last; each choice's chunk as vLLM's
        endpoint would send it, skipping the same empty ones."""
        asked = request.sampling_params.logprobs is not None
        try:
            async for result in result_generator:
                for output in result.outputs:
                    self._raise_if_error(output.finish_reason, request_id)
                    if output.token_ids:
                        yield compact_event(output, logprobs=asked)
        except GenerationError as error:
            yield f"data: {self._convert_generation_error_to_streaming_response(error)}\n\n".encode()
        except Exception as error:  # vLLM's endpoint reports any other failure as an event too
            logger.exception("Error in compact token generation stream.")
            yield f"data: {self.create_streaming_error_response(error)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def compact_event(output: CompletionOutput, *, logprobs: bool) -> bytes:
    """The SSE event of one choice's new tokens (module docstring); `logprobs`: the request asked them."""
    choice: dict = {
        "index": output.index,
        "token_ids": list(output.token_ids),
        "finish_reason": output.finish_reason,
    }
    if logprobs:
        assert output.logprobs is not None, "the engine sent no logprobs"
        choice["token_logprobs"] = sampled_logprobs(output.token_ids, output.logprobs)
    if output.routed_experts is not None:
        buffer = io.BytesIO()
        np.save(buffer, output.routed_experts)
        choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n"


def sampled_logprobs(token_ids, logprobs) -> list[float]:
    """The logprob of each sampled token, as vLLM's endpoint gives it: clamped at -9999, and -9999 where
    the engine gave none. vLLM puts the sampled token's entry first at each position (a dict per position,
    or `FlatLogprobs`' lists)."""
    if isinstance(logprobs, FlatLogprobs):
        bounds = zip(logprobs.start_indices, logprobs.end_indices, strict=True)
        return [max(logprobs.logprobs[start], -9999.0) if start < end else -9999.0 for start, end in bounds]
    sampled = [step.get(token) if step else None for token, step in zip(token_ids, logprobs, strict=True)]
    return [-9999.0 if entry is None else max(entry.logprob, -9999.0) for entry in sampled]


async def serve_compact(scope, receive, send) -> None:
    """The ASGI app of `POST /refit/generate` (module docstring). A malformed body is refused with 400;
    what vLLM's handler refuses keeps its status; a client that leaves aborts the request."""
    body = await _read_body(receive)
    try:
        request = GenerateRequest.model_validate_json(body)
    except ValidationError as error:
        refusal = {"error": {"message": str(error), "type": "BadRequestError", "code": 400}}
        await JSONResponse(refusal, status_code=400)(scope, receive, send)
        return
    request.stream = True
    handler = CompactTokens.of(scope["app"].state.serving_tokens)
    served = await handler.serve_tokens(request, Request(scope, receive))
    if isinstance(served, ErrorResponse):
        await JSONResponse(served.model_dump(), status_code=served.error.code)(scope, receive, send)
    else:  # it watches for the client leaving, and closes the stream then (vLLM aborts the request)
        await StreamingResponse(served, media_type="text/event-stream")(scope, receive, send)
