"""The metric sinks: metrics.jsonl and W&B (offline, into the run directory), read back independently."""

from __future__ import annotations

import importlib.util
import json

import pytest
import wandb_records

from molt._validate import validate
from molt.config import Config, ConfigError, Logger, Train


def step_metrics(step: int) -> dict[str, float]:
    """What a step logs at least (the console line reads these), with values that differ by step."""
    names = ["rollout/reward_mean", "rollout/response_len_mean", "train/policy_loss", "train/mismatch_kl",
             "train/staleness_mean", "timing/generation", "timing/policy_train", "timing/broadcast",
             "timing/step_total"]  # fmt: skip
    return {name: step / (index + 2) for index, name in enumerate(names)}


@pytest.mark.slow  # wandb starts its service process (~3 s)
def test_wandb_receives_every_step_offline_in_the_run_dir(tmp_path, monkeypatch):
    from molt._log import RunLog

    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = Logger(run_dir=str(tmp_path), tensorboard=False, wandb_project="molt-test")
    log = RunLog(Config(train=Train(num_steps=3), logger=logger))
    for step in (1, 2, 3):
        log.step(step, step_metrics(step))
    log.close()

    history = wandb_records.history(tmp_path)
    assert sorted(history) == [1, 2, 3]
    for step, logged in history.items():
        expected = step_metrics(step)
        assert {name: logged[name] for name in expected} == pytest.approx(expected)
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in jsonl] == [1, 2, 3]
    assert wandb_records.config(tmp_path)["train"]["num_steps"] == 3  # the run's whole config


def test_wandb_project_without_wandb_installed_is_refused_at_config_time(monkeypatch):
    """The one fake here: wandb is installed in the test environment, so its finder is told it is not."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else real(name, *rest)
    )
    with pytest.raises(ConfigError, match=r"--logger.wandb_project.*uv sync --extra wandb"):
        validate(Config(logger=Logger(wandb_project="p")))
    validate(Config())  # without the flag nothing needs wandb
