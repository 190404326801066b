"""Packed causal attention on one GPU: FlashAttention-2 varlen (torch's `varlen_attn`, what the packed actor
runs on CUDA), FlashAttention-4 (`fa4`: the flash-attn-4 package's kernels, where it is installed), compiled
FlexAttention with a block-diagonal causal mask (what the actor runs for shared-prefix trees), cuDNN's
ragged kernels (the aten ops behind nested-tensor SDPA) and dense SDPA row by row (cuDNN's kernel on
Hopper), forward and forward + backward.

    python bench/varlen_attn.py [--batches agentic,16384] [--repeats 10] [--out FILE]

Shapes are the Qwen3-1.7B attention's: 16 query heads, 8 key/value heads, head dim 128, bf16. Batches:
`agentic` (the rows of `bench/agentic_batch.py` at a 16k context, 65k tokens in one packed row), an
integer L (65,536 / L rows of L tokens), or row lengths joined by `+`. Each batch runs every kernel on
the same packed q, k, v; the time is the median of `--repeats` CUDA-event-timed calls after 3 warm-up
calls. TFLOP/s counts the causal FLOPs of the real rows (forward 2 x 2 x n(n+1)/2 x H x D per row,
backward 2.5x the forward).

Before timing, a check: on rows of awkward lengths (1 to 2049 tokens, a varlen bound above the longest
row, as the actor's packed rows carry), every kernel's output and q, k, v gradients against float32 SDPA
row by row; it prints each one's largest error relative to the reference's largest value (a kernel whose
gradients are wrong is still timed: its row says what it would cost). The first call of a kernel on a
shape (cuDNN builds its execution plan then) is timed apart.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "packages" / "molt" / "src"))  # molt._flex: the actor's compiled FlexAttention

H, K, D = 16, 8, 128


def bounds(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def flash(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))


class _CudnnRagged(torch.autograd.Function):
    """cuDNN's ragged (THD) attention through the aten ops torch's nested-tensor SDPA calls; torch 2.11
    has no public varlen entry to them (`varlen_attn`'s cuDNN branch is switched off)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        m = ctx.max_len
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, m, m, 0.0, True, scale=ctx.scale
        )
        return dq, dk, dv, None, None, None


def cudnn(q, k, v, cu, max_len, scale):
    return _CudnnRagged.apply(q, k, v, cu, max_len, scale)


def sdpa_rows(q, k, v, cu, max_len, scale):
    outs, edges = [], cu.tolist()
    for start, stop in itertools.pairwise(edges):
        q_, k_, v_ = (t[start:stop].transpose(0, 1)[None] for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


_BLOCK_MASKS: dict[tuple[int, ...], object] = {}  # by row bounds: built once a batch, as the actor does


def flex_block_mask(cu, num_tokens: int):
    """FlexAttention's block mask over the packed row: causal within each row of `cu`, never across
    (compiled `create_block_mask`, as `molt._flex` builds the trees' masks)."""
    from molt._flex import create_block_mask

    spans = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu.diff())

    def mask_mod(b, h, q, k):
        return (spans[q] == spans[k]) & (q >= k)

    return create_block_mask(mask_mod, None, None, num_tokens, num_tokens, device=cu.device)


def flex(q, k, v, cu, max_len, scale):
    from molt._flex import flex_attention

    key = tuple(cu.tolist())
    if key not in _BLOCK_MASKS:
        _BLOCK_MASKS[key] = flex_block_mask(cu, q.shape[0])
    q_, k_, v_ = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = flex_attention(q_, k_, v_, block_mask=_BLOCK_MASKS[key], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def fa4(q, k, v, cu, max_len, scale):
    """FlashAttention-4 (the flash-attn-4 package's CuTe kernels, Hopper's among them) on the same rows.
    torch 2.11 can route its flash entry points to it (`activate_flash_attention_impl("FA4")`), but its
    `varlen_attn` passes causal as a window, which that route's backward refuses: called directly."""
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
        softmax_scale=scale, causal=True,
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


KERNELS = {"flash": flash, "fa4": fa4, "flex": flex, "cudnn": cudnn, "sdpa-rows": sdpa_rows}


def inputs(lengths, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, D, device="cuda", dtype=dtype, generator=gen) for h in (H, K, K))
    return [t.requires_grad_() for t in (q, k, v)]


