"""What each `kl` estimator's gradient follows, by exact enumeration over a 6-token vocabulary.

The policy is pi = softmax(theta) with a parameter per token, the reference a fixed softmax. A loss term
`kl(logp, ref_logp, kind)` is differentiated on tokens sampled from pi, and the sampling itself is not
differentiated: its expected gradient is sum_x sg(pi(x)) * grad kl_term(x), computed here exactly with the
weights pi(x) detached. A penalty in the reward is detached and reaches theta through the score function:
sum_x pi(x) * sg(kl_term(x)) * grad log pi(x). Each is compared with the gradient of the divergence written
out below (not imported), taken by autograd through the exact sums.
"""

import pytest
import torch
from torch.testing import assert_close

from rlestimators import kl

THETA = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.0, -0.5], dtype=torch.float64)
REF_THETA = torch.tensor([1.0, 0.4, -0.3, 0.2, 0.5, -1.5], dtype=torch.float64)


def _policy(start: torch.Tensor = THETA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """theta (a leaf, at `start`), log pi(x) and log pi_ref(x) over the whole vocabulary, as [1, V] "token"
    rows."""
    theta = start.clone().requires_grad_(True)
    logp_1V = torch.log_softmax(theta, dim=0)[None]
    ref_logp_1V = torch.log_softmax(REF_THETA, dim=0)[None]
    return theta, logp_1V, ref_logp_1V


def loss_gradient(kind: str) -> torch.Tensor:
    """E_{x ~ pi}[grad kl_term(x)]: the estimator as a pathwise loss on sampled tokens."""
    theta, logp_1V, ref_logp_1V = _policy()
    expected = (logp_1V.exp().detach() * kl(logp_1V, ref_logp_1V, kind=kind)).sum()
    return torch.autograd.grad(expected, theta)[0].double()


def reward_gradient(kind: str, start: torch.Tensor = THETA) -> torch.Tensor:
    """E_{x ~ pi}[sg(kl_term(x)) * grad log pi(x)]: the estimator as a penalty in the reward."""
    theta, logp_1V, ref_logp_1V = _policy(start)
    penalty_1V = kl(logp_1V, ref_logp_1V, kind=kind).detach().double()
    expected = (logp_1V.exp().detach() * penalty_1V * logp_1V).sum()
    return torch.autograd.grad(expected, theta)[0]


def grad_kl_policy_to_ref(start: torch.Tensor = THETA) -> torch.Tensor:
    """grad of KL(pi || pi_ref) = sum_x pi(x) * (log pi(x) - log pi_ref(x)): reverse, mode-seeking."""
    theta, logp_1V, ref_logp_1V = _policy(start)
    divergence = (logp_1V.exp() * (logp_1V - ref_logp_1V)).sum()
    return torch.autograd.grad(divergence, theta)[0]


def grad_kl_ref_to_policy() -> torch.Tensor:
    """grad of KL(pi_ref || pi) = sum_x pi_ref(x) * (log pi_ref(x) - log pi(x)): forward, mass-covering."""
    theta, logp_1V, ref_logp_1V = _policy()
    divergence = (ref_logp_1V.exp() * (ref_logp_1V - logp_1V)).sum()
    return torch.autograd.grad(divergence, theta)[0]


@pytest.mark.parametrize(
    ("kind", "divergence"),
    [
        pytest.param("k2", grad_kl_policy_to_ref, id="k2-follows-KL(pi||ref)"),
        pytest.param("k3", grad_kl_ref_to_policy, id="k3-follows-KL(ref||pi)"),
    ],
)
def test_each_loss_estimator_follows_the_divergence_it_names(kind, divergence):
    target = divergence()
    assert target.abs().max() > 0.05  # the two policies differ: the comparison has something to compare
    assert_close(loss_gradient(kind), target, rtol=1e-5, atol=1e-6)


def test_k3_as_a_loss_does_not_follow_the_reverse_kl_nor_k2_the_forward_one():
    # The control of the test above: the two directions' gradients differ here, so the match is no accident.
    assert (loss_gradient("k3") - grad_kl_policy_to_ref()).abs().max() > 0.05
    assert (loss_gradient("k2") - grad_kl_ref_to_policy()).abs().max() > 0.05


def test_k1_as_a_loss_has_zero_expected_gradient():
    assert_close(loss_gradient("k1"), torch.zeros_like(THETA), rtol=0, atol=1e-6)
    theta, logp_1V, ref_logp_1V = _policy()  # ... while its value is the KL itself, far from zero
    value = (logp_1V.exp() * kl(logp_1V, ref_logp_1V, kind="k1")).sum().item()
    assert value == pytest.approx(((logp_1V - ref_logp_1V) * logp_1V.exp()).sum().item(), rel=1e-5)
    assert value > 0.5


def test_k1_as_a_reward_penalty_follows_the_reverse_kl():
    """Why k1 stays valid in the reward: through the score function it is KL(pi || pi_ref)'s gradient."""
    assert_close(reward_gradient("k1"), grad_kl_policy_to_ref(), rtol=1e-5, atol=1e-6)


def test_k3_as_a_reward_penalty_follows_the_difference_of_the_two_directions():
    # sum_x pi * k3 * grad log pi = grad KL(pi || ref) - grad KL(ref || pi): the score function drops the
    # pathwise term that the loss form keeps (the test above: grad KL(ref || pi))
    assert_close(
        reward_gradient("k3"), grad_kl_policy_to_ref() - grad_kl_ref_to_policy(), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_k2_and_k3_as_reward_penalties_are_second_order_near_the_reference(kind):
    """Why the reward takes k1 (molt says so at start of a run with k2 or k3 there): at a policy eps away
    from the reference, grad KL(pi || ref) is of order eps, these penalties' gradients of order eps^2."""
    shares = []
    for eps in (0.1, 0.01):
        start = REF_THETA + eps * (THETA - REF_THETA)
        shares.append(reward_gradient(kind, start).norm() / grad_kl_policy_to_ref(start).norm())
    assert shares[0] < 0.1 and shares[1] < 0.15 * shares[0]  # eps 10x smaller: the share ~10x smaller
    assert_close(reward_gradient("k1", start), grad_kl_policy_to_ref(start), rtol=1e-4, atol=1e-7)  # control
