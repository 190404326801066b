"""Outcome estimators, GAE and OPD against closed forms and naive per-group / per-token loops."""

import math

import pytest
import torch
from torch.testing import assert_close

import rlestimators
from rlestimators import ESTIMATORS, gae, opd

# Group 7: rewards 1, 0, 0, 0 (mean 0.25, Bessel std 0.5); group -3: 2, 4 (mean 3, std sqrt 2); group 100: 5
# alone. Ids are unsorted, negative and not contiguous on purpose.
REWARDS = [1.0, 2.0, 0.0, 4.0, 0.0, 0.0, 5.0]
GROUPS = [7, -3, 7, -3, 7, 7, 100]
CENTERED = [0.75, -1.0, -0.25, 1.0, -0.25, -0.25, 0.0]
R2 = 1 / math.sqrt(2)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("reinforce", CENTERED, id="reinforce"),
        pytest.param("rloo", [1.0, -2.0, -1 / 3, 2.0, -1 / 3, -1 / 3, 0.0], id="rloo"),
        pytest.param("grpo", [1.5, -R2, -0.5, R2, -0.5, -0.5, 0.0], id="grpo"),
        pytest.param("dr_grpo", CENTERED, id="dr_grpo"),
        # sum of squares of CENTERED = 2.75 over B - 1 = 6
        pytest.param("reinforce_pp", [c / math.sqrt(2.75 / 6) for c in CENTERED], id="reinforce_pp"),
        # CENTERED / group mean: group 7 by 0.25, group -3 by 3
        pytest.param("maxrl", [3.0, -1 / 3, -1.0, 1 / 3, -1.0, -1.0, 0.0], id="maxrl"),
    ],
)
def test_estimator_closed_form(name, expected):
    adv_B = ESTIMATORS[name](torch.tensor(REWARDS), torch.tensor(GROUPS))
    assert_close(adv_B, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def naive_advantage(name, rewards, groups):
    """One sample at a time, with Python lists: the definitions of DESIGN §3."""
    out = []
    for reward, group in zip(rewards, groups, strict=True):
        members = [r for r, g in zip(rewards, groups, strict=True) if g == group]
        n, mean = len(members), sum(members) / len(members)
        if name in ("reinforce", "dr_grpo", "reinforce_pp"):
            out.append(reward - mean)
        elif name == "maxrl":
            out.append((reward - mean) / mean if mean > 0 else 0.0)
        elif name == "rloo":
            out.append(0.0 if n == 1 else reward - (sum(members) - reward) / (n - 1))
        else:  # grpo
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1)) if n > 1 else 0.0
            out.append(0.0 if n == 1 else (reward - mean) / (std + 1e-6))
    if name == "reinforce_pp":
        std = math.sqrt(sum(a * a for a in out) / max(len(out) - 1, 1))
        out = [a / (std + 1e-6) for a in out]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimator_matches_naive_loop_on_shuffled_groups(name):
    generator = torch.Generator().manual_seed(0)
    group_sizes = [1, 2, 3, 5, 8]
    ids = torch.cat(
        [torch.full((size,), gid) for size, gid in zip(group_sizes, [40, -7, 3, 1000, 12], strict=True)]
    )
    order = torch.randperm(ids.numel(), generator=generator)
    groups_B = ids[order]
    rewards_B = torch.randn(ids.numel(), generator=generator, dtype=torch.float64)
    expected = naive_advantage(name, rewards_B.tolist(), groups_B.tolist())
    assert_close(ESTIMATORS[name](rewards_B, groups_B), expected)


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize(
    ("rewards", "groups"),
    [
        pytest.param([3.0, -1.0, 2.0], [0, 1, 2], id="all-singletons"),
        pytest.param([1.0, 1.0, 1.0, 0.5, 0.5], [4, 4, 4, 9, 9], id="all-equal-in-group"),
        pytest.param([0.0, 0.0, 0.0, 1.0, 1.0], [-5, -5, -5, 8, 8], id="all-failed-or-all-passed"),
        pytest.param([7.0], [0], id="batch-of-one"),
    ],
)
def test_estimator_gives_zero_without_signal(name, rewards, groups):
    adv_B = ESTIMATORS[name](torch.tensor(rewards), torch.tensor(groups))
    assert_close(adv_B, torch.zeros(len(rewards)))


