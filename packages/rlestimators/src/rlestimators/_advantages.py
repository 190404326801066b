"""Advantage estimators: outcome estimators over prompt groups, and the token-level GAE and OPD.

Outcome estimators map `rewards[B]` and `group_ids[B]` to `advantages[B]`; a group is every sample of one
prompt. Group ids are arbitrary integers in any order (not necessarily contiguous or sorted); statistics are
gathered with `torch.unique(return_inverse=True)` and `index_add_`, never a Python loop over groups. A group
of size 1 has no baseline but itself, so its advantage is 0; a group of equal rewards gets exactly 0 under
every estimator (never float rounding divided by a rounding-sized std). Outputs carry no gradient.

This module refuses to normalise over tokens: the loss side divides by one global count (DESIGN §6).

Legend: B sequences, T tokens, G distinct groups in the batch.
"""

from typing import Literal

import torch

from rlestimators._checks import check_bt, check_groups

EstimatorName = Literal["reinforce", "rloo", "grpo", "dr_grpo", "reinforce_pp", "maxrl"]
"""The names in `ESTIMATORS`; a config field of this type selects one (a test checks the two agree)."""

_STD_EPS = 1e-6


def _group_sum(values_B: torch.Tensor, inverse_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    return values_B.new_zeros(num_groups).index_add_(0, inverse_B, values_B)


def _centered(rewards_B: torch.Tensor, group_ids_B: torch.Tensor):
    """r - mean_g(r), with the group index and sizes for estimators that need more statistics.

    Computed as d - mean_g(d) with d = r - min_g(r): in an all-equal group every d is exactly 0, so its
    centred values are exactly 0 rather than the rounding error of a float mean (7 x 0.7 in float32 averages
    to 0.7 + 6e-8, which GRPO's std division would blow up to +-0.056). In exact arithmetic the shift
    changes nothing; in floats it also keeps the digits a large common offset would cost.
    """
    check_groups(rewards_B, group_ids_B)
    rewards_B = rewards_B.detach()
    # The dense group index of each sample, in [0, G), and the size of each group.
    _, inverse_B, count_G = torch.unique(group_ids_B, return_inverse=True, return_counts=True)
    num_groups = count_G.numel()
    min_G = rewards_B.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse_B, rewards_B, "amin")
    shifted_B = rewards_B - min_G[inverse_B]
    shifted_mean_G = _group_sum(shifted_B, inverse_B, num_groups) / count_G
    return shifted_B - shifted_mean_G[inverse_B], inverse_B, count_G


def reinforce(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE (Williams 1992) with the group-mean baseline: A_i = r_i - mean_g(r).

    A group of size 1 is its own baseline, so its advantage is 0.
    """
    return _centered(rewards, group_ids)[0]


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", §3.3 RLOO):
    A_i = r_i - mean_{j != i in g}(r_j), which equals n/(n-1) * (r_i - mean_g(r)) for a group of size n.

    A group of size 1 has no other member, so its advantage is 0.
    """
    centered_B, inverse_B, count_G = _centered(rewards, group_ids)
    # n/(n-1) in the rewards' dtype (int / int would be float32); the clamp only guards n == 1, where
    # centered_B is already exactly 0.
    scale_G = count_G.to(centered_B.dtype) / (count_G - 1).clamp(min=1)
    return centered_B * scale_G[inverse_B]


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath §4.1.2):
    A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6), std with Bessel's correction (torch's default).

    A group of size 1 has an undefined std; its advantage is 0. A group whose rewards are all equal gets
    exactly 0 (its centred values are exact zeros, see `_centered`), never rounding noise over a tiny std.
    """
    centered_B, inverse_B, count_G = _centered(rewards, group_ids)
    sq_sum_G = _group_sum(centered_B.square(), inverse_B, count_G.numel())
    # Bessel: divide by n - 1; the clamp only guards n == 1, where the numerator is 0 (so adv = 0 / 1e-6 = 0).
    std_G = (sq_sum_G / (count_G - 1).clamp(min=1)).sqrt()
    return centered_B / (std_G[inverse_B] + _STD_EPS)


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.2): A_i = r_i - mean_g(r).

    It drops GRPO's std division; its other half, no per-sequence length normalisation, lives on the loss
    side: each sequence's token sum over a constant (the generation budget), averaged over sequences
    (molt's `--algo.loss.agg seq-mean-token-sum-norm`, its default under dr_grpo).
    """
    return _centered(rewards, group_ids)[0]


