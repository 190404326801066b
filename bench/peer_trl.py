"""Molt against TRL's GRPOTrainer on this CPU: wall time per optimizer step, and reward after N steps.

Both train one recipe on one model, with the same prompts per step, samples per group, response length,
learning rate and number of steps, in one run of this script. `--recipe copy_word` (the default recipe,
`molt.recipes.copy_word`: reward 1 when the reply to `copy the word: fox` starts with `fox`) runs on one
seeded tiny Qwen3 (`molt.tiny`, built once into a temporary directory with the seed `molt train` uses);
`--recipe smollm2` (`molt.recipes.smollm2`: additions, reward 1 when the reply's last number is the sum)
runs on SmolLM2-135M-Instruct converted by that recipe (`--model`), where the model's own compute, not
the trainers' fixed costs, takes most of a step. Each recipe brings its sizes and learning rate (its TOML
file's); the flags override them. Molt runs first, as `molt train` in a subprocess with its
defaults otherwise (vLLM CPU engine, asynchronous pool) except two flags that match TRL's setup: one
micro-batch per step (`--actor.micro_batch_tokens` for every row at the longest length, TRL's one
batch) and the agent in the trainer's process (`--agent.num_runners 0`, as TRL calls its reward
function); its numbers come from the run's metrics.jsonl. TRL runs second, in this process, with
GRPOConfig set as close to molt's defaults as TRL allows (see BENCHMARKS.md for what still differs).
TRL's reward function is the recipe's own `AgentRunner`, and its dataset is the recipe's rows in stream
order, rendered with the model's chat template, not shuffled.

A step's wall time is the time between the ends of consecutive optimizer steps (rollouts, logprobs,
update, weight sync and logging, whatever each trainer does inside a step); the first step is reported
apart, since it carries one-off warm-up. The reward is the mean reward of the samples each step trained
on, averaged over the last K steps. This measures a CPU, not a GPU. Usage:

    uv run --group peer python bench/peer_trl.py            # 100 steps each, under 10 minutes on 2 cores
    uv run --group peer python bench/peer_trl.py --steps 20 --last 5
    uv run --group smollm2 python -m molt.recipes.smollm2 convert models/smollm2-135m   # once
    uv run --group peer python bench/peer_trl.py --recipe smollm2 --steps 12 --last 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from molt.agent import load_agent
from molt.tiny import build_tiny_model

# Each recipe's agent module and defaults (the smollm2 ones are its TOML file's): sizes, learning rate,
# and the engine's context (None: molt's default).
RECIPES = {
    "copy_word": dict(module="molt.recipes.copy_word", steps=100, last=10, prompts_per_step=16, group_size=8,
                      max_new_tokens=2, lr=1e-3, max_model_len=None),
    "smollm2": dict(module="molt.recipes.smollm2", steps=12, last=4, prompts_per_step=4, group_size=8,
                    max_new_tokens=16, lr=5e-6, max_model_len=512),
}  # fmt: skip


@dataclass
class Result:
    """One trainer's run: per-step wall seconds and mean rewards (step 1 first), the whole run's seconds,
    and per-step seconds of named stages where the trainer reports them."""

    step_s: list[float]
    reward: list[float]
    total_s: float
    stages: dict[str, list[float]] = field(default_factory=dict)


def machine() -> str:
    """CPU model, usable cores, load and the torch build: what the results are read against."""
    import torch

    model = platform.processor() or "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{model}, {len(os.sched_getaffinity(0))} cores usable (of {os.cpu_count()}), load average {load}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads), "
        f"Python {platform.python_version()}"
    )


def run_molt(model_dir: Path, run_dir: Path, args: argparse.Namespace) -> Result:
    """`molt train` on the shared model with the benchmark's sizes and TRL's batching (module docstring)."""
    molt = Path(sys.executable).parent / "molt"  # the entry point of this environment
    command = [
        str(molt), "train",
        "--model.path", str(model_dir),
        "--agent.module", RECIPES[args.recipe]["module"],
        "--train.num_steps", str(args.steps),
        "--train.seed", str(args.seed),
        "--data.seed", str(args.seed),
        "--rollout.prompts_per_step", str(args.prompts_per_step),
        "--rollout.group_size", str(args.group_size),
        "--rollout.max_new_tokens", str(args.max_new_tokens),
        "--actor.lr", str(args.lr),
        "--agent.num_runners", "0",  # TRL scores in its own process
        "--logger.run_dir", str(run_dir),
    ]  # fmt: skip
    if (max_model_len := RECIPES[args.recipe]["max_model_len"]) is not None:
        command += ["--vllm.max_model_len", str(max_model_len)]
    rows = args.prompts_per_step * args.group_size  # TRL: one batch, so one micro-batch that holds every row
    command += ["--actor.micro_batch_tokens", str(rows * (max_model_len or 2048))]
    print("molt:", " ".join(command[1:]), flush=True)
    began = time.monotonic()
    with (run_dir.parent / "molt.log").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    total_s = time.monotonic() - began
    if done.returncode:
        tail = (run_dir.parent / "molt.log").read_text()[-4000:]
        raise RuntimeError(f"molt train exited with {done.returncode}; the end of its log:\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, args.steps + 1))
    return Result(
        step_s=[row["timing/step_total"] for row in rows],
        reward=[row["rollout/reward_mean"] for row in rows],
        total_s=total_s,
        stages={
            name: [row[f"timing/{name}"] for row in rows]
            for name in ("generation", "policy_train", "broadcast")
        },
    )


def recipe_reward(recipe):
    """TRL's reward function: the recipe's own AgentRunner scores each completion on its row, as in molt."""

    def reward(completions: list[str], row: list[str], **_) -> list[float]:
        rewards = []
        for text, sample in zip(completions, row, strict=True):
            runner = recipe.AgentRunner()
            runner.reset(json.loads(sample))
            rewards.append(runner.step(text).reward)
        return rewards

    return reward


def trl_dataset(tokenizer, rows: list[dict], name: str):
    """TRL's dataset of `rows`, in their order (to train: the rows molt's pool starts, the agent's
    dataset(seed) stream), rendered once with the chat template as molt renders an Env's first turn; each
    whole row goes along as JSON for the reward. `name` is its fingerprint, one per set of rows."""
    import pyarrow
    from datasets import Dataset

    table = pyarrow.table({
        "prompt": [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
                   for r in rows],
        "row": [json.dumps(r) for r in rows],
    })  # fmt: skip
    # A fingerprint of our own: datasets would otherwise hash the table with dill, which fails on some
    # pyarrow builds (pyarrow 26's MonthDayNano type could not be pickled on the GPU machine).
    return Dataset(table, fingerprint=name)


def matched_config(args: argparse.Namespace) -> dict:
    """GRPOConfig's fields set as close to molt's defaults as TRL allows, on any machine (sizes from `args`:
    max_new_tokens, group_size, lr, seed)."""
    return dict(
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # molt: constant after --actor.warmup_steps (0)
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,  # molt's --actor.grad_clip
        temperature=1.0,
        top_p=1.0,
        beta=0.0,  # no KL term, no reference model: molt's --algo.kl.coef 0
        epsilon=0.2,  # molt's --algo.loss.clip_low / clip_high (DAPO clip-higher)
        epsilon_high=0.28,
        loss_type="dapo",  # token sum over the step's trainable tokens, as molt's actor normalises
        scale_rewards="batch",  # group-centred, one batch std: the nearest to molt's reinforce_pp
        num_iterations=1,
        shuffle_dataset=False,
        gradient_checkpointing=False,  # molt's --actor.activation_checkpointing false
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def run_trl(model_dir: Path, out_dir: Path, args: argparse.Namespace) -> Result:
    """TRL's GRPOTrainer on the same model, rows, sizes and learning rate; one generation per step."""
    began = time.monotonic()  # the whole run counts TRL's imports, as molt's counts its own
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    recipe = load_agent(RECIPES[args.recipe]["module"])
    num_rows = args.steps * args.prompts_per_step
    rows = list(islice(recipe.dataset(args.seed), num_rows))
    dataset = trl_dataset(tokenizer, rows, f"peer-trl-{args.seed}-{num_rows}")
    config = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,  # one step = one generation
        gradient_accumulation_steps=1,
        bf16=False,  # molt's --model.dtype float32
        use_cpu=True,
        **matched_config(args),
    )
    step_s: list[float] = []
    reward: list[float] = []

    class StepClock(TrainerCallback):
        """Wall seconds between the ends of consecutive optimizer steps, and each step's logged reward."""

        def on_train_begin(self, *_, **__):
            self.last = time.monotonic()

        def on_step_end(self, *_, **__):
            now = time.monotonic()
            step_s.append(now - self.last)
            self.last = now

        def on_log(self, *_, logs=None, **__):
            if logs and "reward" in logs:
                reward.append(logs["reward"])

    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=recipe_reward(recipe),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)  # its dict per step would bury the table
    trainer.train()
    total_s = time.monotonic() - began
    assert len(step_s) == len(reward) == args.steps, (len(step_s), len(reward))
    return Result(step_s=step_s, reward=reward, total_s=total_s)


