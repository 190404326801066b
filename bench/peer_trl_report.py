"""The tables and the plot of bench/peer_trl_gpu.py: both trainers' settings side by side, the asymmetries
left between them, the cost estimate, and the figures over runs read back from its JSON file."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path

WINDOW = 5  # steps: the threshold is met when the mean reward of the last WINDOW steps reaches it
LAST = 5  # steps: the final reward is the mean over the last LAST steps
# Guesses on one H200, in seconds, of (start-up to step 1's end, a later step), until the JSON holds a run.
ESTIMATES = {
    ("tiny", "molt"): (60, 1.2), ("tiny", "trl"): (40, 0.3),
    ("smollm2", "molt"): (90, 1.5), ("smollm2", "trl"): (60, 0.6),
    ("qwen3-1.7b", "molt"): (120, 8.0), ("qwen3-1.7b", "trl"): (90, 14.0),
}  # fmt: skip
ASYMMETRIES = [
    "engine: molt's vLLM runs in processes of its own (API server, engine core) behind tito's HTTP; TRL's is "
    "an in-process `LLM` (external launcher) with TRL's fixed max_num_batched_tokens 4096 and max_num_seqs = "
    "the generation batch; molt's KV cache is sized to the sequences it keeps in flight (2 x a step's), and "
    "so is max_num_seqs where they are fewer than 256 (else vLLM's default); max_num_batched_tokens: vLLM's",
    "weight sync, once a step in both: molt refits its engine over CUDA IPC (pause, load, resume); TRL loads "
    "each parameter into its LLM before the step's generation (`load_weights`, one tensor at a time)",
    "synchrony: molt keeps 2 x prompts per step groups in flight (max lag 1, partial rollout), so generation "
    "overlaps training and samples are up to one version old; TRL generates, then trains, on policy",
    "importance correction: both weight tokens by the trainer-over-engine ratio truncated at 2; molt's ratio "
    "also covers staleness",
    "advantages: molt's reinforce_pp divides group-centred rewards by their batch std (+1e-6); TRL's "
    "scale_rewards='batch' by the batch std of the raw rewards (+1e-4)",
    "optimizer steps: both split a step's samples into 2 optimizer steps; molt's windows are a seeded "
    "permutation of whole rollouts, each divided by its own trainable tokens; TRL shuffles rows and divides "
    "each by half the generation's tokens",
    "actor: molt packs rows end to end (no padding), computes a group's shared prompt once and compiles each "
    "decoder layer (CUDA), micro-batches sized from free memory; TRL pads each micro-batch of rows to its "
    "longest and runs eager, accumulating gradients over micro-batches (`micro-batch` above)",
    "precision 'mixed': molt's FSDP2 mixed precision (float32 master weights, bf16 compute, float32 gradient "
    "reduction); TRL's torch autocast over float32 weights. 'bf16' and 'fp32': the same weights in both",
    "processes: molt's driver, Ray, the engine's two processes, the actor and an agent host; TRL one process",
    "rows: TRL's step k trains exactly the stream's next prompts; molt's takes the first of its groups in "
    "flight to finish. Sampling: TRL seeds its LLM with 0 every run; molt's requests are unseeded",
    "logging: molt writes metrics.jsonl (TensorBoard off); TRL logs to memory. Neither checkpoints",
    "start-up: molt's clock holds Ray, the engine (CUDA graphs) and the actor (its compiled layers' graphs, "
    "over dummy rows); TRL's its imports, the model and its LLM (CUDA graphs); both may compile more in "
    "their first steps",
    "on a CPU (row 0): TRL samples with transformers' generate in its process and corrects nothing; molt "
    "runs the vLLM CPU engine",
    "evaluation (rows 0, 1; the same held-out rows, sampling and reply budget): molt's actor waits while its "
    "engine samples them beside the next step's training groups, which go on; TRL stops, samples them as "
    "one batch, then runs the actor's forward passes over it (old logprobs, its eval loss). Each clock "
    "holds the evaluations: molt's in their step's time, TRL's in the next step's (its last one in none). "
    "pass@1: molt's passes / samples (a failed sample fails), TRL's mean reward (0/1 rewards; a failure "
    "stops it)",
]


def settings_table(row: dict, molt_flags: list[str], t: dict) -> list[str]:
    """Both trainers' settings of a row, side by side: molt's resolved from its flags, TRL's GRPOConfig
    arguments (`t`)."""
    from molt._checks import groups_in_flight
    from molt._flags import parse
    from molt._placement import engine_max_num_seqs

    m = parse(molt_flags)
    loss, spg, accumulation = m.algo.loss, t["steps_per_generation"], t["gradient_accumulation_steps"]
    engine_memory = m.vllm.gpu_memory_utilization or "molt's default (0.4 shared)"
    rows = [
        ("model", f"{m.model.path} ({m.model.dtype}, compute {m.actor.compute_dtype})",
         f"the same (loaded {t['model_init_kwargs']['dtype']}, bf16 autocast {t['bf16']})"),
        ("samples a step", f"{m.rollout.prompts_per_step} prompts x {m.rollout.group_size}",
         f"{t['per_device_train_batch_size'] * spg // t['num_generations']} prompts x "
         f"{t['num_generations']}"),
        ("reply budget, context", f"{m.rollout.max_new_tokens}, {m.vllm.max_model_len}",
         f"{t['max_completion_length']}, {t.get('vllm_max_model_length', '-')}"),
        ("optimizer steps a step", f"{m.train.mini_batches} (--train.mini_batches)",
         f"{spg // accumulation} (steps_per_generation {spg} / accumulation {accumulation})"),
        ("micro-batch", f"{m.actor.micro_batch_tokens or 'auto'} tokens, packed {m.actor.pack}, compile "
         f"{m.actor.compile} (auto: on with CUDA)",
         f"{t['per_device_train_batch_size']} rows, padded, eager"),
        ("AdamW lr, warm-up, decay, clip",
         f"{m.actor.lr}, {m.actor.warmup_steps}, {m.actor.weight_decay}, {m.actor.grad_clip}",
         f"{t['learning_rate']} {t['lr_scheduler_type']}, {t['warmup_steps']}, {t['weight_decay']}, "
         f"{t['max_grad_norm']}"),
        ("temperature, top_p", f"{m.rollout.temperature}, {m.rollout.top_p}",
         f"{t['temperature']}, {t['top_p']}"),
        ("loss, aggregation", f"{loss.kind}, {loss.agg} (token-mean)",
         f"{t['loss_type']} (token sum / tokens)"),
        ("ratio clip", f"[{1 - loss.clip_low:g}, {1 + loss.clip_high:g}]",
         f"[{1 - t['epsilon']:g}, {1 + t['epsilon_high']:g}]"),
        ("KL", f"coef {m.algo.kl.coef}", f"beta {t['beta']}"),
        ("advantages", m.algo.advantage.estimator, f"scale_rewards={t['scale_rewards']}"),
        ("importance correction", f"{m.algo.correction.mode}, cap {m.algo.correction.token_cap}",
         f"{t.get('vllm_importance_sampling_mode', 'none')}, "
         f"cap {t.get('vllm_importance_sampling_clip_max', '-')}"),
        ("engine", f"vLLM server, placement {m.vllm.placement} (MPS {m.vllm.mps}), memory {engine_memory}, "
         f"max_num_seqs {engine_max_num_seqs(m) or 'vLLM default'}, max_num_batched_tokens vLLM's",
         f"vLLM colocate in-process, memory {t['vllm_gpu_memory_utilization']}, max_num_seqs "
         f"{t['per_device_train_batch_size'] * spg}, max_num_batched_tokens 4096" if t.get("use_vllm")
         else "generate"),
        ("in flight", f"{groups_in_flight(m)} groups, max lag "
         f"{m.rollout.max_lag}", "one generation, on policy"),
        ("seed", f"{m.train.seed} (train, data)", f"{t['seed']}"),
        ("evaluation", f"every {m.eval.every} steps and the last, {m.eval.num_prompts} rows of "
         f"{m.eval.path or 'eval_dataset(seed)'} x {m.eval.n}, pass@1 at reward >= {m.eval.pass_reward}"
         if m.eval.every else "none",
         f"eval_steps {t['eval_steps']} and the last, molt's rows x {t['num_generations_eval']} in one batch "
         f"of {t['per_device_eval_batch_size']}, mean reward" if "eval_steps" in t else "none"),
    ]  # fmt: skip
    lines = [f"row {row['row']} ({row['name']}): {row['steps']} steps, precision {row['precision']}",
             "| setting | molt | trl |", "| --- | --- | --- |"]  # fmt: skip
    return lines + [f"| {name} | {a} | {b} |" for name, a, b in rows]


def mean_sd(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{statistics.mean(values):{spec}} ± {statistics.stdev(values):{spec}}"


def reached(steps: list[dict], threshold: float | None) -> tuple[float, int] | None:
    """(seconds since launch, step) at the first step where the mean reward of the last WINDOW steps
    reaches `threshold`; None if none does, or without a threshold."""
    reward = [s["reward"] for s in steps]
    for k in range(WINDOW - 1, len(steps)) if threshold is not None else ():
        if statistics.mean(reward[k + 1 - WINDOW : k + 1]) >= threshold:
            return steps[k]["t"], steps[k]["step"]
    return None


def figures(record: dict) -> dict | None:
    """One run's figures (module docstring of peer_trl_gpu); None for a run of fewer than 2 steps."""
    steps, evals = record["steps"], record.get("evals") or []  # records before evaluation have no evals
    if len(steps) < 2:
        return None
    t, reward = [s["t"] for s in steps], [s["reward"] for s in steps]
    return dict(
        startup_s=t[0],
        step_s=(t[-1] - t[0]) / (len(t) - 1),  # the mean of steps 2..N
        tokens_per_s=sum(s["reply_tokens"] for s in steps[1:]) / (t[-1] - t[0]),
        reached=reached(steps, record["settings"]["threshold"]),
        final_reward=statistics.mean(reward[-LAST:]),
        final_eval=evals[-1]["pass_at_1"] if evals else None,  # after the last step
    )