def test_rloo_keeps_the_rewards_precision():
    # Ahmadian et al. 2024: A_i = r_i - mean of the other n - 1. One success among 7: the success gets
    # 1 - 0 = 1, each failure 0 - 1/6, to float64 rounding; n/(n-1) = 7/6 is no float32 number, and a float32
    # factor would put every advantage off by ~3e-8.
    rewards_B = torch.tensor([1.0] + [0.0] * 6, dtype=torch.float64)
    adv_B = rlestimators.rloo(rewards_B, torch.zeros(7, dtype=torch.int64))
    assert_close(adv_B, torch.tensor([1.0] + [-1 / 6] * 6, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        # K of N successes: a success gets N/K - 1, a failure -1 (Eq. 11 times N)
        pytest.param([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [7.0] + [-1.0] * 7, id="1-of-8"),
        pytest.param([0.0, 1.0, 1.0, 1.0], [-1.0, 1 / 3, 1 / 3, 1 / 3], id="3-of-4"),
        pytest.param([0.5, 0.0], [1.0, -1.0], id="partial-credit"),
        pytest.param([-1.0, 0.0, 0.5], [0.0, 0.0, 0.0], id="mean-below-zero"),
    ],
)
def test_maxrl_divides_by_the_pass_rate(rewards, expected):
    adv_B = rlestimators.maxrl(torch.tensor(rewards), torch.full((len(rewards),), 3))
    assert_close(adv_B, torch.tensor(expected))


def test_maxrl_weighs_hard_prompts_more_than_reinforce():
    # The lone success of a hard group (1 of 8) and the lone failure of an easy group (7 of 8): REINFORCE
    # gives both |advantage| 7/8; MaxRL gives the hard success 7 and the easy failure -1 (1/p weighting).
    rewards_B = torch.tensor([1.0] + [0.0] * 7 + [0.0] + [1.0] * 7)
    groups_B = torch.tensor([20] * 8 + [-4] * 8)
    assert_close(rlestimators.reinforce(rewards_B, groups_B)[[0, 8]], torch.tensor([0.875, -0.875]))
    assert_close(rlestimators.maxrl(rewards_B, groups_B)[[0, 8]], torch.tensor([7.0, -1.0]))


def test_maxrl_is_invariant_to_reward_scale():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    groups_B = torch.tensor([1, 1, 1, 2, 2, 2])
    assert_close(rlestimators.maxrl(10.0 * rewards_B, groups_B), rlestimators.maxrl(rewards_B, groups_B))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimator_output_has_no_gradient(name):
    rewards_B = torch.tensor([1.0, 0.0, 0.5, 0.5], requires_grad=True)
    assert not ESTIMATORS[name](rewards_B, torch.tensor([0, 0, 1, 1])).requires_grad


@pytest.mark.parametrize(
    ("rewards", "groups", "message"),
    [
        pytest.param(
            torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1]), "one group id per reward", id="length"
        ),
        pytest.param(torch.zeros(0), torch.zeros(0, dtype=torch.int64), "non-empty", id="empty"),
        pytest.param(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), "integer", id="float-ids"),
        pytest.param(torch.tensor([1, 0]), torch.tensor([0, 0]), "floating-point", id="int-rewards"),
        pytest.param(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64), "1-D", id="2d"),
    ],
)
def test_estimator_refuses_bad_input(rewards, groups, message):
    for fn in ESTIMATORS.values():
        with pytest.raises(ValueError, match=message):
            fn(rewards, groups)


def naive_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE over the trainable tokens of one sequence, compacted; rewards on a non-trainable token
    move to the trainable token before it."""
    steps = [t for t, m in enumerate(mask) if m]
    step_rewards = [0.0] * len(steps)
    for t, reward in enumerate(rewards):
        owners = [k for k, s in enumerate(steps) if s <= t]
        if owners:
            step_rewards[owners[-1]] += reward
    adv, running = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(steps))):
        next_value = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        running = step_rewards[k] + gamma * next_value - values[steps[k]] + gamma * lam * running
        adv[steps[k]] = running
    returns = [a + v if m else 0.0 for a, v, m in zip(adv, values, mask, strict=True)]
    return adv, returns


@pytest.mark.parametrize(
    ("mask", "gamma", "lam"),
    [
        pytest.param([1, 1, 1, 1, 1, 1], 0.9, 0.8, id="all-trainable"),
        pytest.param([0, 1, 1, 0, 0, 1], 0.9, 0.8, id="tool-output-in-the-middle"),
        pytest.param([1, 0, 1, 0, 1, 0], 1.0, 1.0, id="monte-carlo"),
        pytest.param([0, 0, 0, 0, 0, 0], 0.9, 0.95, id="fully-masked"),
    ],
)
def test_gae_matches_naive_recursion(mask, gamma, lam):
    generator = torch.Generator().manual_seed(1)
    rewards_BT = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    values_BT = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    mask_BT = torch.tensor([mask, [1] * 6, mask])
    adv_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, gamma=gamma, lam=lam)
    for b in range(3):
        adv, returns = naive_gae(
            rewards_BT[b].tolist(), values_BT[b].tolist(), mask_BT[b].tolist(), gamma, lam
        )
        assert_close(adv_BT[b], torch.tensor(adv, dtype=torch.float64))
        assert_close(returns_BT[b], torch.tensor(returns, dtype=torch.float64))


def test_gae_closed_form_monte_carlo_return():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, whatever the values after t.
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0]])
    values_BT = torch.tensor([[0.5, 0.2, 0.9]])
    adv_BT, returns_BT = gae(rewards_BT, values_BT, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(adv_BT, torch.tensor([[0.5, 0.8, 0.1]]))
    assert_close(returns_BT, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_refuses_bad_input():
    with pytest.raises(ValueError, match="must match"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="empty batch"):
        gae(torch.zeros(0, 3), torch.zeros(0, 3), torch.ones(0, 3), gamma=1.0, lam=1.0)


def test_opd_is_teacher_minus_student_on_trainable_tokens():
    student_BT = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    teacher_BT = torch.tensor([[-0.5, -2.5, -1.0]], requires_grad=True)
    adv_BT = opd(student_BT, teacher_BT, torch.tensor([[1, 1, 0]]))
    assert_close(adv_BT, torch.tensor([[0.5, -0.5, 0.0]]))
    assert not adv_BT.requires_grad


def test_estimators_run_on_float64_and_keep_dtype():
    adv_B = rlestimators.grpo(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([3, 3]))
    assert adv_B.dtype == torch.float64
