"""`molt train` as it comes, on a machine with one GPU: the engine and the actor share it (placement
auto -> shared, CUDA IPC refit), and the default recipe learns; LoRA adapters train there in bfloat16.
GPU machine only."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
from molt_runs import steps_of

from molt import read_rollouts

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
MIN_REWARD_GAIN = 0.2  # as the CPU default-recipe test (tests/e2e/test_default_recipe.py)
MIN_LORA_REWARD_GAIN = 0.08  # as the CPU LoRA test (tests/e2e/test_lora_train.py)


def _one_gpu() -> None:
    import torch

    if (count := torch.cuda.device_count()) != 1:
        pytest.skip(f"needs exactly one GPU (auto placement shares it), this machine has {count}")


def _molt_train(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "molt", "train", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=1200, env={**os.environ})


def test_the_default_recipe_learns_on_one_shared_gpu(tmp_path):
    _one_gpu()
    run_dir = tmp_path / "run"
    result = _molt_train("--logger.run_dir", str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    config = tomllib.loads((run_dir / "config.toml").read_text())  # the resolved run, as written
    assert config["vllm"]["placement"] == "shared"
    steps = steps_of(run_dir)
    rewards = [steps[step]["rollout/reward_mean"] for step in sorted(steps)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first > MIN_REWARD_GAIN, (first, last, rewards)
    assert all(steps[step]["timing/refit_transfer"] > 0 for step in sorted(steps)[:-1])


def test_lora_adapters_train_in_bfloat16_on_one_shared_gpu(tmp_path, lora_model_dir):
    """vLLM's LoRA kernels take 16-bit weights only: float32 (the default dtype) is refused before anything
    starts, and with --actor.compute_dtype bfloat16 the adapters train, each refit swapping them in."""
    _one_gpu()
    refused = _molt_train("--actor.lora.rank", "8", "--logger.run_dir", str(tmp_path / "refused"))
    assert refused.returncode == 2 and "pass --actor.compute_dtype bfloat16" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()
    run_dir, dumps, num_steps = tmp_path / "run", tmp_path / "rollouts", 30
    result = _molt_train(
        "--model.path", str(lora_model_dir), "--logger.run_dir", str(run_dir),
        "--train.rollout_dump_dir", str(dumps), "--train.num_steps", str(num_steps),
        "--train.force_on_policy", "--actor.lora.rank", "8", "--actor.lora.alpha", "16", "--actor.lr", "1e-2",
        "--actor.compute_dtype", "bfloat16",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    steps = steps_of(run_dir)
    assert sorted(steps) == list(range(1, num_steps + 1))
    sent = {steps[step]["refit/bytes_sent"] for step in steps}  # the adapters alone, the same each step
    assert len(sent) == 1 and 0 < sent.pop() < (lora_model_dir / "model.safetensors").stat().st_size / 4
    for record in read_rollouts(dumps):  # on policy: every token sampled by the previous step's adapters
        for segment in record.segments:
            versions = {v for v, m in zip(segment.versions, segment.loss_mask, strict=True) if m}
            assert versions == {record.step - 1}, (record.step, versions)
    rewards = [steps[step]["rollout/reward_mean"] for step in sorted(steps)]
    assert sum(rewards[-10:]) / 10 - rewards[0] > MIN_LORA_REWARD_GAIN, rewards
    assert steps[num_steps]["train/entropy"] < steps[1]["train/entropy"] / 2  # the adapters moved the policy