def estimate(records: list[dict], row: dict, trainer: str) -> tuple[float, str]:
    """Seconds a run of `row` by `trainer` should take: measured if the JSON has such a run, else guessed."""
    done = [f for r in records if r["settings"]["name"] == row["name"] and r["trainer"] == trainer
            if (f := figures(r))]  # fmt: skip
    if done:
        start, step = (
            statistics.mean(f["startup_s"] for f in done),
            statistics.mean(f["step_s"] for f in done),
        )
    else:
        start, step = ESTIMATES[row["name"], trainer]
    return start + (row["steps"] - 1) * step, "measured" if done else "guessed"


def by_caches(runs: list[dict], threshold: float | None) -> str:
    """Start-up and time to the threshold of runs whose compile caches were empty ("cold": a trainer's
    first run on a machine) apart from those that found an earlier run's ("warm"); and the time to the
    threshold after step 1's end, which the start-up leaves out."""
    parts = []
    for state in ("cold", "warm", None):  # None: recorded before the caches were kept apart
        done = [f for r in runs if r.get("caches") == state and (f := figures(r))]
        if done:
            hits = [f["reached"][0] for f in done if f["reached"]]
            after = [f["reached"][0] - f["startup_s"] for f in done if f["reached"]]
            reach = (
                f", time to {threshold} {mean_sd(hits, '.0f')} s (after step 1 {mean_sd(after, '.1f')} s)"
                if threshold is not None
                else ""
            )
            startup = mean_sd([f["startup_s"] for f in done], ".0f")
            parts.append(f"{state or 'caches shared'} {len(done)}: start-up {startup} s{reach}")
    return "; ".join(parts) or "no complete run"


