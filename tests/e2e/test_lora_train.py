"""`molt train --actor.lora.rank 8` end to end on this CPU: the default recipe on two gloo actor ranks
training adapters only, the session's engine serving the merged weights each refit sends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from molt_runs import LETTERS_AGENT

pytestmark = pytest.mark.slow

MOLT = str(Path(sys.executable).parent / "molt")


def test_a_lora_run_refits_the_merged_weights(tmp_path, tiny_model_dir, molt_engine, ray_cluster):
    run_dir = tmp_path / "run"  # the letters agent's dense reward: every step has a gradient
    args = [
        MOLT, "train", "--logger.run_dir", str(run_dir), "--train.num_steps", "3", "--actor.num_ranks", "2",
        "--rollout.prompts_per_step", "4", "--rollout.group_size", "4", "--train.force_on_policy",
        "--actor.lora.rank", "8", "--actor.lora.alpha", "64", "--actor.lr", "1e-2",
        "--ray.address", ray_cluster.address, "--model.path", str(tiny_model_dir),
        "--vllm.urls", molt_engine.url, "--agent.module", LETTERS_AGENT, "--rollout.max_new_tokens", "6",
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=ray_cluster.env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(step["train/staleness_mean"] == 0.0 for step in steps)  # sampled by the last refit's weights
    assert all(step["train/grad_norm"] > 0 for step in steps)
    # float32 engine and trainer on the same weights: float noise only. Had the refit sent the base
    # weights (adapters unmerged), steps 2 and 3 would sample from the untrained model.
    for step in steps:
        assert step["train/mismatch_kl"] < 1e-6, step
