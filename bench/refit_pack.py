"""The sender's gather-and-pack throughput, against torch.cat and a flat device copy of the same bytes.

Builds a randomly initialised Qwen3 from a config (nothing downloaded; `--model qwen3-1.7b` gives
Qwen3-1.7B's shapes: hidden 2048, 28 layers, vocabulary 151,936, tied embeddings, 1.72B parameters)
and times, per bucket size:

- pack: refit's `pack_bucket` over the plain parameters, vs `torch.cat` per bucket (what vLLM's
  `pack_tensors` does) and vs one flat copy of each bucket's byte count (the device-copy ceiling);
- gather + pack: the sender's own path, `packed_buckets(full_params(model))` into two reused buffers,
  on the model after FSDP2 `fully_shard` (per decoder layer and root) over a world of one rank, so
  every parameter is a DTensor and goes through `full_tensor()`; and the gather alone.

Rates are payload bytes (the model's bytes) per second; a copy reads and writes each byte, so the
device moves twice that. Needs only torch and transformers: it runs on a GPU machine without vLLM.

    uv run --no-sync python bench/refit_pack.py --device cpu --hidden 256 --layers 2
    PYTHONPATH=packages/refit/src python bench/refit_pack.py --device cuda --model qwen3-1.7b
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from refit import ParamSpec, full_params, pack_bucket, plan_buckets
from refit._buckets import packed_buckets

# Qwen3-1.7B's config.json (shapes only).
QWEN3_1_7B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
)  # fmt: skip


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{platform.node()} / {torch.cuda.get_device_name(device)}"
    with open("/proc/cpuinfo") as info:
        cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    return f"{platform.node()} / {cpu} ({torch.get_num_threads()} threads)"


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if args.model == "qwen3-1.7b":
        shape = QWEN3_1_7B
    else:
        shape = dict(
            vocab_size=32768, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 128),
            num_key_value_heads=max(1, args.hidden // 512), head_dim=128, tie_word_embeddings=False,
        )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(args.device):
        return Qwen3ForCausalLM(Qwen3Config(**shape)).to(getattr(torch, args.dtype))


def timed(fn, device: str, repeats: int) -> float:
    """Median wall seconds of `fn()` (device synchronised), after one warm-up call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def shard_world_of_one(model: torch.nn.Module, device: str) -> None:
    """FSDP2 over one rank: every parameter becomes a DTensor that `full_tensor()` gathers."""
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=["custom", "qwen3-1.7b"], default="custom")
    parser.add_argument("--hidden", type=int, default=512, help="custom model only")
    parser.add_argument("--layers", type=int, default=8, help="custom model only")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = args.device
    model = build_model(args)
    tensors = [p.detach() for p in model.parameters()]
    specs = [ParamSpec(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    total = sum(s.nbytes for s in specs)
    num_params = sum(p.numel() for p in tensors)
    print(f"machine: {machine_name(device)}   torch {torch.__version__}")
    print(f"model: Qwen3 {args.model} {num_params / 1e9:.2f}B params {args.dtype}, {len(specs)} tensors, "
          f"{total / 2**20:.0f} MiB on {device}")  # fmt: skip
    flat_src = torch.empty(total, dtype=torch.uint8, device=device).random_()
    flat_dst = torch.empty(total, dtype=torch.uint8, device=device)
    copy_rate = total / timed(lambda: flat_dst.copy_(flat_src), device, args.repeats) / 1e9
    print(f"one flat device copy of {total / 2**20:.0f} MiB: {copy_rate:.0f} GB/s payload")

    rows = []
    for bucket_mb in args.bucket_mb:
        plan = plan_buckets(specs, int(bucket_mb * 2**20))
        sizes = [sum(specs[i].nbytes for i in b) for b in plan]
        buffers = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(2)]

        def refit_pack(plan=plan, buffers=buffers):
            for k, bucket in enumerate(plan):
                pack_bucket(buffers[k % 2], [tensors[i] for i in bucket])

        def cat_pack(plan=plan):
            for bucket in plan:
                torch.cat([tensors[i].contiguous().view(-1).view(torch.uint8) for i in bucket])

        def flat_copy(sizes=sizes, buffers=buffers):
            for k, size in enumerate(sizes):
                buffers[k % 2][:size].copy_(flat_src[:size])

        rates = [total / timed(fn, device, args.repeats) / 1e9 for fn in (refit_pack, cat_pack, flat_copy)]
        rows.append([bucket_mb, len(plan), *rates])

    expected_N = torch.cat([t.view(-1).view(torch.uint8) for t in tensors])  # what every path must send
    tensors.clear()  # fully_shard makes its own sharded copies
    shard_world_of_one(model, device)
    for row in rows:
        plan = plan_buckets(specs, int(row[0] * 2**20))
        size = max(sum(specs[i].nbytes for i in b) for b in plan)
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]

        def gather_pack(plan=plan, buffers=buffers):
            for _ in packed_buckets(iter(full_params(model)), specs, plan, buffers):
                pass

        offset = 0  # the gathered buckets hold exactly the model's bytes, in order
        for _, payload_N in packed_buckets(iter(full_params(model)), specs, plan, buffers):
            assert torch.equal(payload_N, expected_N[offset : offset + payload_N.numel()])
            offset += payload_N.numel()
        assert offset == total

        def gather_only():
            for _ in full_params(model):
                pass

        row += [total / timed(fn, device, args.repeats) / 1e9 for fn in (gather_pack, gather_only)]

    print("GB/s of payload; ratios against the flat copy of the same buckets (2 alternating buffers)")
    print(f"{'bucket MiB':>10} {'buckets':>7} {'pack':>7} {'cat':>7} {'copy':>7} {'FSDP gather+pack':>17} "
          f"{'gather':>7} {'pack/cat':>9} {'pack/copy':>10} {'g+p/copy':>9}")  # fmt: skip
    for bucket_mb, num, pack, cat, copy, gp, gather in rows:
        print(f"{bucket_mb:>10g} {num:>7} {pack:>7.0f} {cat:>7.0f} {copy:>7.0f} {gp:>17.0f} {gather:>7.0f} "
              f"{pack / cat:>9.2f} {pack / copy:>10.2f} {gp / copy:>9.2f}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