def report(records: list[dict]) -> None:
    """The table of every row in `records` (complete runs only; the failed and stopped are counted), and
    molt over TRL."""
    for number in sorted({r["row"] for r in records}):
        mine = [r for r in records if r["row"] == number]
        s, threshold = mine[-1]["settings"], mine[-1]["settings"]["threshold"]  # None: throughput alone
        print(f"\nrow {number} ({s['name']}): {s['steps']} steps of {s['prompts_per_step']} prompts x "
              f"{s['group_size']}, replies up to {s['max_new_tokens']} tokens, precision {s['precision']}, "
              f"threshold {threshold} (mean of {WINDOW} steps); {mine[-1]['machine']}")  # fmt: skip
        print(f"| trainer | runs (failed) | start-up s | s/step (2..N) | reply tokens/s | "
              f"time to {threshold} s | steps to it | reached | final reward (last {LAST}) | "
              f"final eval pass@1 |")  # fmt: skip
        print("| --- |" + " ---: |" * 9)
        means = {}
        for trainer in sorted({r["trainer"] for r in mine}):
            runs = [r for r in mine if r["trainer"] == trainer]
            finished = [r for r in runs if not (r["returncode"] or r["timed_out"])]
            done = [f for r in finished if (f := figures(r))]
            hits = [f["reached"] for f in done if f["reached"]]
            cells = [
                f"{len(done)} ({len(runs) - len(done)})",
                mean_sd([f["startup_s"] for f in done], ".0f"),
                mean_sd([f["step_s"] for f in done], ".2f"),
                mean_sd([f["tokens_per_s"] for f in done], ",.0f"),
                mean_sd([t for t, _ in hits], ".0f"),
                mean_sd([step for _, step in hits], ".1f"),
                f"{len(hits)}/{len(done)}" if threshold is not None else "-",
                mean_sd([f["final_reward"] for f in done], ".3f"),
                mean_sd([f["final_eval"] for f in done if f["final_eval"] is not None], ".3f"),
            ]
            print(f"| {trainer} | " + " | ".join(cells) + " |")
            print(f"({trainer}: {by_caches(finished, threshold)})")
            if trainer == "molt" and len(codes := Counter(r.get("code", "unrecorded") for r in runs)) > 1:
                print(f"(molt: runs of {len(codes)} code versions: {dict(codes)}; --since keeps the newer)")
            if done:
                means[trainer] = {k: statistics.mean(f[k] for f in done) for k in ("step_s", "tokens_per_s")}
            complete = [r for r in finished if len(r["steps"]) > 1]
            if trainer == "molt":  # its actor/compiles: graphs compiled in the step (TRL compiles none)
                compiling = [sum(s["log"].get("actor/compiles", 0) > 0 for s in r["steps"][1:]) for r in runs]
                print(f"(molt: steps 2..N in which the actor still compiled, per run: {compiling})")
                # a skipped update (non-finite gradient norm) changed no weight: such a step is no update
                skipped = [
                    int(sum(s["log"].get("train/skipped_updates", 0) for s in r["steps"])) for r in runs
                ]
                if any(skipped):
                    print(f"(molt: UPDATES SKIPPED for a non-finite gradient, per run: {skipped})")
                for r in runs:  # the steps' graphs are the log's last (the warm-up's come before them)
                    built = int(sum(s["log"].get("actor/compiles", 0) for s in r["steps"]))
                    for line in r.get("recompiles", [])[-built:] if built else []:
                        print(f"  molt run {r['run']} compiled again at {line[:160]}")
                print(profile(complete))
            else:
                print(trl_profile(complete))
        if "molt" in means and "trl" in means:
            molt, trl = means["molt"], means["trl"]
            ratio = molt["step_s"] / trl["step_s"]
            print(f"molt / trl s/step: {ratio:.2f} (molt {1 / ratio:.2f}x as fast); reply tokens/s, "
                  f"molt / trl: {molt['tokens_per_s'] / trl['tokens_per_s']:.2f}")  # fmt: skip


