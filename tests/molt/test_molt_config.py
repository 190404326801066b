"""The typed config: precedence, every guard, flag parsing and its errors, and agreement with rlestimators."""

from __future__ import annotations

import datetime
import tomllib
from typing import get_args

import msgspec
import pytest

import molt._validate
import molt.config
from molt._flags import flag_help, render_toml, resolve
from molt._validate import validate
from molt.config import Config, ConfigError, with_run_dir


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def _leaf_paths(cls: type = Config, prefix: str = "") -> list[str]:
    """Every settable field by dotted path, walked independently of molt._flags."""
    paths = []
    for field in msgspec.structs.fields(cls):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            paths += _leaf_paths(field.type, f"{prefix}{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


def test_defaults_are_valid_and_fill_queue_depth():
    config = validate(Config())
    assert config.rollout.queue_depth == 2 * config.rollout.prompts_per_step
    assert resolve([]) == config
    assert validate(config) == config


def test_toml_then_flags_precedence(tmp_path):
    file = _write(tmp_path, "[rollout]\ngroup_size = 4\ntemperature = 0.7\n[actor]\nlr = 0.01\n")
    config = resolve(["--config", file, "--rollout.group_size", "2"])
    assert config.rollout.group_size == 2  # flag beats the file
    assert config.rollout.temperature == 0.7  # the file beats the default
    assert config.actor.lr == 0.01
    assert config.rollout.max_new_tokens == Config().rollout.max_new_tokens  # untouched: the default
    assert resolve([f"--config={file}"]).rollout.group_size == 4


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        pytest.param(
            ["--algo.correction.mode", "none"],
            [
                "--algo.correction.mode",
                "--rollout.max_lag",
                "--rollout.partial_rollout",
                "--train.force_on_policy",
            ],
            id="async-without-correction",
        ),
        pytest.param(
            ["--algo.correction.mode", "none", "--rollout.max_lag", "0"],
            ["--algo.correction.mode", "--rollout.partial_rollout"],
            id="partial-rollout-without-correction",
        ),
        pytest.param(
            ["--train.force_on_policy", "--rollout.queue_depth", "20"],
            ["--train.force_on_policy", "--rollout.queue_depth"],
            id="force-on-policy-vs-queue-depth",
        ),
        pytest.param(
            ["--train.force_on_policy", "--rollout.max_lag", "2"],
            ["--train.force_on_policy", "--rollout.max_lag"],
            id="force-on-policy-vs-max-lag",
        ),
        pytest.param(
            ["--rollout.queue_depth", "8"],
            ["--rollout.queue_depth", "--rollout.prompts_per_step"],
            id="shallow",
        ),
        pytest.param(["--rollout.prompts_per_step", "0"], ["--rollout.prompts_per_step"], id="no-prompts"),
        pytest.param(["--rollout.max_lag", "-1"], ["--rollout.max_lag"], id="negative-lag"),
        pytest.param(["--rollout.group_size", "0"], ["--rollout.group_size"], id="empty-group"),
        pytest.param(
            ["--algo.advantage.estimator", "opd"],
            ["--algo.advantage.estimator", "--algo.teacher.model"],
            id="opd",
        ),
        pytest.param(["--algo.gae.lam", "0.95"], ["--algo.gae.*", "estimator reinforce_pp"], id="gae-unused"),
        pytest.param(["--algo.critic.lr", "1e-4"], ["--algo.critic.*"], id="critic-unused"),
        pytest.param(
            ["--algo.loss.kind", "cispo", "--algo.loss.dual_clip", "3"],
            ["--algo.loss.dual_clip 3", "--algo.loss.kind cispo"],
            id="dual-clip-without-a-surrogate",
        ),
        pytest.param(
            ["--algo.loss.kind", "pg", "--algo.loss.clip_high", "0.5"],
            ["--algo.loss.clip_high", "--algo.loss.kind pg"],
            id="clip-unused-by-pg",
        ),
        pytest.param(
            ["--algo.correction.mode", "mis", "--algo.correction.token_bounds", "1.5,3"],
            ["--algo.correction.token_bounds (1.5, 3.0)", "leaves out 1"],
            id="token-bounds-without-1",
        ),
        pytest.param(
            ["--algo.correction.mode", "seq-mask-tis", "--algo.correction.seq_bounds", "0.5,0.9"],
            ["--algo.correction.seq_bounds (0.5, 0.9)", "leaves out 1"],
            id="seq-bounds-without-1",
        ),
        pytest.param(
            ["--algo.correction.mode", "mis", "--algo.correction.token_cap", "3"],
            ["--algo.correction.token_cap 3.0", "--algo.correction.mode mis"],
            id="token-cap-unused-by-mis",
        ),
        pytest.param(
            ["--algo.correction.token_bounds", "0.25,4"],
            ["--algo.correction.token_bounds (0.25, 4.0)", "--algo.correction.mode tis"],
            id="token-bounds-unused-by-tis",
        ),
        pytest.param(
            ["--algo.correction.mode", "mis", "--algo.correction.seq_bounds", "0.9,1.1"],
            ["--algo.correction.seq_bounds (0.9, 1.1)", "--algo.correction.mode mis"],
            id="seq-bounds-unused-by-mis",
        ),
        pytest.param(
            ["--train.force_on_policy", "--algo.correction.mode", "none", "--algo.correction.token_cap", "3"],
            ["--algo.correction.token_cap 3.0", "--algo.correction.mode none"],
            id="token-cap-unused-by-none",
        ),
        pytest.param(
            [
                "--algo.advantage.estimator",
                "gae",
                "--rollout.group_size",
                "1",
                "--algo.filters",
                "all_equal_rewards",
            ],
            ["--algo.filters all_equal_rewards", "--rollout.group_size 1"],
            id="equal-rewards-filter-on-groups-of-one",
        ),
        pytest.param(
            ["--algo.kl.in_reward", "true"], ["--algo.kl.in_reward", "--algo.kl.coef is 0"], id="kl-unused"
        ),
        pytest.param(
            ["--data.messages_key", "prompt"],
            ["--data.messages_key prompt", "--data.path", "--eval.path"],
            id="messages-key-without-a-file",
        ),
        pytest.param(["--actor.lr", "0"], ["--actor.lr"], id="lr"),
        pytest.param(["--train.num_steps", "0"], ["--train.num_steps"], id="num-steps"),
        pytest.param(["--rollout.temperature", "0"], ["--rollout.temperature"], id="temperature"),
        pytest.param(["--agent.num_runners", "-1"], ["--agent.num_runners"], id="runners"),
    ],
)
def test_guard_refuses_naming_the_flags(args, flags):
    with pytest.raises(ConfigError) as error:
        resolve(args)
    for flag in flags:
        assert flag in str(error.value)


