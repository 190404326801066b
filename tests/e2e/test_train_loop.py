"""`molt train` end to end on this CPU: vLLM engines, Ray, an FSDP2 actor on 2 gloo ranks, tito, the pool."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from molt._plot import read_metrics

pytestmark = pytest.mark.slow

MOLT = str(Path(sys.executable).parent / "molt")

# DESIGN §6: logged every step whatever the algorithm (written out here, not read from molt.loop).
REQUIRED_METRICS = {
    "rollout/reward_mean", "rollout/reward_std_in_group", "rollout/response_len_mean",
    "rollout/truncated_frac", "train/policy_loss", "train/kl", "train/entropy", "train/grad_norm",
    "train/lr", "train/clip_frac", "train/mismatch_kl", "train/seq_masked_frac", "train/staleness_mean",
    "pool/dropped_stale", "pool/filtered", "pool/wasted_frac", "timing/generation", "timing/policy_train",
    "timing/broadcast", "timing/step_total",
}  # fmt: skip


def engine_processes(marker: str) -> list[int]:
    """vLLM servers whose command line mentions `marker` (the run's own directory: its model, or the pipe
    through which a server started ahead is handed its flags)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in command and "vllm" in command:
                found.append(int(entry.name))
    return found


def test_a_short_on_policy_run_with_two_actor_ranks(tmp_path, tiny_model_dir, molt_engine, ray_cluster):
    """Two actor ranks on the session's shared engine and Ray (the runs below start their own)."""
    run_dir = tmp_path / "run"
    args = [
        MOLT, "train", "--logger.run_dir", str(run_dir), "--train.num_steps", "3", "--actor.num_ranks", "2",
        "--rollout.prompts_per_step", "4", "--rollout.group_size", "4", "--train.force_on_policy",
        "--ray.address", ray_cluster.address, "--model.path", str(tiny_model_dir),
        "--vllm.urls", molt_engine.url,
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=ray_cluster.env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    assert (run_dir / "config.toml").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for step in steps:
        assert step.keys() >= REQUIRED_METRICS, REQUIRED_METRICS - step.keys()
        assert step["train/mismatch_kl"] < 1e-3  # float32 engine vs float32 trainer on the same weights
        assert 0.0 < step["timing/score"] < step["timing/policy_train"]  # a part of the actor's time
        assert 0.0 <= step["rollout/reward_mean"] <= 1.0
    # On policy, every token of step s was sampled by version s - 1: the engine reports the versions the
    # trainer pushed, so its weights changed at every refit.
    assert all(step["train/staleness_mean"] == 0.0 for step in steps)
    assert "step 3/3" in result.stdout
    # step 1 says where the start went, the actor's ranks' part of it too (their slowest rank's load)
    actor = {key: steps[0][f"timing/startup_{key}"] for key in ("actor_load", "actor", "total")}
    assert 0 < actor["actor_load"] < actor["actor"] < actor["total"]
    said = re.search(r"actor [0-9.]+ s \(load [0-9.]+ s, warm_up [0-9.]+ s\)", result.stderr)
    assert said, result.stderr[-2000:]


def test_a_typo_fails_before_anything_starts(tmp_path):
    args = [MOLT, "train", "--rollout.group_sise", "4"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--rollout.group_sise" in result.stderr and "--rollout.group_size" in result.stderr


def test_ctrl_c_during_training_leaves_no_process_behind(tmp_path):
    """Ctrl-C reaches the whole foreground process group, as a terminal sends it."""
    run_dir = tmp_path / "run"
    mark = f"MOLT_TEST_RUN={tmp_path}"  # in the environment of every process the run starts
    args = [MOLT, "train", "--logger.run_dir", str(run_dir), "--train.num_steps", "1000"]
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "MOLT_TEST_RUN": str(tmp_path)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even if this runner ignores Ctrl-C
    )  # fmt: skip
    try:
        output = []
        for line in process.stdout:
            output.append(line)
            if line.startswith("step 2/"):
                break
        assert process.poll() is None, "".join(output[-50:])
        assert engine_processes(str(run_dir)), "the engine should be running mid-run"
        # Its server process started before Ray, importing vLLM meanwhile, and its actor handed it its flags.
        log = (run_dir / "engine-0.log").read_text().splitlines()
        assert "handed its flags" in next(line for line in log if line.startswith("molt.vllm_server:"))
        assert ray_processes(mark), "the run should have started its own Ray"
        os.killpg(process.pid, signal.SIGINT)
        rest, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode != 0
    assert engine_processes(str(run_dir)) == [], "".join(output[-20:]) + rest[-3000:]
    assert ray_processes(mark) == [], "Ray's raylet or GCS outlived the run"


def ray_processes(mark: str) -> list[int]:
    """The raylet and GCS processes with `mark` in their environment: the run's own, not another test's
    (the other test worker starts Rays of its own meanwhile)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ray = (entry / "comm").read_text().strip() in ("raylet", "gcs_server")
            if ray and mark.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


BROKEN_DATA_AGENT = """
from molt.recipes.copy_word import AgentRunner, dataset as words


def dataset(seed):
    rows = words(seed)
    for _ in range(6):
        yield next(rows)
    raise OSError("the dataset's disk went away")
"""


def test_an_exception_mid_run_stops_the_run_and_leaves_an_attached_engine_serving(
    tmp_path, tiny_model_dir, molt_engine, ray_cluster
):
    """The dataset fails after a few steps: the run exits non-zero and names the cause, and the engine it
    attached to is left serving, not paused. (A run's own engine and Ray going with it: the Ctrl-C test;
    an exception unwinds through the same teardown as Ctrl-C's KeyboardInterrupt.)"""
    agent = tmp_path / "broken_data.py"
    agent.write_text(BROKEN_DATA_AGENT)
    run_dir = tmp_path / "run"
    args = [MOLT, "train", "--logger.run_dir", str(run_dir), "--agent.module", str(agent),
            "--model.path", str(tiny_model_dir), "--vllm.urls", molt_engine.url,
            "--ray.address", ray_cluster.address, "--logger.tensorboard", "false",
            "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=ray_cluster.env)
    assert result.returncode != 0
    assert "the dataset's disk went away" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text().count("\n") >= 1  # it trained before the failure
    assert httpx.get(f"{molt_engine.url}/is_paused", timeout=10).json() == {"is_paused": False}


FINITE_DATA_AGENT = """
from molt.recipes.copy_word import AgentRunner, dataset as words


def dataset(seed):
    rows = words(seed)
    for _ in range(5):
        yield next(rows)


def eval_dataset(seed):  # a word training never draws: a path check of the evaluation, not a score
    yield {"messages": [{"role": "user", "content": "copy the word: zebra"}], "word": "zebra"}
"""


def test_a_used_up_dataset_ends_the_run_with_its_last_step_evaluated_and_checkpointed(
    tmp_path, tiny_model_dir, molt_engine, ray_cluster
):
    """Five rows, two groups a step: steps 1 and 2 take two each, step 3 the last one, and step 4 finds the
    dataset used up. The run ends cleanly, and its last step, on which neither --eval.every 5 nor
    --ckpt.every 5 fell, is evaluated and checkpointed: no trained step is lost, the run's last weights
    have their evaluation."""
    agent = tmp_path / "finite_data.py"
    agent.write_text(FINITE_DATA_AGENT)
    run_dir = tmp_path / "run"
    args = [MOLT, "train", "--logger.run_dir", str(run_dir), "--agent.module", str(agent),
            "--model.path", str(tiny_model_dir), "--vllm.urls", molt_engine.url,
            "--ray.address", ray_cluster.address, "--logger.tensorboard", "false", "--train.num_steps", "10",
            "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--ckpt.every", "5",
            "--eval.every", "5", "--eval.num_prompts", "1", "--eval.n", "1"]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=ray_cluster.env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "the dataset is used up" in result.stderr and "eval after step 3 | pass@1" in result.stdout
    records = read_metrics(run_dir)  # step 3's evaluation, logged after its record, merged into it
    assert [record["step"] for record in records] == [1, 2, 3]
    assert "eval/pass@1" in records[2] and "rollout/reward_mean" in records[2]
    assert records[2]["timing/eval"] > 0  # the evaluation's own seconds, apart from the step's
    assert not any("eval/pass@1" in record for record in records[:2])
    assert sorted(path.name for path in (run_dir / "checkpoints").glob("step_*")) == ["step_000003"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