def profile(runs: list[dict]) -> str:
    """Where molt's time goes, mean over runs: start-up by stage (step 1's `timing/startup_*`; the stages
    overlap, so they do not add up to the total) and a later step's by stage (each run's median over
    steps 2..N of `timing/*`: `generation` is the wait for the step's groups, `refit_*` the parts of
    `broadcast`)."""
    if not runs:
        return "(molt: no run of 2 steps or more to profile)"
    first = runs[0]["steps"][0]["log"]
    startup = sorted(k for k in first if k.startswith("timing/startup_"))
    steady = sorted(k for k in runs[0]["steps"][1]["log"] if k.startswith("timing/") and k not in startup)

    def seconds(key: str, later: bool) -> float:
        if not later:
            return statistics.mean(r["steps"][0]["log"].get(key, 0.0) for r in runs)
        return statistics.mean(
            statistics.median(s["log"].get(key, 0.0) for s in r["steps"][1:]) for r in runs
        )

    return (
        "molt, start-up s: "
        + ", ".join(f"{k[15:]} {seconds(k, False):.1f}" for k in startup)
        + "; a later step's median s: "
        + ", ".join(f"{k[7:]} {seconds(k, True):.2f}" for k in steady)
    )


def trl_profile(runs: list[dict]) -> str:
    """Where TRL's step goes, mean over runs of each run's median over steps 2..N, from its own
    `step_time` per optimizer step: a generation's first optimizer step also generates and computes the old
    logprobs, the others only train; the first's time less the others' mean is the generation's part."""
    if not runs:
        return "(trl: no run of 2 steps or more to profile)"
    parts = []
    for run in runs:
        times = [[entry["step_time"] for entry in s["log"] if "step_time" in entry] for s in run["steps"][1:]]
        times = [t for t in times if len(t) > 1]  # one optimizer step a generation: no split to read
        if times:
            trains = [statistics.mean(t[1:]) for t in times]
            parts.append((statistics.median(t[0] - m for t, m in zip(times, trains, strict=True)),
                          statistics.median(trains), len(times[0])))  # fmt: skip
    if not parts:
        return "(trl: one optimizer step a generation, no generation time to read)"
    generation, train = (statistics.mean(p[i] for p in parts) for i in (0, 1))
    return (f"trl, a later step's median s: generation and old logprobs {generation:.2f}, training "
            f"{train:.2f} per optimizer step x {parts[0][2]}")  # fmt: skip