def check(report: dict) -> None:
    lengths = [1, 5, 130, 700, 2049, 64, 333]
    max_len = 4096  # a bound above the longest row, as the actor's power-of-two rounding gives
    scale = D**-0.5
    q32, k32, v32 = inputs(lengths, torch.float32, seed=1)
    cu = bounds(lengths, "cuda")
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = sdpa_rows(q32, k32, v32, cu, max_len, scale)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad)
    ref = ref.detach()
    for name, kernel in KERNELS.items():
        q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q32, k32, v32))
        try:
            out = kernel(q, k, v, cu, max_len, scale)
            grads = torch.autograd.grad(out, (q, k, v), grad.bfloat16())
        except Exception as error:  # noqa: BLE001 - a kernel that refuses is a result
            print(f"check {name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
            report["check"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            continue
        errors = {}
        for label, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
            errors[label] = float((got.float() - want).abs().max() / want.abs().max())
        print(f"check {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()), flush=True)
        report["check"][name] = errors


def flops(lengths: list[int]) -> float:
    return sum(2 * 2 * n * (n + 1) / 2 * H * D for n in lengths)


def elapsed(fn) -> float:
    """Seconds of one `fn()` on the GPU, between CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.median(elapsed(fn) for _ in range(repeats))


def batch_lengths(name: str) -> list[int]:
    if name == "agentic":
        from agentic_batch import agentic_rows

        return [sum(n for n, _ in row) for row in agentic_rows(65536, 16384)]
    if "+" in name:
        return [int(n) for n in name.split("+")]
    return [int(name)] * (65536 // int(name))


def run_batch(name: str, repeats: int, report: dict) -> None:
    lengths = batch_lengths(name)
    max_len = 1 << (max(lengths) - 1).bit_length()
    q, k, v = inputs(lengths, torch.bfloat16)
    cu, scale = bounds(lengths, "cuda"), D**-0.5
    grad = torch.randn_like(q)
    fwd_flops = flops(lengths)
    rows = {}
    print(f"batch {name}: {len(lengths)} rows, {sum(lengths)} tokens, longest {max(lengths)}", flush=True)
    for kernel_name, kernel in KERNELS.items():
        if "error" in report["check"].get(kernel_name, {}):
            continue

        def forward(kernel=kernel):
            with torch.no_grad():
                kernel(q, k, v, cu, max_len, scale)

        def both(kernel=kernel):
            torch.autograd.grad(kernel(q, k, v, cu, max_len, scale), (q, k, v), grad)

        first = elapsed(both)  # the first call on this shape: cuDNN builds its plans here
        fwd, fwd_bwd = timed(forward, repeats), timed(both, repeats)
        rows[kernel_name] = {"first_call_s": first, "forward_s": fwd, "forward_backward_s": fwd_bwd}
        rows[kernel_name]["forward_tflops"] = fwd_flops / fwd / 1e12
        rows[kernel_name]["forward_backward_tflops"] = 3.5 * fwd_flops / fwd_bwd / 1e12
    if "flex" in rows:  # the actor builds it once a forward, for every layer: apart from the kernel
        rows["flex"]["block_mask_s"] = timed(lambda: flex_block_mask(cu, sum(lengths)), repeats)
        print(f"flex's block mask: {rows['flex']['block_mask_s'] * 1e3:.2f} ms a batch", flush=True)
    base = rows.get("flash")
    print("| kernel | first call s | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | x flash |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kernel_name, row in rows.items():
        ratio = base["forward_backward_s"] / row["forward_backward_s"] if base else float("nan")
        print(
            f"| {kernel_name} | {row['first_call_s']:.3f} | {row['forward_s'] * 1e3:.1f} | "
            f"{row['forward_tflops']:.0f} | {row['forward_backward_s'] * 1e3:.1f} | "
            f"{row['forward_backward_tflops']:.0f} | {ratio:.2f} |",
            flush=True,
        )
    name = "rows" if "+" in name else name
    report["batches"][name] = {"rows": len(lengths), "tokens": sum(lengths), "kernels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="agentic,16384")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/varlen_attn.py measures CUDA kernels: no CUDA device here")
    device = torch.cuda.get_device_name()
    print(f"{device}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    report: dict = {"device": device, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    report.update(check={}, batches={})
    check(report)
    for name in args.batches.split(","):
        run_batch(name, args.repeats, report)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
