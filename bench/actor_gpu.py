"""One full train step of Molt's policy actor on one GPU, against a plain transformers + AdamW loop.

Two random-initialised models (nothing downloaded): a Qwen3-1.7B-shaped dense model (its sizes, tied
embeddings, vocabulary 151,936) and a small Qwen3-MoE. For each model and context length, every case
runs in its own subprocess, one after the other on the same GPU, on the same batch:

- `plain`: transformers' `AutoModelForCausalLM` in float32 on the GPU, computing in bf16 under
  `torch.autocast`, activation checkpointing on (`gradient_checkpointing_enable`), naive float32
  logprobs (`logits.float().log_softmax(-1)`), the PPO clipped loss, gradient clipping, torch AdamW.
- `molt`, `molt-ac`, `molt-offload`, `molt-cudnn`, `molt-logits`: the real `molt._actor.PolicyWorker`
  (NeMo AutoModel + FSDP2, one rank) built in-process as the GPU tests build it, with float32 master
  weights and bf16 compute (`--model.dtype float32 --actor.compute_dtype bfloat16`); `molt-ac` adds
  `--actor.activation_checkpointing`, `molt-offload` adds `--fsdp.offload`, `molt-compile*` add
  `--actor.compile` (each decoder layer through torch.compile) to `molt` and `molt-offload` (with
  `molt-ac` it is refused: AutoModel's checkpoint wrapper and torch.compile do not combine);
  the compilation happens in the warm-up step, outside the timed ones. `molt-cudnn` is `molt` with
  cuDNN's attention made the only SDPA kernel of the process (torch ranks it last), and `molt-logits` is
  `molt` with the policy's LM head giving logits again (the path before `rlestimators.lm_head_logprobs`,
  still the one under tensor parallelism): chunked logprobs and entropy from [B, T, V] logits. A step is
  `train_step(batch)`: the forward gives the logprobs (old logprobs are that forward's, detached: one
  update per batch), rollout correction, loss, entropy, backward, clipping and the AdamW step.

Both sides take the old logprobs from the step's own forward, so each does one forward and one backward
per micro-batch (plus the recomputed forward of activation checkpointing). The batch: rows of the context
length, random token ids, the first quarter of each row a prompt (loss mask 0), the rest trained; the
same number of tokens per step at every context. One warm-up step, then `--steps` timed steps (wall
clock around a synchronised step); tokens/s is trained-row tokens (prompt included) over the median step.
Peak memory is `torch.cuda.max_memory_allocated` over the steps (the model loaded, stats reset first).

`--profile`: each case also runs one more step under torch's profiler and prints where the GPU's time
went: kernel time by kind (attention, matmul, elementwise, reduction, copy, other), the slowest kernels,
and the torch ops (with their input shapes) that launched the most GPU time.

MFU counts model FLOPs only: per token 6 x the parameters a token passes through (every linear layer
including the LM head; for the MoE the router and its top-k experts, not all experts) plus causal
attention, 6 x layers x context x (heads x head_dim) (forward 2 x ... averaged over positions, backward
twice that); the recomputation of activation checkpointing is not counted. The rate it is divided by is
a bf16 8192^3 matmul measured in the same run (median of 20).

    python bench/actor_gpu.py                              # both models, 4k and 16k
    python bench/actor_gpu.py --models dense --contexts 4096 --steps 1 --cases plain,molt   # smoke

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

MODELS = {
    "dense": dict(
        kind="dense", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "moe": dict(
        kind="moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=12,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, router_aux_loss_coef=0.0, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False,
    ),
}  # fmt: skip
CASES = ("plain", "molt", "molt-compile", "molt-ac", "molt-offload", "molt-compile-offload", "molt-logits",
         "molt-cudnn")  # fmt: skip
PROMPT_FRACTION = 4  # the first 1/4 of every row is prompt (not trained)


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


def flops_per_token(name: str, context: int) -> float:
    """Model FLOPs of one trained token (module docstring): 6 x matmul parameters + causal attention."""
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
    return 6 * params + 6 * layers * context * q_dim


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


# --- the batch ---


def make_batch(vocab: int, context: int, tokens_per_step: int):
    """`tokens_per_step / context` full rows; the first quarter of each is prompt (module docstring)."""
    from molt._batch import TrainBatch

    gen = torch.Generator().manual_seed(1)
    num_rows = tokens_per_step // context
    tokens_BT = torch.randint(0, vocab, (num_rows, context), generator=gen)
    mask_BT = torch.zeros(num_rows, context)
    mask_BT[:, context // PROMPT_FRACTION :] = 1.0
    advantages_B = torch.where(torch.rand(num_rows, generator=gen) < 0.5, -1.0, 1.0)
    # A random model gives each token about -log(vocab); the engine's logprobs sit near it.
    noise_BT = 0.1 * torch.randn(num_rows, context, generator=gen)
    rollout_logp_BT = (noise_BT - torch.log(torch.tensor(float(vocab)))) * mask_BT
    return TrainBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        rollout_logp_BT=rollout_logp_BT,
        advantages_BT=advantages_B[:, None] * mask_BT,
        num_tokens=int(mask_BT.sum()),
    )


# --- one case, in its own process ---


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def molt_stepper(model_dir: str, case: str, micro_batch_size: int):
    import msgspec

    from molt._actor import PolicyWorker
    from molt.config import FSDP, Config, Model

    config = Config()
    config = msgspec.structs.replace(
        config,
        model=Model(path=model_dir, dtype="float32"),
        actor=msgspec.structs.replace(
            config.actor,
            lr=1e-6,
            compute_dtype="bfloat16",
            micro_batch_size=micro_batch_size,
            activation_checkpointing=case == "molt-ac",
            compile=case.startswith("molt-compile"),
        ),
        fsdp=FSDP(offload=case in ("molt-offload", "molt-compile-offload")),
    )
    worker = PolicyWorker(0, 1, "127.0.0.1", _free_port(), model_dir, config)
    if case == "molt-logits":
        worker._logprob_head = None  # the head's forward then gives logits (molt._lean.LogprobHead)
    return worker.train_step


def plain_stepper(model_dir: str, micro_batch_size: int, clip: tuple[float, float] = (0.2, 0.28)):
    """The plain loop (module docstring); returns `step(batch)`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", device_map="cuda"
    ).train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(batch) -> None:
        for mb in batch.micro_batches(micro_batch_size):
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

    return step


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name, lower case), the first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn_generated")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "matmul")),
    ("copy", ("memcpy", "memset", "copy", "cat")),
    ("reduction", ("reduce", "softmax", "norm", "logsumexp")),
    ("elementwise", ("elementwise", "vectorized", "foreach")),
)