def plot(records: list[dict], path: str | Path) -> None:
    """A row a line of panels, every run of both trainers. A row with a reward threshold: reward against
    seconds since launch (left) and against step (right); dashed, the held-out eval pass@1 of rows that
    evaluate (0/1 rewards: one scale). A throughput row (no threshold: random weights learn nothing): the
    steps done against seconds since launch (left) and each step's seconds (right; from step 2)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    numbers = sorted({r["row"] for r in records})
    fig, axes = plt.subplots(len(numbers), 2, figsize=(11, 3.6 * len(numbers)), squeeze=False)
    colours = {"molt": "tab:blue", "trl": "tab:orange", "async": "tab:blue", "sync": "tab:grey"}  # async_gain
    for (by_time, by_step), number in zip(axes, numbers, strict=True):
        settings = next(r["settings"] for r in records if r["row"] == number)
        learns, labelled = settings["threshold"] is not None, set()
        for r in (r for r in records if r["row"] == number and r["steps"]):
            label = None if r["trainer"] in labelled else r["trainer"]
            labelled.add(r["trainer"])
            style = dict(color=colours[r["trainer"]], alpha=0.7, marker=".", label=label)
            times, steps = [s["t"] for s in r["steps"]], [s["step"] for s in r["steps"]]
            if not learns:
                by_time.plot(times, steps, **style)
                by_step.plot(steps[1:], [b - a for a, b in itertools.pairwise(times)], **style)
                continue
            reward, evals = [s["reward"] for s in r["steps"]], r.get("evals") or []
            by_time.plot(times, reward, **style)
            by_step.plot(steps, reward, **style)
            if evals:  # records from before evaluation have none
                dashed = dict(style, linestyle="--", marker="x", label=label and f"{label} eval pass@1")
                by_time.plot([e["t"] for e in evals], [e["pass_at_1"] for e in evals], **dashed)
                by_step.plot([e["step"] for e in evals], [e["pass_at_1"] for e in evals], **dashed)
        reward_label = "mean reward of the step; eval pass@1 (dashed)"
        for ax, x, y in ((by_time, "seconds since launch", reward_label if learns else "steps done"),
                         (by_step, "step", reward_label if learns else "seconds the step took")):  # fmt: skip
            if learns:
                ax.axhline(settings["threshold"], color="grey", linestyle=":", linewidth=1)
            ax.set(xlabel=x, ylabel=y, title=f"row {number}: {settings['name']}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
