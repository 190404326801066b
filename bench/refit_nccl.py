"""refit's sender over NCCL: packed buckets from rank 0 to a receiving rank, against one raw broadcast.

Two processes, one GPU each (or two CPU processes over gloo, to check the logic). Rank 0 holds the full
parameters of a Qwen3 of the given shape (bf16, random; nothing downloaded) and sends them the way refit
does on GPU: `plan_buckets` splits the parameter list into buckets, `packed_buckets` packs each bucket
into one of two reused buffers, and each bucket is broadcast as soon as it is packed; the sender waits
for bucket k-1's broadcast before packing bucket k+1 into its buffer (`refit._run.Run._send`). The
receiving rank takes each bucket into its own two buffers and views it as named tensors
(`unpack_bucket`, no copy), as vLLM's packed receiver does. The baseline, in the same run: one torch
NCCL broadcast of one buffer of the same byte count.

Two ways to send, one row each:
- overlap: torch's ProcessGroupNCCL, whose broadcast runs on its own stream, so packing bucket k+1
  overlaps broadcasting bucket k;
- serial: every broadcast waited for before the next bucket is packed, which is the order vLLM's
  PyNcclCommunicator gives (refit's NCCL channel on GPU broadcasts on the current stream).

A refit uses vLLM's communicator; vLLM is not needed here, torch's NCCL moves the same bytes. The
time of a transfer runs from a barrier to a barrier after both ranks have synchronised, so it counts
the receiver's last byte. Rates are payload bytes per second (the model's bytes once).
A verification pass checks per-bucket byte sums on both ranks before anything is timed.

    python bench/refit_nccl.py --model qwen3-1.7b                      # two GPUs
    uv run --no-sync python bench/refit_nccl.py --device cpu --hidden 128 --layers 2 --bucket-mb 1 4
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refit import ParamSpec, plan_buckets, unpack_bucket
from refit._buckets import bucket_nbytes, packed_buckets

# Shapes only, from each model's config.json (untied where the model is).
SHAPES = {
    "qwen3-1.7b": dict(vocab=151936, hidden=2048, inter=6144, layers=28, heads=16, kv_heads=8, tied=True),
    "qwen3-8b": dict(vocab=151936, hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, tied=False),
}
HEAD_DIM = 128


def qwen3_specs(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tied: bool):
    """The parameter list of a Qwen3 causal LM, in `named_parameters()` order, as bf16 specs."""
    bf16 = torch.bfloat16
    q, kv = heads * HEAD_DIM, kv_heads * HEAD_DIM
    specs = [ParamSpec("model.embed_tokens.weight", bf16, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            ParamSpec(p + "self_attn.q_proj.weight", bf16, (q, hidden)),
            ParamSpec(p + "self_attn.k_proj.weight", bf16, (kv, hidden)),
            ParamSpec(p + "self_attn.v_proj.weight", bf16, (kv, hidden)),
            ParamSpec(p + "self_attn.o_proj.weight", bf16, (hidden, q)),
            ParamSpec(p + "self_attn.q_norm.weight", bf16, (HEAD_DIM,)),
            ParamSpec(p + "self_attn.k_norm.weight", bf16, (HEAD_DIM,)),
            ParamSpec(p + "mlp.gate_proj.weight", bf16, (inter, hidden)),
            ParamSpec(p + "mlp.up_proj.weight", bf16, (inter, hidden)),
            ParamSpec(p + "mlp.down_proj.weight", bf16, (hidden, inter)),
            ParamSpec(p + "input_layernorm.weight", bf16, (hidden,)),
            ParamSpec(p + "post_attention_layernorm.weight", bf16, (hidden,)),
        ]
    specs.append(ParamSpec("model.norm.weight", bf16, (hidden,)))
    if not tied:
        specs.append(ParamSpec("lm_head.weight", bf16, (vocab, hidden)))
    return specs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def send_buckets(tensors, specs, plan, buffers, *, serial: bool) -> None:
    """Rank 0: refit's sender loop over a plain parameter stream (`serial`: wait for every send)."""
    pending = None
    stream = zip((s.name for s in specs), tensors, strict=True)
    for _, payload_N in packed_buckets(stream, specs, plan, buffers):
        if pending is not None:
            pending.wait()  # bucket k-1 is out: bucket k+1 may reuse its buffer
        pending = dist.broadcast(payload_N, src=0, async_op=True)
        if serial:
            pending.wait()
    if pending is not None:
        pending.wait()