def profile_step(step, batch) -> dict:
    """One step under torch's profiler: GPU kernel time by kind and the 12 slowest kernels (ms)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        began = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.device_time_total / 1e3
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
    return {"wall_ms": 1e3 * wall, "gpu_ms": sum(by_kernel.values()), "by_kind": by_kind,
            "slowest": [(name[:110], ms) for name, ms in slowest],
            "ops": sorted(ops, key=lambda item: -item[1])[:25]}  # fmt: skip


def print_profile(label: str, profile: dict) -> None:
    print(
        f"  profile {label}: wall {profile['wall_ms']:.0f} ms (profiled), kernels {profile['gpu_ms']:.0f} ms"
    )
    for kind, ms in sorted(profile["by_kind"].items(), key=lambda item: -item[1]):
        print(f"    {kind:12s} {ms:8.1f} ms  {ms / profile['gpu_ms']:6.1%}")
    for name, ms in profile["slowest"]:
        print(f"      {ms:8.1f} ms  {name}")
    print("    torch ops by own GPU time:")
    for name, ms in profile["ops"]:
        print(f"      {ms:8.1f} ms  {name}")


def run_case(args: argparse.Namespace) -> dict:
    batch = make_batch(MODELS[args.model]["vocab_size"], args.context, args.tokens_per_step)
    micro_batch_size = max(1, args.micro_batch_tokens // args.context)
    if args.case == "molt-cudnn":  # cuDNN's attention alone, process-wide: no other kernel to pick
        for kernel in ("flash", "mem_efficient", "math"):
            getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(False)
    if args.case == "plain":
        step = plain_stepper(args.model_dir, micro_batch_size)
    else:
        step = molt_stepper(args.model_dir, args.case, micro_batch_size)
    cuda = torch.backends.cuda  # which attention kernels the step may pick from
    attention = {"flash": cuda.flash_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled(),
                 "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for index in range(1 + args.steps):
        began = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        if index > 0:  # the first step warms up (allocator, kernels, optimizer state)
            seconds.append(time.perf_counter() - began)
    profile = profile_step(step, batch) if args.profile else None
    return {
        "profile": profile,
        "step_s": statistics.median(seconds),
        "steps_s": seconds,
        "tokens": batch.tokens_BT.numel(),
        "micro_batch_size": micro_batch_size,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "attention_kernels_enabled": [name for name, enabled in attention.items() if enabled],
    }


# --- the driver ---


def run_in_subprocess(args: argparse.Namespace, model: str, model_dir: Path, context: int, case: str) -> dict:
    command = [sys.executable, __file__, "--child", "--case", case, "--model", model,
               "--model-dir", str(model_dir), "--context", str(context), "--steps", str(args.steps),
               "--tokens-per-step", str(args.tokens_per_step),
               "--micro-batch-tokens", str(args.micro_batch_tokens),
               *["--profile"] * args.profile]  # fmt: skip
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=os.environ | args.child_env,
            timeout=args.case_timeout,
        )
    except subprocess.TimeoutExpired:
        print(f"  {model} {context} {case} took over {args.case_timeout} s", flush=True)
        return {"error": "timeout"}
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        print(f"  {model} {context} {case} FAILED (exit {done.returncode}):\n{tail}", flush=True)
        return {"error": tail}
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(results: list[dict], peak_tflops: float) -> None:
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(f"\n{machine}, bf16 matmul {peak_tflops:.0f} TFLOP/s")
    print("| model | context | case | step s | tokens/s | MFU | peak GiB | x plain |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    plain = {(r["model"], r["context"]): r for r in results if r["case"] == "plain" and "step_s" in r}
    for r in results:
        if "step_s" not in r:
            print(f"| {r['model']} | {r['context']} | {r['case']} | failed | | | | |")
            continue
        tokens_per_s = r["tokens"] / r["step_s"]
        mfu = tokens_per_s * flops_per_token(r["model"], r["context"]) / (peak_tflops * 1e12)
        base = plain.get((r["model"], r["context"]))
        ratio = f"{base['step_s'] / r['step_s']:.2f}" if base else "-"
        print(f"| {r['model']} | {r['context']} | {r['case']} | {r['step_s']:.2f} | {tokens_per_s:,.0f} | "
              f"{mfu:.1%} | {r['peak_gib']:.1f} | {ratio} |")  # fmt: skip


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--contexts", default="4096,16384", help="comma-separated row lengths")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--offload-contexts", default="16384", help="contexts that run molt-offload")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="micro-batch rows x context")
    parser.add_argument("--workdir", default="/tmp/molt-actor-bench", help="where the random models go")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--case-timeout", type=float, default=300, help="seconds one case may take")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each case")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_case(args)), flush=True)
        return
    # Both sides get the same allocator settings; fewer fragments let long rows fit.
    args.child_env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    peak_tflops = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {peak_tflops:.0f} TFLOP/s", flush=True)
    results = []
    offload_contexts = {int(c) for c in args.offload_contexts.split(",") if c}
    for model in args.models.split(","):
        model_dir = build_model(model, Path(args.workdir) / model)
        for context in (int(c) for c in args.contexts.split(",")):
            for case in args.cases.split(","):
                if case.endswith("offload") and context not in offload_contexts:
                    continue
                result = run_in_subprocess(args, model, model_dir, context, case)
                profile = result.pop("profile", None)
                results.append({"model": model, "context": context, "case": case, **result})
                print(json.dumps(results[-1]), flush=True)
                if profile:
                    print_profile(f"{model} {context} {case}", profile)
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_tflops": peak_tflops, "results": results}, indent=1))
    print_table(results, peak_tflops)


if __name__ == "__main__":
    main()
