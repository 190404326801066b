"""Bucket packing throughput of refit's sender, against torch.cat and a flat copy of the same bytes.

Packs the state dict of a randomly initialised Qwen3 (built from a config, nothing downloaded) into
buckets with refit's own code (`plan_buckets` + `pack_bucket` into a reused buffer), and compares with
`torch.cat` per bucket (what vLLM's `pack_tensors` does) and with one contiguous copy of each bucket's
byte count (the memory-bandwidth ceiling). Needs only torch and transformers: it runs on a GPU machine
without vLLM. Usage:

    uv run --no-sync python bench/refit_pack.py --device cpu --hidden 512 --layers 8
    PYTHONPATH=packages/refit/src python bench/refit_pack.py --device cuda --hidden 2048 --layers 16
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from refit import ParamSpec, pack_bucket, plan_buckets


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{platform.node()} / {torch.cuda.get_device_name(device)}"
    with open("/proc/cpuinfo") as info:
        cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    return f"{platform.node()} / {cpu} ({torch.get_num_threads()} threads)"


def build_state(hidden: int, layers: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32768, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512), head_dim=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return {name: param.detach() for name, param in model.named_parameters()}


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    state = build_state(args.hidden, args.layers, getattr(torch, args.dtype), args.device)
    specs = [ParamSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    tensors = list(state.values())
    total = sum(s.nbytes for s in specs)
    print(f"machine: {machine_name(args.device)}   torch {torch.__version__}")
    print(f"model: Qwen3 hidden={args.hidden} layers={args.layers} {args.dtype}, {len(specs)} tensors, "
          f"{total / 2**20:.1f} MiB on {args.device}")  # fmt: skip
    print(f"{'bucket MiB':>10} {'buckets':>8} {'refit GB/s':>11} {'cat GB/s':>9} {'copy GB/s':>10} "
          f"{'refit/cat':>10} {'refit/copy':>11}")  # fmt: skip
    for bucket_mb in args.bucket_mb:
        plan = plan_buckets(specs, int(bucket_mb * 2**20))
        sizes = [sum(specs[i].nbytes for i in b) for b in plan]
        buffer = torch.empty(max(sizes), dtype=torch.uint8, device=args.device)
        flat_src = torch.empty(max(sizes), dtype=torch.uint8, device=args.device)

        def refit_pack(plan=plan, buffer=buffer):
            for bucket in plan:
                pack_bucket(buffer, [tensors[i] for i in bucket])

        def cat_pack(plan=plan):
            for bucket in plan:
                torch.cat([tensors[i].contiguous().view(-1).view(torch.uint8) for i in bucket])

        def flat_copy(sizes=sizes, buffer=buffer, flat_src=flat_src):
            for size in sizes:
                buffer[:size].copy_(flat_src[:size])

        rates = [
            total / timed(fn, args.device, args.repeats) / 1e9 for fn in (refit_pack, cat_pack, flat_copy)
        ]
        print(f"{bucket_mb:>10g} {len(plan):>8} {rates[0]:>11.2f} {rates[1]:>9.2f} {rates[2]:>10.2f} "
              f"{rates[0] / rates[1]:>10.2f} {rates[0] / rates[2]:>11.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