@pytest.mark.parametrize("estimator", get_args(molt.config.OutcomeEstimator))
def test_group_of_one_refused_with_a_group_baseline(estimator):
    with pytest.raises(ConfigError, match=r"--algo\.advantage\.estimator .*--rollout\.group_size"):
        resolve(["--algo.advantage.estimator", estimator, "--rollout.group_size", "1"])


def test_a_teacher_without_an_estimator_that_reads_it_is_refused(tiny_model_dir):
    with pytest.raises(
        ConfigError, match=r"--algo\.teacher\.\* is set, but --algo\.advantage\.estimator grpo"
    ):
        resolve(["--algo.teacher.model", str(tiny_model_dir), "--algo.advantage.estimator", "grpo"])


def test_group_of_one_accepted_for_token_level_estimators(tiny_model_dir):
    assert resolve(["--algo.advantage.estimator", "gae", "--rollout.group_size", "1"]).rollout.group_size == 1
    teacher = str(tiny_model_dir)
    opd = ["--algo.advantage.estimator", "opd", "--algo.teacher.model", teacher, "--rollout.group_size", "1"]
    assert resolve([*opd, "--model.path", teacher]).algo.teacher.model == teacher


@pytest.mark.parametrize("cuda", [False, True])
def test_context_parallelism_is_refused_with_the_reason(monkeypatch, cuda):
    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: cuda)
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 8)
    with pytest.raises(ConfigError, match=r"--fsdp\.cp_size 2: the actor does not split sequences"):
        resolve(["--fsdp.cp_size", "2", "--actor.num_ranks", "2"])


