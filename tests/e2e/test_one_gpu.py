"""`molt train` as it comes, on a machine with one GPU: the engine and the actor share it (placement
auto -> shared, CUDA IPC refit), and the default recipe learns. GPU machine only."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
from molt_runs import steps_of

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
MIN_REWARD_GAIN = 0.2  # as the CPU default-recipe test (tests/e2e/test_default_recipe.py)


def test_the_default_recipe_learns_on_one_shared_gpu(tmp_path):
    import torch

    if (count := torch.cuda.device_count()) != 1:
        pytest.skip(f"needs exactly one GPU (auto placement shares it), this machine has {count}")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "molt", "train", "--logger.run_dir", str(run_dir)],
        capture_output=True, text=True, timeout=1200, env={**os.environ},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    config = tomllib.loads((run_dir / "config.toml").read_text())  # the resolved run, as written
    assert config["vllm"]["placement"] == "shared"
    steps = steps_of(run_dir)
    rewards = [steps[step]["rollout/reward_mean"] for step in sorted(steps)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first > MIN_REWARD_GAIN, (first, last, rewards)
    assert all(steps[step]["timing/refit_transfer"] > 0 for step in sorted(steps)[:-1])
