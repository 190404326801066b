"""Full vs delta refit over consecutive steps of real training: bytes and seconds per refit, one run.

Trains a seeded tiny Qwen3 (fp32 master weights, AdamW at `--lr`, next-token loss on random token
rows) for `--steps` optimizer steps and keeps each step's weights cast to `--dtype` (what a refit sends).
One vLLM CPU server (refit_gloo, `--dtype` engine) then takes those versions twice, in order: once by
full refits, once by delta refits (the first delta refit has no base and goes whole; it is left out
of the delta numbers). Both passes are verified (every bucket's CRC-32 is checked by the engine) and
each ends with a logprob check of the engine against the trainer's last version in transformers.
Printed per pass: median bytes on the wire and seconds (send, transfer phase, pause..resume), the
engine's CRC and load time, and the fraction of elements that changed per step. Usage:

    uv run --no-sync python bench/refit_delta.py --hidden 512 --layers 8 --steps 20 --lr 1e-6

`--engine fake` runs the refit tests' fake engine instead (no vLLM; its load is one copy per tensor).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from refit_cpu import fake_engine
from tito_overhead import machine

import refit

HERE = Path(__file__).resolve().parent


def train(model: torch.nn.Module, steps: int, lr: float, dtype: torch.dtype, seed: int) -> list[dict]:
    """`steps` AdamW steps of next-token loss on random rows; every version's weights in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    vocab = model.config.vocab_size
    versions = [{n: p.detach().to(dtype).clone() for n, p in model.named_parameters()}]
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 64), generator=gen)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        versions.append({n: p.detach().to(dtype).clone() for n, p in model.named_parameters()})
    return versions


def changed_fraction(versions: list[dict]) -> list[float]:
    out = []
    for old, new in zip(versions, versions[1:], strict=False):
        changed = sum(int((old[n] != new[n]).sum()) for n in new)
        out.append(changed / sum(t.numel() for t in new.values()))
    return out


def run_pass(engine, server_model, versions, *, delta: bool, bucket_bytes: int, offset: int, vllm: bool):
    rows: list[dict] = []
    for index, state in enumerate(versions):
        server_model.load_state_dict(state)
        began = time.perf_counter()
        stats = refit.update_weights(
            [engine], refit.full_params(server_model), version=offset + index, bucket_bytes=bucket_bytes,
            delta=delta,
        )  # fmt: skip
        wall = time.perf_counter() - began
        assert not stats.verify_failed, stats.verify_failed
        worker = engine.worker_timings()[0] if vllm else {}
        skip = ("check", "connect", "gather_pack", "checksum", "diff", "send")
        rows.append({
            "bytes": stats.bytes_sent, "num_bytes": stats.num_bytes, "wall": wall,
            "total": sum(v for k, v in stats.seconds.items() if k not in skip),
            "send": stats.seconds["send"], "transfer": stats.seconds["transfer"],
            "gather_pack": stats.seconds["gather_pack"], "checksum": stats.seconds["checksum"],
            "diff": stats.seconds.get("diff", 0.0),
            "engine_verify": worker.get("verify_s", math.nan), "engine_load": worker.get("load_s", math.nan),
        })  # fmt: skip
    return rows


def logprob_error(url: str, model: torch.nn.Module) -> float:
    sys.path.insert(0, str(HERE.parent / "tests" / "refit"))
    from refit_helpers import max_logprob_error

    return max_logprob_error(url, model.float().eval())


@contextlib.contextmanager
def serve(kind: str, model_dir: Path, dtype: str, log_path: Path):
    """A vLLM CPU server with refit's flags and a `dtype` engine, or the fake engine; yields its URL."""
    from molt.vllm_server import VLLMServer

    if kind == "fake":
        with fake_engine(model_dir, log_path) as url:
            yield url
        return
    flags = [*refit.engine_flags(), "--dtype", dtype]  # after molt's CPU default (float32): this one wins
    with VLLMServer(model_dir, extra_args=flags, log_path=log_path) as server:
        yield server.url


def report(args, passes: dict, fractions: list[float], errors: dict, train_s: float) -> None:
    num_bytes = passes["full"][0]["num_bytes"]
    print(f"machine: {machine()}")
    print(f"engine: {args.engine} ({args.dtype}); trainer: fp32 master weights, AdamW lr {args.lr:g}")
    print(f"model: tiny Qwen3 hidden={args.hidden} layers={args.layers}, {num_bytes / 2**20:.1f} MiB")
    print(f"{args.steps} training steps ({train_s:.1f} s); buckets of {args.bucket_mb:g} MiB")
    print(f"medians over the refits of steps 1..{args.steps}, each pass in order")
    print(
        f"elements changed per step in {args.dtype}: median {statistics.median(fractions):.4%}, "
        f"min {min(fractions):.4%}, max {max(fractions):.4%}"
    )
    keys = ["bytes", "send", "gather_pack", "checksum", "diff", "transfer", "engine_verify", "engine_load"]
    print(f"{'per refit':<34} {'full':>12} {'delta':>12} {'full/delta':>11}")
    for key in [*keys, "total", "wall"]:
        full, delta = (statistics.median(r[key] for r in passes[name]) for name in ("full", "delta"))
        ratio = full / delta if delta else math.inf
        if key == "bytes":
            mib = f"{full / 2**20:>12.3f} {delta / 2**20:>12.3f}"
            print(f"{'bytes on the wire (MiB)':<34} {mib} {ratio:>10.1f}x")
        else:
            print(f"{key + ' (s)':<34} {full:>12.4f} {delta:>12.4f} {ratio:>10.2f}x")
    if errors:
        print(f"max |engine - transformers| logprob after each pass: {errors}")


def main() -> None:
    from transformers import AutoModelForCausalLM

    from molt.tiny import build_tiny_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--bucket-mb", type=float, default=8)
    parser.add_argument("--engine", choices=["vllm", "fake"], default="vllm")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    work = Path(tempfile.mkdtemp(prefix="refit-delta-"))
    model_dir = build_tiny_model(work / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    began = time.perf_counter()
    versions = train(model, args.steps, args.lr, dtype, seed=0)
    train_s = time.perf_counter() - began
    server_model = copy.deepcopy(model).to(dtype)
    vllm = args.engine == "vllm"
    passes, errors = {}, {}
    with serve(args.engine, model_dir, args.dtype, work / "server.log") as url:
        engine = refit.Engine(url)
        for name, delta in (("full", False), ("delta", True)):
            rows = run_pass(
                engine, server_model, versions, delta=delta, bucket_bytes=int(args.bucket_mb * 2**20),
                offset=0 if name == "full" else 1000, vllm=vllm,
            )  # fmt: skip
            passes[name] = rows[1:]  # version 0 sets the engine up (a delta base needs a whole refit first)
            if vllm:
                errors[name] = logprob_error(url, copy.deepcopy(server_model))
        engine.close()
    report(args, passes, changed_fraction(versions), errors, train_s)


if __name__ == "__main__":
    main()