def test_force_on_policy_derives_strict_on_policy_and_allows_no_correction():
    config = resolve(["--train.force_on_policy", "--algo.correction.mode", "none"])
    assert (config.rollout.max_lag, config.rollout.partial_rollout) == (0, False)
    assert config.rollout.queue_depth == config.rollout.prompts_per_step
    assert resolve(
        ["--rollout.max_lag", "0", "--rollout.partial_rollout", "false", "--algo.correction.mode", "none"]
    )


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(
        ConfigError, match=r"unknown flag --rollout\.groupsize; did you mean --rollout\.group_size\?"
    ):
        resolve(["--rollout.groupsize", "4"])
    with pytest.raises(ConfigError, match=r"--train\.force_on_policy"):
        resolve(["--force_on_policy"])  # right field, group left out


def test_unknown_toml_key_names_the_file_and_suggests(tmp_path):
    file = _write(tmp_path, "[algo.kl]\ncoeff = 0.1\n")
    with pytest.raises(
        ConfigError, match=r"key algo\.kl\.coeff in .*run\.toml; did you mean --algo\.kl\.coef\?"
    ):
        resolve(["--config", file])
    with pytest.raises(ConfigError, match=r"unknown key optim in"):
        resolve(["--config", _write(tmp_path, "[optim]\nlr = 1\n")])
    with pytest.raises(ConfigError, match=r"rollout is a table"):
        resolve(["--config", _write(tmp_path, "rollout = 3\n")])


def test_unreadable_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(["--config", _write(tmp_path, "[rollout\n")])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--rollout.group_size", "eight"], "--rollout.group_size: expected int, got 'eight'", id="int"
        ),
        pytest.param(["--actor.lr=fast"], "--actor.lr: expected float, got 'fast'", id="float"),
        pytest.param(["--train.routing_replay", "maybe"], "--train.routing_replay: expected bool", id="bool"),
        pytest.param(
            ["--algo.advantage.estimator", "ppo"],
            "--algo.advantage.estimator: expected reinforce|rloo",
            id="literal",
        ),
        pytest.param(
            ["--actor.compute_dtype", "fp16"],
            "--actor.compute_dtype: expected model|float32|bfloat16, got 'fp16'",
            id="dtype",
        ),
        pytest.param(
            ["--algo.correction.seq_bounds", "0.9"], "--algo.correction.seq_bounds: expected float,float"
        ),
        pytest.param(
            ["--algo.loss.dual_clip", "wide"], "--algo.loss.dual_clip: expected float|none", id="optional"
        ),
        pytest.param(["--rollout.group_size"], "--rollout.group_size needs a value", id="missing-value"),
        pytest.param(["train"], "unexpected argument 'train'", id="positional"),
    ],
)
def test_ill_typed_flag_names_the_flag(args, message):
    with pytest.raises(ConfigError) as error:
        resolve(args)
    assert message in str(error.value)


def test_ill_typed_toml_value_names_the_file_and_the_flag(tmp_path):
    file = _write(tmp_path, '[rollout]\ngroup_size = "eight"\n')
    with pytest.raises(
        ConfigError, match=r"run\.toml: rollout\.group_size \(--rollout\.group_size\): expected int"
    ):
        resolve(["--config", file])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("1", True),
        ("yes", True),
        ("YES", True),
        ("false", False),
        ("0", False),
        ("no", False),
    ],
)
def test_bool_values(text, value):
    assert resolve(["--logger.verbose", text]).logger.verbose is value
    assert resolve([f"--logger.verbose={text}"]).logger.verbose is value


def test_bare_bool_flag_means_true():
    assert resolve(["--logger.verbose"]).logger.verbose is True
    config = resolve(["--logger.verbose", "--rollout.seed_requests", "--rollout.group_size", "4"])
    assert (config.logger.verbose, config.rollout.seed_requests, config.rollout.group_size) == (
        True,
        True,
        4,
    )


def test_none_and_tuple_and_negative_values():
    config = resolve(["--algo.loss.dual_clip", "3", "--vllm.max_num_batched_tokens", "4096"])
    assert (config.algo.loss.dual_clip, config.vllm.max_num_batched_tokens) == (3.0, 4096)
    assert resolve(["--algo.loss.dual_clip", "none"]).algo.loss.dual_clip is None
    assert resolve(["--ray.num_cpus=None"]).ray.num_cpus is None
    mis = resolve(["--algo.correction.mode", "mis", "--algo.correction.token_bounds", "0.25, 4"])
    assert mis.algo.correction.token_bounds == (0.25, 4.0)
    assert resolve(["--eval.pass_reward", "-0.5"]).eval.pass_reward == -0.5
    assert resolve(["--actor.lr", "3e-6"]).actor.lr == 3e-6
    assert resolve(["--vllm.urls", "http://a:1, http://b:2"]).vllm.urls == ["http://a:1", "http://b:2"]
    assert resolve(["--vllm.urls", ""]).vllm.urls == []