def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++", §3): subtract the group mean, then divide by the
    std over the whole batch of those group-centred values (Bessel-corrected) plus 1e-6.

    Each sample counts once (DESIGN §3); the paper normalises the per-token advantages A_{q,o_t}, where a
    sample counts once per token and a long one weighs more in the batch mean and std. Per sample, the
    batch mean of group-centred values is exactly 0, so the global normalisation only divides. With
    B == 1 (or only singleton groups) every centred value is 0, the std is taken as 0, and advantages are 0.
    """
    centered_B = _centered(rewards, group_ids)[0]
    # Written out rather than `.std()`, which warns and returns NaN when B == 1.
    std = (centered_B.square().sum() / max(centered_B.numel() - 1, 1)).sqrt()
    return centered_B / (std + _STD_EPS)


def maxrl(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning", arXiv:2602.02710, §4.2 Eq. 11
    and Algorithm 1): A_i = (r_i - mean_g(r)) / mean_g(r).

    For 0/1 rewards, N samples with K successes, Eq. 11 is sum_i (r_i / K - 1 / N) * grad log pi(y_i), which
    is (1/N) * sum_i A_i * grad log pi(y_i) with this A_i: an unbiased gradient of the truncated
    log-likelihood log p (to order N) instead of p, so a prompt's weight grows as 1 / (its pass rate).
    Rewards must be success-like (r >= 0, 0 = failure): a group whose mean is <= 0 has no success to
    normalise by and gets 0 (Algorithm 1 for K = 0), as do a group of size 1 and a group of equal rewards.
    """
    centered_B, inverse_B, count_G = _centered(rewards, group_ids)
    mean_G = _group_sum(rewards.detach(), inverse_B, count_G.numel()) / count_G
    # 1 / mean where the group has a success; the 1/0 of the other branch is discarded, never multiplied.
    inv_mean_G = torch.where(mean_G > 0, 1 / mean_G, 0.0)
    return centered_B * inv_mean_G[inverse_B]


ESTIMATORS = {fn.__name__: fn for fn in (reinforce, rloo, grpo, dr_grpo, reinforce_pp, maxrl)}


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, Eq. 16), over trainable tokens only.

    The recursion A_t = delta_t + gamma * lam * A_next, delta_t = r_t + gamma * V_next - V_t steps from one
    trainable token to the next trainable token, passing over non-trainable ones (tool output, prompt): they
    are the environment's transition, not actions. A reward placed on a non-trainable token is added to the
    closest trainable token before it (the action that led to it); one before any trainable token is dropped.
    The value after the last trainable token is 0 (terminal). Returns `(advantages, returns)`, both [B, T],
    0 on non-trainable tokens, without gradient.
    """
    check_bt("mask", mask, token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    rewards_BT = token_rewards.detach().to(dtype)
    values_BT = values.detach().to(dtype)
    trainable_BT = mask != 0

    num_seqs, num_tokens = mask.shape
    adv_BT = torch.zeros_like(values_BT)
    # What the recursion carries from t + 1 back to t, each [B], from 0 (rows of one [3, B] zero tensor;
    # every step rebinds them, none is written in place).
    next_value_B, next_adv_B, carried_reward_B = values_BT.new_zeros(3, num_seqs)
    for t in reversed(range(num_tokens)):
        is_action_B = trainable_BT[:, t]
        reward_B = rewards_BT[:, t] + carried_reward_B
        delta_B = reward_B + gamma * next_value_B - values_BT[:, t]
        adv_t_B = delta_B + gamma * lam * next_adv_B
        adv_BT[:, t] = torch.where(is_action_B, adv_t_B, 0.0)
        next_adv_B = torch.where(is_action_B, adv_t_B, next_adv_B)
        next_value_B = torch.where(is_action_B, values_BT[:, t], next_value_B)
        carried_reward_B = torch.where(is_action_B, 0.0, reward_B)
    returns_BT = torch.where(trainable_BT, adv_BT + values_BT, 0.0)
    return adv_BT, returns_BT


def opd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """On-policy distillation advantage (Agarwal et al. 2024, GKD; Thinking Machines 2025, "On-Policy
    Distillation"): A_t = log pi_teacher(y_t) - log pi_student(y_t) on the student's own samples, the negative
    per-token reverse KL. 0 on non-trainable tokens, without gradient. [B, T].
    """
    check_bt("mask", mask, student_logp=student_logp, teacher_logp=teacher_logp)
    return torch.where(mask != 0, teacher_logp.detach() - student_logp.detach(), 0.0)
