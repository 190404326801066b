"""One full train step of Molt's policy actor on one GPU, against a plain transformers + AdamW loop.

Random-initialised models (nothing downloaded): a Qwen3-1.7B-shaped dense model (its sizes, tied embeddings,
vocabulary 151,936), `small`, a Qwen3 of SmolLM2-135M's sizes (a step's fixed costs: `--batches 48
--tokens-per-step 1536` is about row 1 of bench/peer_trl_gpu.py, 32 rows of 48 tokens), and a small
Qwen3-MoE. Each batch (`--batches`) holds at least `--tokens-per-step` tokens, random ids: equal rows of N
tokens (the first quarter of each a prompt, loss mask 0), or `agentic`: episodes of 1-12 turns with
lognormal prompt, reply (trained) and tool-output lengths, about 3.2k tokens a row, at most
`--agentic-max-len` (bench/agentic_batch.py), or rows that share prefixes, whatever `--tokens-per-step`
(bench/shared_prefix_batch.py): `prompt4k`, 16 prompts of 4096 tokens x 8 samples of 512, and `multiturn`,
8-turn agent episodes after a 2048-token system prompt, one row per turn, each beginning with the episode's
earlier turns. For each model and batch, every case runs in its own subprocess, one after the other on the
same GPU:

- `plain`: transformers' `AutoModelForCausalLM` in float32 on the GPU, computing in bf16 under
  `torch.autocast`, activation checkpointing on, naive float32 logprobs (`logits.float().log_softmax(-1)`),
  the PPO clipped loss, gradient clipping, torch AdamW; micro-batches of consecutive rows, as many as
  `--micro-batch-tokens` allows of the batch's longest, each right-padded to its own longest row.
- `molt-packed`: the real `molt._actor.PolicyWorker` (NeMo AutoModel + FSDP2, one rank, float32 master
  weights computing in bf16) with Molt's defaults: rows packed end to end with varlen attention in
  micro-batches of `--actor.micro_batch_tokens` (0 = sized from free memory; `--molt-micro-batch-tokens`),
  `--actor.compile auto` (on: compiled in the warm-up step, outside the timed ones).
  `molt-padded` is that with `--actor.pack false` (rows padded, grouped by length under the same budget);
  `molt-eager` with `--actor.compile off`; `molt-ac` with `--actor.activation_checkpointing` (compile then
  off); `molt-offload` with `--fsdp.offload`; `molt-logits` with the LM head giving [B, T, V] logits again
  (the path tensor parallelism keeps) instead of `rlestimators.lm_head_logprobs`; `molt-shared` with
  `--actor.shared_prefix` (rows that begin alike share the prefix's computation, FlexAttention; the
  batch planned as the policy group plans it, a group's rows in one micro-batch, inside the timed step);
  `molt-layer-units` with every decoder layer an FSDP unit of its own (`molt._sharding.UNIT_BYTES` 0), as
  one rank was sharded before small layers shared a unit.

A step is `train_step(batch)`: the forward gives the logprobs (old logprobs are that forward's,
detached: one update per batch), the loss, backward, clipping and AdamW; one forward and one backward per
micro-batch on both sides (plus checkpointing's recomputed forward). One warm-up step, then `--steps`
timed ones (wall clock around a synchronised step); tokens/s is the rows' tokens over the median step.
Peak memory is `torch.cuda.max_memory_allocated` over the steps (the model loaded, stats reset first).

MFU counts model FLOPs only: per token 6 x the parameters a token passes through (every linear layer and
the LM head; for the MoE the router and its top-k experts) plus causal attention, 6 x layers x n x
(heads x head_dim) for a row of n; checkpointing's recomputation is not counted. It is divided by a bf16
8192^3 matmul measured in the same run (median of 20). Beside it, what the run would log
(`PolicyWorker.take_pass_counts` as `actor/*`): `molt MFU` (its FLOPs over the GPU's datasheet bf16 peak,
H100/H200 only), `molt tokens/s` (over the passes' seconds, without the optimizer step) and `padding`
(the share of token slots that held no token; the plain loop's counted here), `shared`
(`actor/shared_prefix_frac`: the share of the rows' tokens a shared prefix saved a slot for). Tokens/s
and both MFUs count every row's tokens and FLOPs, shared or not: molt-shared's are the work it spared
counted as done, so that its tokens/s compares with molt-packed's. The table names the GPU; `x plain`,
`x padded` and `x packed` are a case's speed over the plain loop's, molt-padded's and molt-packed's on
the same batch.

`--profile`: each case runs one more step under torch's profiler and prints GPU time by kernel kind, the
slowest kernels, the torch ops (with input shapes) that launched the most GPU time and those that took
the most host time; then one more under cProfile, the Python functions by cumulative time (where a step
of little arithmetic, `small`'s, spends its wall clock).

    python bench/actor_gpu.py --models dense --batches 16384,agentic     # the ratio table, ~12 minutes
    python bench/actor_gpu.py --models dense --batches 4096 --steps 1 --cases plain,molt-packed   # smoke
    python bench/actor_gpu.py --models dense --batches prompt4k,multiturn --cases molt-packed,molt-shared \
        --case-timeout 600   # shared prefixes against packed rows on one GPU, Qwen3-1.7B shape

Needs CUDA, torch, transformers, NeMo AutoModel, msgspec; imports molt, rlestimators and refit from the
workspace (PYTHONPATH=packages/*/src when the workspace is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from agentic_batch import agentic_rows, train_batch
from shared_prefix_batch import SHARED_BATCHES, plan_shared, shared_batch

MODELS = {
    "dense": dict(
        kind="dense", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "small": dict(  # SmolLM2-135M's sizes (row 1 of bench/peer_trl_gpu.py): where fixed costs show
        kind="dense", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
    ),
    "moe": dict(
        kind="moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=12,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, router_aux_loss_coef=0.0, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False,
    ),
}  # fmt: skip
CASES = ("plain", "molt-packed", "molt-padded", "molt-eager", "molt-ac", "molt-offload", "molt-logits",
         "molt-shared", "molt-layer-units")  # fmt: skip
DEFAULT_CASES = "plain,molt-padded,molt-packed"
PROMPT_FRACTION = 4  # the first 1/4 of every equal row is prompt (not trained)


# --- the models and their FLOPs ---


def build_model(name: str, out_dir: Path) -> Path:
    """A random-initialised checkpoint of `MODELS[name]` (bf16 on disk; both sides load it as float32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (out_dir / "config.json").is_file():
        return out_dir
    sizes = dict(MODELS[name])
    config_class, model_class = {"dense": (Qwen3Config, Qwen3ForCausalLM),
                                 "moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[sizes.pop("kind")]  # fmt: skip
    config = config_class(**sizes, max_position_embeddings=32768, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()
    return out_dir


def step_flops(name: str, lengths: list[int]) -> float:
    """Model FLOPs of a step over rows of `lengths` (module docstring): per token 6 x the matmul
    parameters, plus causal attention."""
    m = MODELS[name]
    hidden, layers = m["hidden_size"], m["num_hidden_layers"]
    q_dim, kv_dim = m["num_attention_heads"] * m["head_dim"], m["num_key_value_heads"] * m["head_dim"]
    attention_params = hidden * (2 * q_dim + 2 * kv_dim)  # q, o and k, v projections
    if m["kind"] == "dense":
        mlp_params = 3 * hidden * m["intermediate_size"]
    else:
        expert = 3 * hidden * m["moe_intermediate_size"]
        mlp_params = hidden * m["num_experts"] + m["num_experts_per_tok"] * expert
    params = layers * (attention_params + mlp_params) + hidden * m["vocab_size"]  # + the LM head
    return sum(n * (6 * params + 6 * layers * n * q_dim) for n in lengths)


def matmul_tflops() -> float:
    """bf16 8192^3 matmul rate on random data, median of 20 after 3 warm-ups (TFLOP/s)."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()  # the children get the whole GPU
    return 2 * 8192**3 / statistics.median(times) / 1e12


# --- one case, in its own process ---


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def molt_stepper(model_dir: str, case: str, budget: int, max_len: int):
    """The policy worker of `case` (module docstring); returns `step(batch)` and `counts()`, its own
    pass counts since the last call as the run logs them (`molt._group.PolicyGroup.pass_metrics`)."""
    import msgspec

    from molt._actor import PolicyWorker
    from molt.config import FSDP, Config, Model

    config, replace = Config(), msgspec.structs.replace
    actor = replace(config.actor, lr=1e-6, compute_dtype="bfloat16", micro_batch_tokens=budget,
                    pack=case != "molt-padded", activation_checkpointing=case == "molt-ac",
                    compile="off" if case == "molt-eager" else "auto",
                    shared_prefix="on" if case == "molt-shared" else "off")  # fmt: skip
    vllm = replace(config.vllm, max_model_len=max_len)  # the auto budget's floor
    fsdp = FSDP(offload=case == "molt-offload")
    config = replace(config, model=Model(path=model_dir, dtype="float32"), actor=actor, fsdp=fsdp, vllm=vllm)
    if case == "molt-layer-units":
        from molt import _sharding

        _sharding.UNIT_BYTES = 0  # this case's own process: every layer a unit alone
    worker = PolicyWorker(0, 1, "127.0.0.1", _free_port(), model_dir, config)
    if case == "molt-logits":
        worker._logprob_head = None  # the head's forward then gives logits (molt._lean.LogprobHead)

    def counts() -> dict:
        c = worker.take_pass_counts()
        mfu = c["flops"] / (c["seconds"] * c["peak_flops"]) if c["peak_flops"] else None
        return {"padding_frac": 1 - (c["tokens"] - c["saved"]) / c["slots"],
                "shared_prefix_frac": c["saved"] / c["tokens"],
                "molt_tokens_per_s": c["tokens"] / c["seconds"],
                "molt_mfu": mfu, "budget": worker.budget, "packed": worker.packed}  # fmt: skip

    if case == "molt-shared":  # a shared prefix's rows in one micro-batch, as `PolicyGroup._plan` plans them
        return lambda batch: worker.train_step(plan_shared(batch, worker.budget)), counts
    return worker.train_step, counts


def plain_stepper(model_dir: str, budget: int, clip: tuple[float, float] = (0.2, 0.28)):
    """The plain loop (module docstring); returns `step(batch)` and `counts()` (its padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", device_map="cuda"
    ).train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    slots_tokens = [0, 0]  # since the last counts()

    def step(batch) -> None:
        size = max(1, budget // max(batch.row_lengths))  # rows per micro-batch: as many longest as fit
        for start in range(0, batch.num_rows, size):
            mb = batch.select(range(start, min(start + size, batch.num_rows)))  # padded to its longest
            slots_tokens[0] += mb.tokens_BT.numel()
            slots_tokens[1] += sum(mb.row_lengths)
            tokens_BT, mask_BT = mb.tokens_BT.cuda(), mb.loss_mask_BT[:, 1:].cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits_BTV = model(input_ids=tokens_BT).logits
            logp_BT = logits_BTV[:, :-1].float().log_softmax(-1).gather(-1, tokens_BT[:, 1:, None])[..., 0]
            ratio_BT = torch.exp(logp_BT - logp_BT.detach())  # old logprobs: this forward's, detached
            advantages_BT = mb.advantages_BT[:, 1:].cuda()
            clipped_BT = ratio_BT.clamp(1 - clip[0], 1 + clip[1])
            loss_BT = -torch.minimum(ratio_BT * advantages_BT, clipped_BT * advantages_BT)
            ((loss_BT * mask_BT).sum() / batch.num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def counts() -> dict:
        padding = 1 - slots_tokens[1] / slots_tokens[0]
        slots_tokens[:] = [0, 0]
        return {"padding_frac": padding}

    return step, counts


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name, lower case), the first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn_generated")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "matmul")),
    ("copy", ("memcpy", "memset", "copy", "cat")),
    ("reduction", ("reduce", "softmax", "norm", "logsumexp")),
    ("elementwise", ("elementwise", "vectorized", "foreach")),
)


def profile_step(step, batch, trace: str = "") -> dict:
    """One step under torch's profiler: GPU kernel time by kind, the time the GPU ran any kernel (busy: the
    rest of the wall clock it waited on the host) and the 12 slowest kernels (ms); `trace`: also write the
    step's Chrome trace there, gzipped."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        began = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    if trace:
        prof.export_chrome_trace(trace.removesuffix(".gz"))
        subprocess.run(["gzip", "-f", trace.removesuffix(".gz")], check=True)
    by_kernel: dict[str, float] = {}
    spans = []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.device_time_total / 1e3
            spans.append((event.time_range.start, event.time_range.end))
    busy_us, reached = 0.0, float("-inf")  # the union of the kernels' spans
    for start, end in sorted(spans):
        busy_us += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    by_kind: dict[str, float] = {}
    for name, ms in by_kernel.items():
        lower = name.lower()
        kind = next((kind for kind, keys in KERNEL_KINDS if any(key in lower for key in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    slowest = sorted(by_kernel.items(), key=lambda item: -item[1])[:12]
    ops = [  # torch ops by their own GPU time, with their input shapes
        (f"{op.key} x{op.count} {op.input_shapes}"[:150], op.self_device_time_total / 1e3)
        for op in prof.key_averages(group_by_input_shape=True)
        if op.self_device_time_total > 0 and op.device_type == DeviceType.CPU
    ]
    host_ops = [  # torch ops by their own host (CPU) time: where a step of small work goes
        (f"{op.key} x{op.count}"[:110], op.self_cpu_time_total / 1e3)
        for op in prof.key_averages()
        if op.device_type == DeviceType.CPU
    ]
    return {"wall_ms": 1e3 * wall, "gpu_ms": sum(by_kernel.values()), "busy_ms": busy_us / 1e3,
            "by_kind": by_kind,
            "slowest": [(name[:110], ms) for name, ms in slowest],
            "ops": sorted(ops, key=lambda item: -item[1])[:25],
            "host_ops": sorted(host_ops, key=lambda item: -item[1])[:20],
            "python": python_profile(step, batch)}  # fmt: skip


def python_profile(step, batch) -> list[tuple[str, float, float]]:
    """One more step under cProfile: the 30 Python functions with the most cumulative time (ms), with
    their own time, outside the profiler's torch ops (what the host spends around the kernels)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step(batch)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, _)
    rows = [
        (f"{Path(file).name}:{line}({name}) x{calls}", 1e3 * cumulative, 1e3 * own)
        for (file, line, name), (calls, _, own, cumulative, _) in stats.items()
    ]
    return sorted(rows, key=lambda row: -row[1])[:30]


def print_profile(label: str, profile: dict) -> None:
    print(
        f"  profile {label}: wall {profile['wall_ms']:.0f} ms (profiled), kernels {profile['gpu_ms']:.0f} ms,"
        f" GPU busy {profile['busy_ms']:.0f} ms"
    )
    for kind, ms in sorted(profile["by_kind"].items(), key=lambda item: -item[1]):
        print(f"    {kind:12s} {ms:8.1f} ms  {ms / profile['gpu_ms']:6.1%}")
    for name, ms in profile["slowest"]:
        print(f"      {ms:8.1f} ms  {name}")
    print("    torch ops by own GPU time:")
    for name, ms in profile["ops"]:
        print(f"      {ms:8.1f} ms  {name}")
    print("    torch ops by own host time:")
    for name, ms in profile["host_ops"]:
        print(f"      {ms:8.1f} ms  {name}")
    print("    Python functions by cumulative time (one more step, cProfile), with their own:")
    for name, cumulative, own in profile["python"]:
        print(f"      {cumulative:8.1f} ms {own:8.1f} ms  {name}")


def run_case(args: argparse.Namespace) -> dict:
    vocab = MODELS[args.model]["vocab_size"]
    if args.batch in SHARED_BATCHES:
        batch = shared_batch(args.batch, vocab)
        max_len = max(batch.row_lengths)
    elif args.batch == "agentic":
        max_len, rows = args.agentic_max_len, agentic_rows(args.tokens_per_step, args.agentic_max_len)
        batch = train_batch(vocab, rows)
    else:  # equal rows, the first quarter of each a prompt
        n = max_len = int(args.batch)
        prompt = n // PROMPT_FRACTION
        batch = train_batch(vocab, [[(prompt, False), (n - prompt, True)]] * (args.tokens_per_step // n))
    if args.case == "plain":
        step, counts = plain_stepper(args.model_dir, args.micro_batch_tokens)
    else:
        step, counts = molt_stepper(args.model_dir, args.case, args.molt_micro_batch_tokens, max_len)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for index in range(1 + args.steps):
        began = time.perf_counter()
        metrics = step(batch)
        torch.cuda.synchronize()
        if metrics and metrics["train/skipped_updates"]:  # it skipped the optimizer: not an update's time
            raise RuntimeError(
                f"step {index}: the gradient norm was {metrics['train/grad_norm']}, not finite"
            )
        if index > 0:  # the first step warms up (allocator, kernels, compilation, optimizer state)
            seconds.append(time.perf_counter() - began)
        else:
            counts()  # the warm-up's passes are not counted
    measured = counts()
    profile = profile_step(step, batch, args.trace) if args.profile else None
    lengths = batch.row_lengths
    return {
        "profile": profile,
        "step_s": statistics.median(seconds),
        "steps_s": seconds,
        "tokens": sum(lengths),
        "rows": len(lengths),
        "longest": max(lengths),
        "flops": step_flops(args.model, lengths),
        **measured,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


# --- the driver ---


def run_in_subprocess(args: argparse.Namespace, model: str, model_dir: Path, batch: str, case: str) -> dict:
    command = [sys.executable, __file__, "--child", "--case", case, "--model", model,
               "--model-dir", str(model_dir), "--batch", batch, "--steps", str(args.steps),
               "--tokens-per-step", str(args.tokens_per_step), "--agentic-max-len", str(args.agentic_max_len),
               "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--molt-micro-batch-tokens", str(args.molt_micro_batch_tokens),
               *["--profile"] * args.profile,
               *(["--trace", f"{args.trace}/{model}_{batch}_{case}.json.gz"] * bool(args.trace))]  # fmt: skip
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=os.environ | args.child_env,
            timeout=args.case_timeout,
        )
    except subprocess.TimeoutExpired:
        print(f"  {model} {batch} {case} took over {args.case_timeout} s", flush=True)
        return {"error": "timeout"}
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        print(f"  {model} {batch} {case} FAILED (exit {done.returncode}):\n{tail}", flush=True)
        return {"error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(results: list[dict], peak_tflops: float) -> None:
    """Every case; `x plain`, `x padded` and `x packed` are its speed over the plain loop's, molt-padded's
    and molt-packed's on the same model and batch."""
    print(f"\n{machine()}, bf16 matmul {peak_tflops:.0f} TFLOP/s")
    print("| model | batch | case | rows | step s | tokens/s | MFU | molt MFU | molt tokens/s | padding | "
          "shared | budget | peak GiB | x plain | x padded | x packed |")  # fmt: skip
    print("| --- | --- | --- |" + " ---: |" * 13)
    done = {(r["model"], r["batch"], r["case"]): r for r in results if "step_s" in r}
    for r in results:
        if "step_s" not in r:
            print(f"| {r['model']} | {r['batch']} | {r['case']} | failed |" + " |" * 12)
            continue
        ratios = [
            done.get((r["model"], r["batch"], base)) for base in ("plain", "molt-padded", "molt-packed")
        ]
        cells = [r["rows"], f"{r['step_s']:.2f}", f"{r['tokens'] / r['step_s']:,.0f}",
                 f"{r['flops'] / r['step_s'] / (peak_tflops * 1e12):.1%}",
                 f"{r['molt_mfu']:.1%}" if r.get("molt_mfu") else "-",
                 f"{r['molt_tokens_per_s']:,.0f}" if "molt_tokens_per_s" in r else "-",
                 f"{r['padding_frac']:.1%}",
                 f"{r['shared_prefix_frac']:.1%}" if "shared_prefix_frac" in r else "-",
                 r.get("budget", "-"), f"{r['peak_gib']:.1f}",
                 *[f"{base['step_s'] / r['step_s']:.2f}" if base else "-" for base in ratios]]  # fmt: skip
        print(f"| {r['model']} | {r['batch']} | {r['case']} | " + " | ".join(map(str, cells)) + " |")


def machine() -> str:
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, small, moe")
    parser.add_argument("--batches", default="4096,16384,agentic",
                        help="equal rows of N tokens, agentic, prompt4k or multiturn")  # fmt: skip
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="at least this many per batch")
    parser.add_argument("--agentic-max-len", type=int, default=16384, help="the agentic rows' context")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="plain: rows x longest row")
    parser.add_argument("--molt-micro-batch-tokens", type=int, default=0, help="--actor.micro_batch_tokens")
    parser.add_argument("--workdir", default="/tmp/molt-actor-bench", help="where the random models go")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--case-timeout", type=float, default=300, help="seconds one case may take")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each case")
    parser.add_argument("--trace", default="", help="with --profile: write each case's Chrome trace here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_case(args)), flush=True)
        return
    if unknown := set(args.cases.split(",")) - set(CASES):
        raise ValueError(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    # Both sides get the same allocator settings; fewer fragments let long rows fit.
    args.child_env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    peak_tflops = matmul_tflops()
    print(f"{machine()}: bf16 matmul {peak_tflops:.0f} TFLOP/s", flush=True)
    results = []
    for model in args.models.split(","):
        model_dir = build_model(model, Path(args.workdir) / model)
        for batch in args.batches.split(","):
            for case in args.cases.split(","):
                result = run_in_subprocess(args, model, model_dir, batch, case)
                profile = result.pop("profile", None)
                results.append({"model": model, "batch": batch, "case": case, **result})
                print(json.dumps(results[-1]), flush=True)
                results[-1]["profile"] = profile
                if profile:
                    print_profile(f"{model} {batch} {case}", profile)
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_tflops": peak_tflops, "results": results}, indent=1))
    print_table(results, peak_tflops)


if __name__ == "__main__":
    main()
