"""tito's memory over many short sessions: does a standalone server's footprint stay flat?

tito's app (the seeded tiny Qwen3's tokenizer and template) over an in-process engine stand-in that
answers every generate request with two tokens; no engine work, so only tito's own state shows. Each
session is opened, gets one chat turn through the app (the same code path as over HTTP, driven through
an httpx ASGI transport), and then either is ended with `DELETE /sessions/{id}` or left idle for
`expire_idle` to end (half of them each way, as a server with `--idle-timeout` sees both). The resident
set size (after a full collection) is printed every `--every` sessions, with the live sessions and
the ended ids remembered (`Tito.ended`, capped at 10,000). Usage:

    uv run --no-sync python bench/tito_memory.py [--sessions 10000 --every 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from pathlib import Path


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def engine_app(eos_id: int):
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "stand-in", "max_model_len": 4096}]}

    @app.post("/inference/v1/generate")
    async def generate():
        tokens = [10, eos_id]
        logprobs = {"content": [{"logprob": -0.5} for _ in tokens]}
        spans = [{"version": "default", "start": 0, "end": 2}]
        choice = {
            "token_ids": tokens,
            "logprobs": logprobs,
            "finish_reason": "stop",
            "weight_versions": spans,
        }
        return {"choices": [choice]}

    return app


async def run(num_sessions: int, every: int) -> None:
    import httpx

    from molt.tiny import build_tiny_model
    from tito import Tito, create_app

    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "model")
    probe = Tito(["http://engine"], model_dir)
    transport = httpx.ASGITransport(app=engine_app(probe.tokenizer.eos_token_id))
    tito = Tito(
        ["http://engine"], model_dir, served_model_name="tiny", engine_transport=transport, idle_timeout=60.0
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tito)), base_url="http://tito")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "copy the word: owl"}], "max_tokens": 4}
    print(f"{'sessions':>8}  {'RSS MiB':>8}  {'live':>5}  {'ended ids':>9}  {'s':>6}")
    began = time.perf_counter()
    for index in range(num_sessions + 1):
        if index % every == 0:
            tito.expire_idle(now=time.monotonic() + 120)  # those left idle
            gc.collect()
            elapsed = time.perf_counter() - began
            live, ended = len(tito.sessions), len(tito.ended)
            print(f"{index:>8}  {rss_mib():>8.1f}  {live:>5}  {ended:>9}  {elapsed:>6.1f}")
        if index == num_sessions:
            break
        session = (await client.post("/sessions")).json()
        reply = await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        if index % 2 == 0:
            await client.delete(f"/sessions/{session['id']}")
    await client.aclose()
    await tito.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(run(args.sessions, args.every))


if __name__ == "__main__":
    main()
