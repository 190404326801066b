"""The `molt` command: help, errors before anything starts, --print-config, the run dir and the loop call.

The launch is replaced by a fake `molt._launch` module here: these tests are about what the command hands
it (the resolved config, after writing it into the run directory), not about training.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

from molt._cli import app
from molt._flags import flag_help, resolve
from molt._validate import validate
from molt.config import Config

runner = CliRunner()


class LoopCalls(list):
    """The configs the loop was called with; `resumed`: its `resume` argument, call by call."""

    def __init__(self) -> None:
        super().__init__()
        self.resumed: list[bool] = []


@pytest.fixture
def fake_loop(monkeypatch):
    """Stands in for `molt._launch` (tested end to end elsewhere); records the configs it is called with."""
    calls = LoopCalls()

    def launch(config: Config, *, resume: bool = False) -> None:
        calls.append(config)
        calls.resumed.append(resume)

    module = types.ModuleType("molt._launch")
    module.launch = launch
    monkeypatch.setitem(sys.modules, "molt._launch", module)
    return calls


def test_molt_help_lists_train():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "train" in result.stdout


def test_train_help_lists_every_flag_with_type_default_and_help():
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    for flag, type_name, default, help_text in flag_help():
        row = f"  {flag}  {type_name} = {default}"
        assert row in lines, row
        assert lines[lines.index(row) + 1].strip() == help_text
    for group in ("model", "data", "agent", "algo", "actor", "fsdp", "vllm", "rollout", "train", "eval"):
        assert any(line.startswith(f"{group}: ") for line in lines), group
    for group in ("ckpt", "logger", "ray"):
        assert any(line.startswith(f"{group}: ") for line in lines), group


def test_config_error_exits_2_naming_the_flag(fake_loop, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "--rollout.group_size", "eight"])
    assert result.exit_code == 2
    assert "--rollout.group_size: expected int, got 'eight'" in result.stderr
    result = runner.invoke(app, ["train", "--rollout.groupsize", "8"])
    assert result.exit_code == 2
    assert "did you mean --rollout.group_size?" in result.stderr
    assert fake_loop == [] and not (tmp_path / "runs").exists()


def test_print_config_round_trips(fake_loop, tmp_path):
    args = ["--algo.advantage.estimator", "grpo", "--algo.kl.coef", "0.1"]
    args += ["--algo.filters", "truncated,all_equal_rewards"]
    args += ["--vllm.max_num_batched_tokens", "8192", "--algo.correction.mode", "seq-mask-tis"]
    result = runner.invoke(app, ["train", *args, "--print-config"])
    assert result.exit_code == 0, result.output
    file = tmp_path / "printed.toml"
    file.write_text(result.stdout)
    assert resolve(["--config", str(file)]) == resolve(args)
    again = runner.invoke(app, ["train", "--print-config", "--config", str(file)])
    assert again.stdout == result.stdout
    assert fake_loop == []


def test_train_writes_the_resolved_config_and_calls_the_loop(fake_loop, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "--train.num_steps", "3", "--rollout.group_size=4"])
    assert result.exit_code == 0, result.output
    (config,) = fake_loop
    assert re.fullmatch(r"runs/\d{8}-\d{6}", config.logger.run_dir)
    assert f"run dir: {config.logger.run_dir}" in result.stdout
    assert (config.train.num_steps, config.rollout.group_size) == (3, 4)
    assert config.ckpt.dir == f"{config.logger.run_dir}/checkpoints"
    written = tmp_path / config.logger.run_dir / "config.toml"
    assert resolve(["--config", str(written)]) == config


def test_train_uses_the_given_run_dir(fake_loop, tmp_path):
    run_dir = tmp_path / "my-run"
    result = runner.invoke(app, ["train", "--logger.run_dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert fake_loop[0].logger.run_dir == str(run_dir)
    assert resolve(["--config", str(run_dir / "config.toml")]) == fake_loop[0]
    assert fake_loop[0].rollout == validate(Config()).rollout


def test_importing_the_cli_imports_no_torch_vllm_or_ray():
    code = "import sys, molt._cli; print(sorted({'torch', 'vllm', 'ray', 'rlestimators'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_resume_continues_the_run_with_its_config_and_the_new_flags(fake_loop, tmp_path):
    run_dir = tmp_path / "run"
    first_run = runner.invoke(app, ["train", "--logger.run_dir", str(run_dir), "--train.num_steps", "3"])
    assert first_run.exit_code == 0, first_run.output
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    missing = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert missing.exit_code == 2 and "no checkpoint" in missing.output
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step_000002\n")
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "--train.num_steps", "5"])
    assert result.exit_code == 0, result.output
    first, resumed = fake_loop
    assert resumed.train.num_steps == 5 and resumed.logger.run_dir == str(run_dir)
    assert resumed.ckpt.dir == first.ckpt.dir
    assert fake_loop.resumed == [False, True]
    not_a_run = runner.invoke(app, ["train", "--resume", str(tmp_path / "nothing")])
    assert not_a_run.exit_code == 2 and "not a run directory" in not_a_run.output


def _resumed(run_dir, first_flags: list[str], resume_flags: list[str], fake_loop) -> Config:
    """The config a run started with `first_flags` resumes with, given `resume_flags` (checkpoint faked)."""
    first_run = runner.invoke(app, ["train", "--logger.run_dir", str(run_dir), *first_flags])
    assert first_run.exit_code == 0, first_run.output
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step_000002\n")
    result = runner.invoke(app, ["train", "--resume", str(run_dir), *resume_flags])
    assert result.exit_code == 0, result.output
    return fake_loop[-1]


@pytest.mark.parametrize(
    ("first_flags", "resume_flags", "rollout"),
    [
        pytest.param(
            ["--train.force_on_policy"], ["--train.force_on_policy", "false"], (1, True, 32), id="off-policy"
        ),
        pytest.param([], ["--train.force_on_policy"], (0, False, 16), id="on-policy"),
        pytest.param(
            ["--train.force_on_policy"], ["--rollout.prompts_per_step", "24"], (0, False, 24), id="on-24"
        ),
        pytest.param([], ["--rollout.prompts_per_step", "24"], (1, True, 48), id="deeper-queue"),
        pytest.param(
            ["--rollout.queue_depth", "40"], ["--rollout.prompts_per_step", "20"], (1, True, 40), id="set"
        ),
    ],
)
def test_resume_derives_again_from_the_flags_given_then(
    fake_loop, tmp_path, first_flags, resume_flags, rollout
):
    """(max_lag, partial_rollout, queue_depth) on resume are what the same flags give at a fresh start; a
    queue depth the user set stays theirs."""
    resumed = _resumed(tmp_path / "run", first_flags, resume_flags, fake_loop)
    assert (resumed.rollout.max_lag, resumed.rollout.partial_rollout, resumed.rollout.queue_depth) == rollout
    assert resumed.rollout == resolve([*first_flags, *resume_flags]).rollout


def test_resume_keeps_the_latest_settings_and_refuses_flags_on_a_run_without_them(fake_loop, tmp_path):
    run_dir = tmp_path / "run"
    _resumed(run_dir, ["--train.force_on_policy"], ["--train.force_on_policy", "false"], fake_loop)
    again = runner.invoke(app, ["train", "--resume", str(run_dir), "--rollout.prompts_per_step", "8"])
    assert again.exit_code == 0, again.output
    assert (fake_loop[-1].rollout.max_lag, fake_loop[-1].rollout.queue_depth) == (1, 16)  # off-policy stays
    (run_dir / "given.toml").unlink()  # a run from before given.toml: its config.toml has derived values
    refused = runner.invoke(app, ["train", "--resume", str(run_dir), "--train.force_on_policy"])
    assert refused.exit_code == 2 and "has no given.toml" in refused.stderr, refused.output
    assert "resume it without flags" in refused.stderr
    plain = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert plain.exit_code == 0, plain.output
    assert fake_loop[-1] == fake_loop[-2]


@pytest.mark.parametrize("flag", ["--config", "--logger.run_dir"])
def test_resume_refuses_a_flag_that_would_replace_its_settings_or_directory(fake_loop, tmp_path, flag):
    """--resume continues with the run's given.toml in its directory: another --config file would drop its
    settings (here --actor.lr), another --logger.run_dir would be overridden; both are refused."""
    run_dir, other = tmp_path / "run", tmp_path / "other.toml"
    _resumed(run_dir, ["--actor.lr", "0.01"], [], fake_loop)
    other.write_text("[train]\nnum_steps = 5\n")
    value = str(other) if flag == "--config" else str(tmp_path / "elsewhere")
    for args in ([flag, value], [f"{flag}={value}"]):
        result = runner.invoke(app, ["train", "--resume", str(run_dir), *args])
        assert result.exit_code == 2, (result.output, fake_loop[-1].actor.lr, fake_loop[-1].logger.run_dir)
        assert flag in result.stderr


def test_a_run_dir_that_already_holds_a_run_is_refused(tmp_path):
    from typer.testing import CliRunner

    from molt._cli import app

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    result = CliRunner().invoke(app, ["train", "--logger.run_dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "already holds a run" in result.output
