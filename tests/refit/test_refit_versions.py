"""The weight-version middleware (refit.vllm_versions) around a stand-in for vLLM's app: the labels it
gives each token, whole replies and streamed ones, across refits. The real server is in
test_refit_vllm.py; here the output processor's counts are set by hand to place the switch exactly."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx

from refit.vllm_versions import WeightVersions


class FakeVllm:
    """The ASGI app inside the middleware: generate replies of `tokens` ids (streamed in `chunk`s), a
    finish endpoint answering `finish_status`, and an output processor whose counts the test sets."""

    def __init__(self) -> None:
        self.processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.state = SimpleNamespace(engine_client=SimpleNamespace(output_processor=self.processor))
        self.finish_status = 200
        self.seen_ids: list[str] = []
        self.release = asyncio.Event()

    def sampled(self, external_id: str, num_tokens: int, index: int = 0) -> None:
        """vLLM's output processor has counted `num_tokens` for choice `index` of the request."""
        detok = SimpleNamespace(num_output_tokens=lambda: num_tokens)
        internal_id = f"{index}_{external_id}-int"
        self.processor.external_req_ids.setdefault(external_id, []).append(internal_id)
        state = SimpleNamespace(request_index=index, detokenizer=detok)
        self.processor.request_states[internal_id] = state

    async def __call__(self, scope, receive, send) -> None:
        body = (await receive())["body"]
        if scope["path"] == "/finish_weight_update":
            await _reply(send, self.finish_status, b"{}", b"application/json")
            return
        request = json.loads(body)
        self.seen_ids.append(dict(scope["headers"])[b"x-request-id"].decode())
        num_tokens = request["num_tokens"]
        if not request.get("stream"):
            await self.release.wait()
            lengths = request.get("lengths", [num_tokens])  # one per choice (n > 1)
            reply = {"choices": [{"index": i, "token_ids": list(range(n))} for i, n in enumerate(lengths)]}
            await _reply(send, 200, json.dumps(reply).encode(), b"application/json")
            return
        stream = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": stream})
        for start in range(0, num_tokens, 3):
            if start >= 3:
                await self.release.wait()
            chunk = {"choices": [{"index": 0, "token_ids": list(range(start, min(start + 3, num_tokens)))}]}
            event = f"data: {json.dumps(chunk)}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _reply(send, status: int, body: bytes, kind: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": body})


def _client(fake: FakeVllm) -> tuple[WeightVersions, httpx.AsyncClient]:
    """The middleware around `fake`, and a client of both (Starlette puts the app in the scope first)."""
    middleware = WeightVersions(fake)

    async def server(scope, receive, send) -> None:
        await middleware({**scope, "app": fake}, receive, send)

    return middleware, httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://e")


async def _refit_during(fake: FakeVllm, client, request: dict, at_token: int, version: str):
    """Send `request`; once vLLM has seen it, let the output processor count `at_token` tokens, finish a
    refit labelled `version`, then let the request go on."""
    sent = asyncio.create_task(client.post("/inference/v1/generate", json=request))
    while not fake.seen_ids:
        await asyncio.sleep(0.01)
    fake.sampled(f"generate-tokens-{fake.seen_ids[-1]}", at_token)
    assert (await client.post("/finish_weight_update", json={"weight_version": version})).status_code == 200
    fake.release.set()
    return await sent


def test_a_whole_reply_is_split_where_the_refit_found_it():
    async def run():
        fake = FakeVllm()
        middleware, client = _client(fake)
        async with client:
            assert (await client.get("/weight_info")).json() == {"weight_version": "default"}
            reply = await _refit_during(fake, client, {"num_tokens": 10}, 4, "7")
            assert (await client.get("/weight_info")).json() == {"weight_version": "7"}
        (choice,) = reply.json()["choices"]
        assert choice["weight_versions"] == [
            {"version": "default", "start": 0, "end": 4},
            {"version": "7", "start": 4, "end": 10},
        ]
        assert int(reply.headers["content-length"]) == len(reply.content)
        assert not middleware.in_flight

    asyncio.run(run())


def test_each_streamed_chunk_carries_the_versions_of_its_own_tokens():
    async def run():
        fake = FakeVllm()
        _, client = _client(fake)
        async with client:
            reply = await _refit_during(fake, client, {"num_tokens": 8, "stream": True}, 5, "v1")
        events = [line[6:] for line in reply.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        spans = [json.loads(e)["choices"][0]["weight_versions"] for e in events[:-1]]
        assert spans == [
            [{"version": "default", "start": 0, "end": 3}],
            [{"version": "default", "start": 3, "end": 5}, {"version": "v1", "start": 5, "end": 6}],
            [{"version": "v1", "start": 6, "end": 8}],
        ]

    asyncio.run(run())


def test_a_request_not_yet_sampling_at_the_refit_is_all_new_and_a_refused_finish_keeps_the_label():
    async def run():
        fake = FakeVllm()
        _, client = _client(fake)
        async with client:
            fake.finish_status = 500
            assert (
                await client.post("/finish_weight_update", json={"weight_version": "x"})
            ).status_code == 500
            assert (await client.get("/weight_info")).json() == {"weight_version": "default"}
            fake.finish_status = 200
            sent = asyncio.create_task(client.post("/inference/v1/generate", json={"num_tokens": 3}))
            while not fake.seen_ids:
                await asyncio.sleep(0.01)
            await client.post("/finish_weight_update", json={"weight_version": "2"})  # vLLM counted none
            fake.release.set()
            reply = await sent
        assert reply.json()["choices"][0]["weight_versions"] == [{"version": "2", "start": 0, "end": 3}]

    asyncio.run(run())


def test_a_choice_that_finished_before_the_refit_keeps_the_old_label_while_its_sibling_switches():
    async def run():
        fake = FakeVllm()
        _, client = _client(fake)
        async with client:
            sent = asyncio.create_task(
                client.post("/inference/v1/generate", json={"num_tokens": 0, "lengths": [5, 8]})
            )
            while not fake.seen_ids:
                await asyncio.sleep(0.01)
            # Choice 0 finished with 5 tokens (vLLM's output processor dropped it), choice 1 sampled 3.
            fake.sampled(f"generate-tokens-{fake.seen_ids[-1]}", 3, index=1)
            await client.post("/finish_weight_update", json={"weight_version": "1"})
            fake.release.set()
            reply = await sent
        first, second = reply.json()["choices"]
        assert first["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
        assert second["weight_versions"] == [
            {"version": "default", "start": 0, "end": 3},
            {"version": "1", "start": 3, "end": 8},
        ]

    asyncio.run(run())
