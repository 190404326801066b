"""The advantage half of the algorithm module (`molt._objective.score`): each estimator scored through
stand-in groups (plain objects with the policy's, reference's, critic's and teacher's pass methods, which
return fixed tensors here: the passes themselves are tested in test_molt_actor.py and test_molt_critic.py),
and the one table of what each estimator reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from molt._batch import collate
from molt._config_algo import TOKEN_ESTIMATORS, estimator_needs
from molt._flags import resolve
from molt._objective import ADVANTAGES, score
from molt._placement import extra_groups

# Two groups of two rollouts; the third rollout (a compacted one) has two rows.
ROWS_R = torch.tensor([1, 1, 2, 1])
REWARDS_R = torch.tensor([1.0, 0.0, 1.0, 1.0])


def _batch():
    rows = [([5, 6, 7], [0, 1, 1], [-0.5, -0.5, -0.5], 0.0)] * 5
    return collate(rows, pad_id=0)


class Passes:
    """Stand-in groups: `.policy.logprobs` gives -1 per token, `.reference.logprobs` -1.5, the critic's
    values 0.25, the teacher's logprobs -0.5; each call is counted, and what each logprob pass was asked
    for (`trained_only`: every use of them is masked to the trained tokens)."""

    def __init__(self, *, reference=False, critic=False, teacher=False):
        self.calls: list[str] = []
        self.trained_only: list[bool] = []
        self.policy = self._group("policy", logprobs=-1.0)
        self.reference = self._group("reference", logprobs=-1.5) if reference else None
        self.critic = self._group("critic", values=0.25) if critic else None
        self.teacher = self._group("teacher", logprobs=-0.5) if teacher else None

    def _group(self, name, **value):
        ((method, fill),) = value.items()

        def passes(batch, **asked):
            self.calls.append(f"{name}.{method}")
            if method == "logprobs":
                self.trained_only.append(asked.get("trained_only", False))
            return torch.full(batch.tokens_BT.shape, fill)

        return SimpleNamespace(**{method: passes})


def _config(*flags):
    return resolve(["--rollout.group_size", "2", *flags])


def test_every_token_level_estimator_has_its_function_and_its_needs():
    assert set(ADVANTAGES) == set(TOKEN_ESTIMATORS)
    assert extra_groups(_config("--algo.advantage.estimator", "gae")) == ["critic"]
    assert estimator_needs("grpo") == estimator_needs("maxrl")  # outcome estimators read rewards alone


def test_an_outcome_estimator_gives_each_rollout_its_advantage_on_all_its_rows():
    passes = Passes()
    scored = score(_batch(), REWARDS_R, ROWS_R, passes, _config("--algo.advantage.estimator", "reinforce"))
    assert scored.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]  # each minus its group's mean
    assert scored.batch.advantages_BT[:, 1].tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]  # rollout 3's two rows
    assert scored.batch.advantages_BT[:, 0].tolist() == [0.0] * 5  # the prompt token trains nothing
    assert passes.calls == ["policy.logprobs"]  # the default 2 windows: a separate old-logprob pass
    assert passes.trained_only == [True]  # the trained tokens' alone: the logprob head computes no other
    assert torch.equal(scored.policy.old_logp_BT, torch.full((5, 3), -1.0)) and scored.critic is None


def test_the_separate_pass_covers_the_later_windows_rows_alone():
    """The first window's step takes its old logprobs from its own forward (nothing has stepped before
    it: `molt.loop.train_windows`): NaN on its rows, which no step reads."""
    passes, shapes = Passes(), []
    logprobs = passes.policy.logprobs
    passes.policy.logprobs = lambda batch, **asked: (
        shapes.append(tuple(batch.tokens_BT.shape)) or logprobs(batch, **asked)
    )
    scored = score(_batch(), REWARDS_R, ROWS_R, passes, _config(), first_window=[3, 0])
    assert shapes == [(3, 3)]  # rows 1, 2 and 4
    old_BT = scored.policy.old_logp_BT
    assert old_BT[[0, 3]].isnan().all() and torch.equal(old_BT[[1, 2, 4]], torch.full((3, 3), -1.0))
    # a KL penalty in the reward reads every row's before any step
    in_reward = _config("--algo.kl.coef", "0.1", "--algo.kl.in_reward", "true")
    scored = score(_batch(), REWARDS_R, ROWS_R, Passes(reference=True), in_reward, first_window=[3, 0])
    assert not scored.policy.old_logp_BT.isnan().any()


def test_one_window_takes_the_old_logprobs_from_the_steps_own_forward():
    passes = Passes()
    scored = score(_batch(), REWARDS_R, ROWS_R, passes, _config("--train.mini_batches", "1"))
    assert passes.calls == [] and scored.policy.old_logp_BT is None


@pytest.mark.parametrize("kind", [["--algo.kl.kind", "k1"], []], ids=["k1", "auto"])
def test_a_kl_in_the_reward_lowers_each_rollouts_reward_by_its_rows_penalty(kind):
    """auto, the default, is k1 in the reward: the one whose score-function gradient is KL(pi || ref)'s."""
    passes = Passes(reference=True)
    flags = ["--algo.kl.coef", "0.1", "--algo.kl.in_reward", "true", *kind]
    scored = score(
        _batch(), REWARDS_R, ROWS_R, passes, _config("--algo.advantage.estimator", "reinforce", *flags)
    )
    # k1 = old - ref = 0.5 per trained token, 2 a row: rollout 3 (two rows) loses 0.2, the others 0.1
    assert scored.metrics["train/kl"] == pytest.approx(0.5)
    assert scored.advantages.tolist() == pytest.approx([0.5, -0.5, -0.05, 0.05])
    assert scored.policy.ref_logp_BT is None  # no loss term besides
    assert passes.trained_only == [True, True]  # the policy's and the reference's


def test_gae_hands_the_critic_its_values_and_returns():
    passes = Passes(critic=True)
    flags = ["--algo.advantage.estimator", "gae", "--algo.gae.whiten", "false", "--algo.gae.gamma", "1.0"]
    scored = score(_batch(), REWARDS_R, ROWS_R, passes, _config(*flags, "--algo.gae.lam", "1.0"))
    assert passes.calls == ["policy.logprobs", "critic.values"]
    assert torch.equal(scored.critic.old_values_BT, torch.full((5, 3), 0.25))
    returns_B = scored.critic.returns_BT[:, 1]  # gamma = lam = 1: each row's return is its reward
    assert returns_B.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert scored.batch.advantages_BT[:, 1].tolist() == pytest.approx([0.75, -0.25, 0.75, 0.75, 0.75])
    assert "critic/explained_variance" in scored.metrics


def test_opd_scores_the_students_tokens_against_the_teacher(tmp_path, tiny_model_dir):
    passes = Passes(teacher=True)
    model = ["--model.path", str(tiny_model_dir)]
    flags = [*model, "--algo.advantage.estimator", "opd", "--algo.teacher.model", str(tiny_model_dir)]
    scored = score(_batch(), REWARDS_R, ROWS_R, passes, _config(*flags, "--train.mini_batches", "1"))
    assert passes.calls == ["policy.logprobs", "teacher.logprobs"]  # opd reads them even with one window
    assert passes.trained_only == [True, True]
    assert scored.batch.advantages_BT[:, 1:].unique().tolist() == [0.5]  # teacher - student
    assert scored.metrics["teacher/reverse_kl"] == pytest.approx(-0.5)