def report(molt: Result, trl: Result, args: argparse.Namespace) -> None:
    k, n = args.last, args.steps

    def row(name: str, r: Result) -> str:
        later = r.step_s[1:]
        return (
            f"| {name} | {r.step_s[0]:.2f} | {statistics.mean(later):.3f} | {statistics.median(later):.3f} | "
            f"{statistics.mean(r.reward[:k]):.3f} | {statistics.mean(r.reward[-k:]):.3f} | {r.total_s:.0f} |"
        )

    print(f"\n{args.recipe}: {n} steps of {args.prompts_per_step} prompts x {args.group_size} samples, "
          f"{args.max_new_tokens} new tokens, lr {args.lr}, seed {args.seed}")  # fmt: skip
    print(f"| trainer | step 1 s | mean s/step (2..{n}) | median s/step (2..{n}) | reward first {k} | "
          f"reward last {k} | whole run s |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(row("molt", molt))
    print(row("trl", trl))
    for name, average in (("mean", statistics.mean), ("median", statistics.median)):
        ratio = average(molt.step_s[1:]) / average(trl.step_s[1:])
        print(f"molt step time / trl step time ({name} over steps 2..{n}): {ratio:.2f} "
              f"(molt {1 / ratio:.2f}x as fast as trl)")  # fmt: skip
    print(f"reward over the last {k} steps: molt {statistics.mean(molt.reward[-k:]):.3f}, "
          f"trl {statistics.mean(trl.reward[-k:]):.3f}")  # fmt: skip
    stages = ", ".join(f"{name} {statistics.median(s[1:]):.3f}" for name, s in molt.stages.items())
    print(f"molt's stages, median s over steps 2..{n}: {stages}")
    for name, r in (("molt", molt), ("trl", trl)):
        print(f"{name} s/step: " + " ".join(f"{x:.2f}" for x in r.step_s))
        print(f"{name} reward: " + " ".join(f"{x:.3f}" for x in r.reward))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="copy_word", help="task, model, sizes")
    parser.add_argument("--model", default="models/smollm2-135m", help="smollm2: the converted model")
    parser.add_argument("--steps", type=int, help="optimizer steps of each trainer (recipe's default)")
    parser.add_argument("--last", type=int, help="K: rewards are averaged over the last K steps")
    parser.add_argument("--prompts-per-step", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int, default=0, help="model, data order and trainer seed of both")
    parser.add_argument("--work-dir", default="", help="where the model and runs go; empty = a temporary dir")
    args = parser.parse_args()
    for name, default in RECIPES[args.recipe].items():  # a flag left out takes the recipe's value
        if getattr(args, name, default) is None:
            setattr(args, name, default)
    if not 1 <= args.last <= args.steps or args.steps < 2:
        raise ValueError("--steps must be >= 2 and --last must lie in 1..--steps")

    with tempfile.TemporaryDirectory(prefix="peer-trl-") as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        if args.recipe == "copy_word":
            model_dir = build_tiny_model(work / "model", seed=args.seed)  # as molt train builds by default
        else:
            model_dir = Path(args.model).resolve()
            if not (model_dir / "config.json").is_file():
                raise ValueError(
                    f"--model {args.model}: no converted model there; run `uv run --group smollm2 python -m "
                    f"molt.recipes.smollm2 convert {args.model}` first"
                )
        print("machine:", machine(), flush=True)
        molt = run_molt(model_dir, work / "molt-run", args)
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"molt done in {molt.total_s:.0f} s (load average {load}); starting TRL", flush=True)
        trl = run_trl(model_dir, work / "trl-run", args)
        print("machine after:", machine())
        report(molt, trl, args)


if __name__ == "__main__":
    main()
