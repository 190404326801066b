"""Peak extra memory and time of `rlestimators.token_logprobs` against the naive float32 log_softmax.

    python bench/token_logprobs.py [--tokens 8192] [--vocab 151936] [--dtype bf16] [--device cpu|cuda]

Naive: `torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])`. Both run on the same random
logits ([1, tokens, vocab], standard normal) and random token ids, forward alone (under no_grad, as when
computing old or reference logprobs) and forward + backward (logits a leaf; loss = sum of weighted logp).

Every (variant, pass) runs in a fresh subprocess, so one cannot inherit another's allocator cache or memory
high-water mark. In it: the inputs are made, one warm-up call runs (excluded from the time), then
`--repeats` timed calls; the time is their median. Peak extra memory is the high-water mark during warm-up
and repeats minus the level just before them (inputs in place): on CUDA from torch.cuda.max_memory_allocated
(exact tensor bytes); on CPU from the kernel's resident-set high-water mark VmHWM in /proc/self/status,
reset to the current RSS through /proc/self/clear_refs where the kernel allows it (tracemalloc does not see
torch's allocations). The fwd+bwd peak includes the gradient of the logits ([tokens, vocab] in their dtype),
which any method must produce; the table also gives the ratio without it.

Needs only torch: without the workspace installed, rlestimators is imported from packages/rlestimators/src
relative to this file.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

try:
    import rlestimators
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "packages" / "rlestimators" / "src"))
    import rlestimators

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def naive_logprobs(logits, tokens, temperature):
    logits_f32 = logits.float() if temperature == 1.0 else logits.float() / temperature
    return torch.log_softmax(logits_f32, -1).gather(-1, tokens[..., None]).squeeze(-1)


def chunked_logprobs(logits, tokens, temperature):
    return rlestimators.token_logprobs(logits, tokens, temperature=temperature)


VARIANTS = {"naive": naive_logprobs, "chunked": chunked_logprobs}


def machine_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    model = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    threads = torch.get_num_threads()
    return f"{model}, {os.cpu_count()} cores, {threads} torch threads (torch {torch.__version__})"


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Bytes above the level at construction, high-water mark (CUDA allocator, or CPU resident set)."""

    def __init__(self, device: str):
        self.device = device
        if device == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self.base = _vm_kib("VmRSS") * 1024
        except OSError:
            self.base = _vm_kib("VmHWM") * 1024

    def extra(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _vm_kib("VmHWM") * 1024 - self.base


def make_inputs(num_tokens: int, vocab: int, dtype: str, device: str):
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(1, num_tokens, vocab, dtype=DTYPES[dtype], device=device)
    # Filled a slice at a time: a float32 temporary of the whole tensor would raise the CPU high-water mark.
    for start in range(0, num_tokens, 256):
        logits[:, start : start + 256].normal_(generator=generator)
    tokens = torch.randint(0, vocab, (1, num_tokens), device=device, generator=generator)
    weights = torch.rand(1, num_tokens, device=device, generator=generator)
    return logits, tokens, weights


def run_worker(args) -> None:
    device, variant, bench_pass = args.worker
    fn = VARIANTS[variant]
    logits, tokens, weights = make_inputs(args.tokens, args.vocab, args.dtype, device)
    if bench_pass == "fwd+bwd":
        logits.requires_grad_(True)

    def call():
        if bench_pass == "forward":
            with torch.no_grad():
                fn(logits, tokens, args.temperature)
        else:
            (fn(logits, tokens, args.temperature) * weights).sum().backward()
            logits.grad = None

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    peak = PeakMemory(device)
    call()
    sync()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    print(json.dumps({"time_s": statistics.median(times), "extra_bytes": peak.extra()}))


def check_agreement(args, device) -> str:
    """Max |difference| of logp and of the logits' gradient on the first 256 rows, in the same run."""
    logits, tokens, weights = make_inputs(256, args.vocab, args.dtype, device)
    results = []
    for fn in (naive_logprobs, chunked_logprobs):
        leaf = logits.detach().requires_grad_(True)
        logp = fn(leaf, tokens, args.temperature)
        (logp * weights).sum().backward()
        results.append((logp.detach(), leaf.grad.float()))
    (logp_a, grad_a), (logp_b, grad_b) = results
    return (
        f"agreement on 256 rows: max |logp diff| {(logp_a - logp_b).abs().max().item():.2e}, "
        f"max |grad diff| {(grad_a - grad_b).abs().max().item():.2e}"
    )


def spawn(args, device, variant, bench_pass) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        device,
        variant,
        bench_pass,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--temperature",
        str(args.temperature),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} {bench_pass} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the logits (B * T)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3: 151,936)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed calls after one warm-up; median reported"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    gib = 2**30
    grad_bytes = args.tokens * args.vocab * DTYPES[args.dtype].itemsize
    print(f"machine: {machine_name(args.device)}")
    print(
        f"logits [1, {args.tokens}, {args.vocab}] {args.dtype} on {args.device} "
        f"({grad_bytes / gib:.2f} GiB), temperature {args.temperature}, median of {args.repeats}"
    )
    memory_method = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "VmHWM (resident set)"
    print(f"memory: peak above the inputs, {memory_method}, one fresh process per row")
    print(check_agreement(args, args.device))
    print(f"{'pass':<8} {'variant':<8} {'time ms':>9} {'extra peak GiB':>15}")
    for bench_pass in ("forward", "fwd+bwd"):
        row = {variant: spawn(args, args.device, variant, bench_pass) for variant in VARIANTS}
        for variant, result in row.items():
            time_ms, extra_gib = result["time_s"] * 1e3, result["extra_bytes"] / gib
            print(f"{bench_pass:<8} {variant:<8} {time_ms:9.1f} {extra_gib:15.3f}")
        naive, chunked = row["naive"], row["chunked"]
        memory_ratio = naive["extra_bytes"] / chunked["extra_bytes"]
        time_ratio = chunked["time_s"] / naive["time_s"]
        line = f"{bench_pass:<8} ratios: memory naive/chunked {memory_ratio:.1f}x, "
        line += f"time chunked/naive {time_ratio:.2f}x"
        if bench_pass == "fwd+bwd":
            beyond = (naive["extra_bytes"] - grad_bytes) / max(chunked["extra_bytes"] - grad_bytes, 1)
            line += f", memory beyond the logits' gradient {beyond:.1f}x"
        print(line)


if __name__ == "__main__":
    main()
