"""Time a full refit into a real vLLM CPU server, phase by phase, against a raw gloo broadcast.

Starts one vLLM CPU server (refit_gloo backend) on a seeded tiny Qwen3 of the given size, refits it
`--rounds` times with alternating weight sets, and prints the median seconds of each phase: pause,
start (engine: initialise layerwise reload), transfer (trainer wall clock; on the engine, the wall
clock from posting its receives to the last bucket, loads included, and the loads' own sum), finish
(finalise reload), prefix-cache reset, resume; and the cost of verifying every refit (the trainer's
CRC-32 of each packed bucket, the engine's check of it before the load). Between refits it broadcasts
one buffer of the same byte count over a plain two-process gloo group, into a reused buffer and into
fresh memory (round by round, so both sides of the ratio see the same load): the floor for the
transfer on this machine.
Usage:

    uv run --no-sync python bench/refit_cpu.py --hidden 512 --layers 8 --bucket-mb 64

`--engine fake` puts the refit tests' fake engine (tests/refit/fake_engine.py: the same HTTP calls and
the same gloo receiver, `refit._transport.Incoming` into kept `ReceiveBuffers`, with a copy of each
tensor as its load) in place of vLLM, for a machine without vLLM: the send and its ratio measure the
same wire; the engine's phases are not vLLM's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tito_overhead import machine

import refit
from refit._transport import broadcast, join_gloo_group


def _raw_peer(port: int, num_bytes: int, rounds: int, fresh: bool) -> None:
    group = join_gloo_group("127.0.0.1", port, 1, 2, 120)
    buffer = torch.empty(num_bytes, dtype=torch.uint8)
    for _ in range(rounds + 1):
        broadcast(group, torch.empty(num_bytes, dtype=torch.uint8) if fresh else buffer).wait()


class RawBroadcast:
    """One `num_bytes` buffer broadcast to a peer process over gloo, a round at a time (`once`).

    `fresh`: the peer receives into newly allocated memory every time (as the engine must: layerwise
    reload keeps views of its buckets), so the page faults of first touch are in the time.
    """

    def __init__(self, num_bytes: int, rounds: int, *, fresh: bool) -> None:
        from molt.vllm_server import free_port

        port = free_port()
        args = (port, num_bytes, rounds, fresh)
        self.peer = mp.get_context("spawn").Process(target=_raw_peer, args=args)
        self.peer.start()
        self.group = join_gloo_group("127.0.0.1", port, 0, 2, 120)
        self.buffer = torch.ones(num_bytes, dtype=torch.uint8)
        self.once()  # warm-up

    def once(self) -> float:
        began = time.perf_counter()
        broadcast(self.group, self.buffer).wait()
        return time.perf_counter() - began


@contextlib.contextmanager
def fake_engine(model_dir: Path, log_path: Path):
    """The refit tests' fake engine in a process of its own; yields its URL."""
    import httpx

    from molt.vllm_server import free_port

    port = free_port()
    script = Path(__file__).resolve().parents[1] / "tests" / "refit" / "fake_engine.py"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, str(script), str(model_dir), str(port)], stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the fake engine did not answer; see {log_path}")
        yield url
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def vllm_engine(model_dir: Path, log_path: Path):
    from molt.vllm_server import VLLMServer

    with VLLMServer(model_dir, extra_args=refit.engine_flags(), log_path=log_path) as server:
        yield server.url


def main() -> None:
    from transformers import AutoModelForCausalLM

    from molt.tiny import build_tiny_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=["vllm", "fake"], default="vllm")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="refit-bench-"))
    dirs = [
        build_tiny_model(work / f"seed{s}", seed=s, hidden_size=args.hidden, num_layers=args.layers)
        for s in (0, 1)
    ]
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in dirs]
    bucket_bytes = int(args.bucket_mb * 2**20)
    rows: dict[str, list[float]] = {}
    serve = vllm_engine if args.engine == "vllm" else fake_engine
    with serve(dirs[0], work / "server.log") as url:
        engine = refit.Engine(url)
        stats = refit.update_weights(
            [engine], refit.full_params(models[1]), version="warmup", bucket_bytes=bucket_bytes
        )
        raws = {
            "raw": RawBroadcast(stats.num_bytes, args.rounds, fresh=False),
            "raw_fresh": RawBroadcast(stats.num_bytes, args.rounds, fresh=True),
        }
        for round_ in range(args.rounds):
            stats = refit.update_weights(
                [engine], refit.full_params(models[round_ % 2]), version=round_, bucket_bytes=bucket_bytes
            )
            seconds = dict(stats.seconds, engine_recv=math.nan, engine_load=math.nan, engine_verify=math.nan)
            if args.engine == "vllm":
                worker = engine.worker_timings()[0]
                seconds.update(engine_recv=worker["recv_s"], engine_load=worker["load_s"])
                seconds["engine_verify"] = worker["verify_s"]
            inside = ("check", "connect", "gather_pack", "checksum", "send")  # parts of other phases
            seconds["total"] = sum(v for k, v in stats.seconds.items() if k not in inside)
            seconds.update({name: raw_broadcast.once() for name, raw_broadcast in raws.items()})
            for name, value in seconds.items():
                rows.setdefault(name, []).append(value)
        engine.close()
    raw, raw_fresh = statistics.median(rows["raw"]), statistics.median(rows["raw_fresh"])

    size_mib = stats.num_bytes / 2**20
    print(f"machine: {machine()}")
    print(f"engine: {args.engine}")
    print(f"model: tiny Qwen3 hidden={args.hidden} layers={args.layers} fp32, {size_mib:.1f} MiB")
    print(f"{stats.num_buckets} bucket(s) of <= {args.bucket_mb:g} MiB (+1 tensor), median of {args.rounds}")
    print(f"{'phase':<28} {'seconds':>9}")
    labels = {
        "check": "check names/shapes (HTTP)", "pause": "pause (mode=keep)", "start": "start (init reload)",
        "transfer": "transfer (trainer wall)", "send": "  trainer: gather+pack+bcast",
        "gather_pack": "    of which gather + pack", "checksum": "    of which CRC-32 (verify)",
        "engine_recv": "  engine: receive+load wall", "engine_load": "  engine: load_weights (sum)",
        "engine_verify": "  engine: CRC-32 check (sum)",
        "finish": "finish (finalize reload)", "reset_prefix_cache": "reset prefix cache", "resume": "resume",
        "total": "total (pause..resume)",
    }  # fmt: skip
    for key, label in labels.items():
        print(f"{label:<28} {statistics.median(rows[key]):>9.4f}")
    print(f"{'raw gloo broadcast, 1 buffer':<28} {raw:>9.4f}   (same bytes, same run)")
    print(f"{'  into fresh memory':<28} {raw_fresh:>9.4f}   (the receiver allocates it each time)")
    send, transfer = statistics.median(rows["send"]), statistics.median(rows["transfer"])
    print(f"throughput vs raw broadcast: send {raw / send:.2f}x, transfer phase {raw / transfer:.2f}x")
    fresh = f"send {raw_fresh / send:.2f}x, transfer phase {raw_fresh / transfer:.2f}x"
    print(f"  vs raw into fresh memory:  {fresh}")


if __name__ == "__main__":
    main()