def receive_buckets(specs, plan, buffers) -> list[torch.Tensor]:
    """Rank 1: each bucket into the next of two buffers, then viewed as its named tensors."""
    payloads = []
    for index, bucket in enumerate(plan):
        payload_N = buffers[index % 2][: bucket_nbytes(specs, bucket)]
        dist.broadcast(payload_N, src=0)
        unpack_bucket(payload_N, [specs[i] for i in bucket])
        payloads.append(payload_N)
    return payloads


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` from barrier to barrier (both ranks synchronised), after one warm-up."""
    samples = []
    for _ in range(repeats + 1):
        dist.barrier()
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        dist.barrier()
        sync(device)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples[1:])


def verify(rank, tensors, specs, plan, buffers, device) -> None:
    """One pass with a byte sum per bucket on each side; the receiver's sums must equal the sender's."""
    sums = []
    if rank == 0:
        stream = zip((s.name for s in specs), tensors, strict=True)
        for _, payload_N in packed_buckets(stream, specs, plan, buffers):
            sums.append(payload_N.sum(dtype=torch.int64))
            dist.broadcast(payload_N, src=0)
    else:
        for index, bucket in enumerate(plan):
            payload_N = buffers[index % 2][: bucket_nbytes(specs, bucket)]
            dist.broadcast(payload_N, src=0)
            sums.append(payload_N.sum(dtype=torch.int64))
    sums_K = torch.stack(sums)
    both = [torch.empty_like(sums_K) for _ in range(2)]
    dist.all_gather(both, sums_K)
    assert torch.equal(both[0], both[1]), "the receiver's buckets differ from the sender's"
    sync(device)


def run(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=device if on_gpu else None,
    )
    shape = SHAPES.get(args.model) or dict(
        vocab=32768, hidden=args.hidden, inter=3 * args.hidden, layers=args.layers,
        heads=max(1, args.hidden // 128), kv_heads=max(1, args.hidden // 512), tied=False,
    )  # fmt: skip
    specs = qwen3_specs(**shape)
    total = sum(s.nbytes for s in specs)
    gen = torch.Generator(device).manual_seed(0)
    tensors = (
        [torch.randn(s.shape, generator=gen, device=device, dtype=s.dtype) for s in specs]
        if rank == 0
        else []
    )
    flat_N = torch.empty(total, dtype=torch.uint8, device=device)
    raw_s = timed(lambda: dist.broadcast(flat_N, src=0), device, args.repeats)
    rows = []
    for bucket_mb in args.bucket_mb:
        plan = plan_buckets(specs, int(bucket_mb * 2**20))
        size = max(bucket_nbytes(specs, b) for b in plan)
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        verify(rank, tensors, specs, plan, buffers, device)
        for serial in (False, True):

            def transfer(plan=plan, buffers=buffers, serial=serial):
                if rank == 0:
                    send_buckets(tensors, specs, plan, buffers, serial=serial)
                else:
                    receive_buckets(specs, plan, buffers)

            seconds = timed(transfer, device, args.repeats)
            rows.append((bucket_mb, len(plan), "serial" if serial else "overlap", seconds))
        del buffers
    if rank == 0:
        report(args, device, specs, total, raw_s, rows)
    dist.destroy_process_group()


def report(args, device, specs, total, raw_s, rows) -> None:
    if device.type == "cuda":
        machine = f"{platform.node()} / 2 x {torch.cuda.get_device_name(device)}"
    else:
        machine = f"{platform.node()} / CPU, gloo"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    print(f"machine: {machine}   torch {torch.__version__}   nccl {nccl}")
    print(f"model: Qwen3 {args.model} shapes, {len(specs)} bf16 tensors, {total / 2**20:.0f} MiB")
    raw = total / raw_s / 1e9
    print(f"raw broadcast of one {total / 2**20:.0f} MiB buffer: {raw_s * 1e3:.2f} ms, {raw:.1f} GB/s")
    print(f"{'bucket MiB':>10} {'buckets':>7} {'send':>8} {'ms':>8} {'GB/s':>8} {'x raw':>6}")
    for bucket_mb, num, mode, seconds in rows:
        rate = total / seconds / 1e9
        print(f"{bucket_mb:>10g} {num:>7} {mode:>8} {seconds * 1e3:>8.2f} {rate:>8.1f} {rate / raw:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cuda", "cpu"], default=default_device)
    parser.add_argument("--model", choices=["custom", *SHAPES], default="custom")
    parser.add_argument("--hidden", type=int, default=512, help="custom model only")
    parser.add_argument("--layers", type=int, default=8, help="custom model only")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs two CUDA devices, found {torch.cuda.device_count()} (or pass --device cpu)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run, args=(port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
