"""tito embedded in another program (as molt embeds it): served on the caller's event loop, with sampling
parameters fixed by the host, over the fake engine (see fake_engine.py)."""

from __future__ import annotations

import asyncio
import gc
import signal
import weakref

import openai
import pytest

from tito import create_app, serve_on_loop

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_served_on_the_callers_loop_to_a_real_sdk_client(fake_tito, fake_engine):
    fake_tito.fixed_sampling = {"temperature": 0.7, "top_p": 0.9}
    fake_tito.max_tokens_cap = 3
    fake_engine.script = [[11, 12, 13, 14, 15]]
    handler = signal.getsignal(signal.SIGINT)
    async with serve_on_loop(create_app(fake_tito, api_key="k")) as url:
        assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C stays the host program's
        session = fake_tito.new_session()
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session.id}/v1", api_key="k")
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=50
        )
        await client.close()
    assert reply.choices[0].finish_reason == "length"  # capped at 3 tokens, not the 50 asked for
    assert session.finish_reason == "length"
    assert session.capture.replies == [[11, 12, 13]]
    params = fake_engine.requests[-1]["sampling_params"]
    assert (params["temperature"], params["top_p"], params["max_tokens"]) == (0.7, 0.9, 3)


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


async def test_serving_leaves_what_exists_at_start_out_of_cyclic_collection(fake_tito):
    """Objects from before serving are frozen (a full collection of them would stall the loop); later
    garbage is collected as usual."""
    gc.unfreeze()
    before = _Cyclic()
    before_ref = weakref.ref(before)
    try:
        async with serve_on_loop(create_app(fake_tito)):
            assert gc.get_freeze_count() > 0
            after = _Cyclic()
            after_ref = weakref.ref(after)
            del before, after
            gc.collect()
            assert after_ref() is None
            assert before_ref() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert before_ref() is None


async def test_a_taken_port_is_an_error_not_an_exit(fake_tito):
    async with serve_on_loop(create_app(fake_tito)) as url:
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            async with serve_on_loop(create_app(fake_tito), port=port):
                pass
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "tito-http" and t.done()]


async def test_an_idle_connection_outlives_the_sdks_pool_expiry(fake_tito):
    """httpx (under the openai and anthropic SDKs) drops a connection idle for 5 s; the server must not
    close it first, or a busy client's next request on it fails."""
    async with serve_on_loop(create_app(fake_tito)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))

        async def status_line() -> bytes:  # of one request on this connection (404: no such route)
            writer.write(b"GET /none HTTP/1.1\r\nHost: tito\r\n\r\n")
            head = (await reader.readuntil(b"\r\n\r\n")).lower().split(b"\r\n")
            await reader.readexactly(next(int(h[15:]) for h in head if h.startswith(b"content-length:")))
            return head[0]

        assert await status_line() == b"http/1.1 404 not found"
        await asyncio.sleep(6.0)  # idle past the SDKs' expiry
        assert await status_line() == b"http/1.1 404 not found"
        writer.close()