def test_last_repeated_flag_wins():
    assert resolve(["--rollout.group_size", "2", "--rollout.group_size", "4"]).rollout.group_size == 4


def test_render_toml_round_trips(tmp_path):
    args = ["--algo.loss.dual_clip", "3", "--data.messages_key", 'say "hi"\\\x7f é', "--actor.lr", "1e-05"]
    args += ["--algo.correction.mode", "seq-mask-tis", "--algo.correction.seq_bounds", "0.9,1.1"]
    args += ["--train.force_on_policy", "--ray.num_cpus", "2"]
    rows = tmp_path / "rows.jsonl"  # the file whose rows --data.messages_key names a field of
    rows.write_text("")
    args += ["--vllm.urls", "http://a:1,http://b:2", "--data.path", str(rows)]
    config = resolve(args)
    text = render_toml(config)
    tomllib.loads(text)
    assert resolve(["--config", _write(tmp_path, text)]) == config
    assert resolve(["--config", _write(tmp_path, render_toml(Config()))]) == validate(Config())


def test_every_field_has_a_flag_with_help():
    """A new field without a docstring under it fails here."""
    rows = flag_help()
    assert [flag for flag, *_ in rows] == [f"--{path}" for path in _leaf_paths()]
    for flag, type_name, default, help_text in rows:
        assert type_name and default, flag
        assert help_text and "\n" not in help_text, f"{flag} needs a one-line docstring in molt/config.py"


def test_every_field_has_a_default():
    for path in _leaf_paths():
        *groups, name = path.split(".")
        cls = Config
        for group in groups:
            cls = {f.name: f.type for f in msgspec.structs.fields(cls)}[group]
        field = {f.name: f for f in msgspec.structs.fields(cls)}[name]
        assert not field.required, path


def test_literals_agree_with_rlestimators():
    import rlestimators

    outcome = get_args(molt.config.OutcomeEstimator)
    assert outcome == get_args(rlestimators.EstimatorName)
    assert set(outcome) == set(rlestimators.ESTIMATORS)
    token_level = set(get_args(molt.config.EstimatorName)) - set(outcome)
    assert token_level == {"gae", "opd"}
    assert all(callable(getattr(rlestimators, name)) for name in token_level)
    assert get_args(molt.config.PolicyLossKind) == get_args(rlestimators.PolicyLossKind)
    assert get_args(molt.config.KLKind) == ("auto", *get_args(rlestimators.KLKind))
    assert get_args(molt.config.CorrectionMode) == get_args(rlestimators.CorrectionMode)


def test_config_fields_use_the_shared_literals():
    fields = {f.name: f.type for f in msgspec.structs.fields(molt.config.Advantage)}
    assert fields["estimator"] == molt.config.EstimatorName
    assert {f.name: f.type for f in msgspec.structs.fields(molt.config.Loss)}[
        "kind"
    ] == molt.config.PolicyLossKind
    assert {f.name: f.type for f in msgspec.structs.fields(molt.config.KL)}["kind"] == molt.config.KLKind
    correction = {f.name: f.type for f in msgspec.structs.fields(molt.config.Correction)}
    assert correction["mode"] == molt.config.CorrectionMode


def test_config_is_frozen_and_strict():
    with pytest.raises(AttributeError):
        Config().rollout.group_size = 3
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"rollout": {"groupsize": 3}}, Config)


def test_with_run_dir_uses_a_utc_timestamp():
    now = datetime.datetime(2026, 11, 30, 5, 15, 0, tzinfo=datetime.UTC)
    config = with_run_dir(Config(), now)
    assert config.logger.run_dir == "runs/20261130-051500"
    assert config.ckpt.dir == "runs/20261130-051500/checkpoints"
    explicit = with_run_dir(resolve(["--logger.run_dir", "/r", "--ckpt.dir", "/c"]), now)
    assert (explicit.logger.run_dir, explicit.ckpt.dir) == ("/r", "/c")
