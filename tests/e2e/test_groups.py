"""The optional groups end to end: the reference policy (`--algo.kl.coef`), the PPO critic
(`--algo.advantage.estimator gae`) and the teacher (`--algo.advantage.estimator opd`).

Each run uses the flags of the session's `plain_run` plus its group's, so while its weights equal the plain
run's it samples the same rollouts (seeded requests, strict on-policy): the step where its update first
departs from the plain run's is the group's doing. A run starts exactly the groups it asks for.
"""

from __future__ import annotations

import pytest
from molt_runs import molt, reproducible_run_args, steps_of

pytestmark = pytest.mark.slow

GROUP_MESSAGES = {
    "reference": "starting the reference policy",
    "critic": "starting the critic",
    "teacher": "starting the teacher",
}


@pytest.fixture
def train(tmp_path, tiny_model_dir, molt_engine, ray_cluster):
    """`train(*flags)`: a run under the plain run's flags plus `flags`, in `tmp_path / "run"`; returns
    its progress output and its steps."""

    def run(*flags: str) -> tuple[str, dict[int, dict]]:
        common = reproducible_run_args(tiny_model_dir, molt_engine.url, ray_cluster.address)
        run_dir = tmp_path / "run"
        result = molt("train", *common, "--logger.run_dir", str(run_dir), *flags, env=ray_cluster.env)
        return result.stderr, steps_of(run_dir)

    return run


def started_groups(stderr: str) -> set[str]:
    return {name for name, message in GROUP_MESSAGES.items() if message in stderr}


def differs(a: float, b: float) -> bool:
    return abs(a - b) > 1e-3 * max(abs(a), abs(b), 1e-6)


def test_the_plain_run_starts_no_extra_group(plain_run):
    assert started_groups(plain_run.stderr) == set()
    assert not list(plain_run.dir.glob("checkpoints/*/critic"))


def test_a_kl_penalty_starts_a_frozen_reference(train, plain_run):
    stderr, steps = train(
        "--train.num_steps", "2",
        "--algo.kl.coef", "5.0", "--algo.kl.in_reward", "true",
    )  # fmt: skip
    plain = steps_of(plain_run.dir)
    assert started_groups(stderr) == {"reference"}
    assert steps[1]["train/kl"] == 0.0  # the policy still equals its reference: the plain run's update
    assert steps[1]["train/grad_norm"] == pytest.approx(plain[1]["train/grad_norm"], rel=1e-4)
    assert steps[2]["rollout/reward_mean"] == plain[2]["rollout/reward_mean"]  # the same samples ...
    assert steps[2]["train/kl"] != 0.0  # ... but the policy has moved from the frozen reference (k1: signed)
    assert differs(steps[2]["train/grad_norm"], plain[2]["train/grad_norm"])


def test_gae_trains_a_critic_that_checkpoints_and_resumes(train, plain_run, ray_cluster, tmp_path):
    run_dir = tmp_path / "run"  # where `train` runs
    stderr, steps = train(
        "--train.num_steps", "1", "--ckpt.every", "1",
        "--algo.advantage.estimator", "gae",
        "--train.mini_batches", "1",  # one critic step: its logged values are the new head's, all 0
    )  # fmt: skip
    plain = steps_of(plain_run.dir)
    assert started_groups(stderr) == {"critic"}
    assert steps[1]["rollout/reward_mean"] == plain[1]["rollout/reward_mean"]  # the same samples
    assert differs(steps[1]["train/grad_norm"], plain[1]["train/grad_norm"])  # other advantages
    assert steps[1]["critic/value_mean"] == 0.0  # a new value head starts at zero
    assert steps[1]["critic/value_loss"] > 0.0 and "critic/explained_variance" in steps[1]
    assert (run_dir / "checkpoints" / "step_000001" / "critic" / ".metadata").is_file()

    resumed = molt("train", "--resume", str(run_dir), "--train.num_steps", "2", env=ray_cluster.env)
    assert "resumed from" in resumed.stderr and started_groups(resumed.stderr) == {"critic"}
    after = steps_of(run_dir)[2]
    assert after["critic/value_mean"] != 0.0  # the trained critic came back (a new head would give 0)
    assert after["critic/value_loss"] > 0.0


def test_opd_distils_from_a_frozen_teacher(train, plain_run, tmp_path):
    from molt.tiny import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", seed=1)  # the policy's tokenizer, other weights
    stderr, steps = train(
        "--train.num_steps", "1",
        "--algo.advantage.estimator", "opd", "--algo.teacher.model", str(teacher),
        "--agent.num_runners", "0",  # the agent in the trainer's process, not behind Ray
    )  # fmt: skip
    plain = steps_of(plain_run.dir)
    assert started_groups(stderr) == {"teacher"}
    # The same samples as the plain run (whose agent ran in a Ray host).
    assert steps[1]["rollout/reward_mean"] == plain[1]["rollout/reward_mean"]
    assert steps[1]["teacher/reverse_kl"] != 0.0  # the teacher scores them otherwise
    assert steps[1]["train/zero_advantage_frac"] < 0.5  # token-level advantages from the teacher
    assert differs(steps[1]["train/grad_norm"], plain[1]["train/grad_norm"])
