"""The reference policy (`--algo.kl.coef`): its own frozen FSDP2 group, started only when asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MOLT = str(Path(sys.executable).parent / "molt")


# One run, with the KL folded into the reward (the loop's own code path); the loss-term form is the actor's
# `ref_logp_BT` argument, covered by tests/molt/test_molt_actor.py.
@pytest.mark.parametrize("in_reward", [True], ids=["in-reward"])
def test_a_kl_penalty_starts_a_frozen_reference(tmp_path, tiny_model_dir, molt_engine, in_reward):
    run_dir = tmp_path / "run"
    args = [
        MOLT, "train", "--model.path", str(tiny_model_dir), "--vllm.urls", molt_engine.url,
        "--logger.run_dir", str(run_dir), "--train.num_steps", "3", "--rollout.prompts_per_step", "2",
        "--rollout.group_size", "4", "--train.force_on_policy", "--ray.num_cpus", "2",
        "--logger.tensorboard", "false", "--algo.kl.coef", "0.5",
        "--algo.kl.in_reward", str(in_reward).lower(),
        "--algo.entropy_coef", "0.1",  # moves the policy even while every reward is still 0
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "starting the reference policy" in result.stderr
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["train/kl"] == 0.0  # the policy still equals its reference
    assert steps[1]["train/kl"] > 0.0 and steps[2]["train/kl"] > 0.0  # it moved; the reference did not
