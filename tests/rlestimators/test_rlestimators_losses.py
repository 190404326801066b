"""policy_loss, kl, value_loss and masked_sum: closed forms, gradient flow, masking, and the invariance of
the update to how an optimizer window is split into micro-batches under one global token denominator."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlestimators import (
    entropy_from_logits,
    grpo,
    kl,
    masked_sum,
    policy_loss,
    rollout_correction,
    token_logprobs,
    value_loss,
)

KINDS = ["ppo", "gspo", "cispo", "pg"]
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def one_token(ratio, adv, **kwargs):
    """Loss, metrics and d loss / d logp for a single token with old_logp = 0."""
    logp_BT = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(logp_BT, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss.item(), metrics, logp_BT.grad.item()


@pytest.mark.parametrize(
    ("ratio", "adv", "dual_clip", "loss", "grad", "clip_frac", "dual_frac"),
    [
        pytest.param(1.0, 2.0, None, -2.0, -2.0, 0.0, 0.0, id="on-policy"),
        pytest.param(1.5, 1.0, None, -1.28, 0.0, 1.0, 0.0, id="pos-adv-clipped-high"),
        pytest.param(1.5, -1.0, None, 1.5, 1.5, 0.0, 0.0, id="neg-adv-above-range-unclipped"),
        pytest.param(0.5, -1.0, None, 0.8, 0.0, 1.0, 0.0, id="neg-adv-clipped-low"),
        pytest.param(0.5, 1.0, None, -0.5, -0.5, 0.0, 0.0, id="pos-adv-below-range-unclipped"),
        pytest.param(5.0, -1.0, 3.0, 3.0, 0.0, 0.0, 1.0, id="dual-clip-caps-at-3A"),
        pytest.param(2.0, -1.0, 3.0, 2.0, 2.0, 0.0, 0.0, id="dual-clip-inactive"),
    ],
)
def test_ppo_closed_form(ratio, adv, dual_clip, loss, grad, clip_frac, dual_frac):
    value, metrics, dloss = one_token(ratio, adv, kind="ppo", dual_clip=dual_clip, **CLIP)
    assert value == pytest.approx(loss, rel=1e-5)
    assert dloss == pytest.approx(grad, rel=1e-5, abs=1e-7)
    assert metrics["clip_frac"] == clip_frac
    assert metrics["dual_clip_frac"] == dual_frac
    assert metrics["ratio_mean"] == pytest.approx(ratio, rel=1e-5)
    assert metrics["approx_kl"] == pytest.approx(ratio - 1 - math.log(ratio), abs=1e-6)


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clip_frac"),
    [
        # loss = -clip(r) * A * logp, d/dlogp = -clip(r) * A: the gradient survives clipping.
        pytest.param(1.0, 2.0, 0.0, -2.0, 0.0, id="on-policy"),
        pytest.param(2.0, 1.0, -1.28 * math.log(2.0), -1.28, 1.0, id="clipped-weight-keeps-gradient"),
        pytest.param(0.5, -1.0, 0.8 * math.log(0.5), 0.8, 1.0, id="clipped-low"),
    ],
)
def test_cispo_closed_form(ratio, adv, loss, grad, clip_frac):
    value, metrics, dloss = one_token(ratio, adv, kind="cispo", **CLIP)
    assert value == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert dloss == pytest.approx(grad, rel=1e-5)
    assert metrics["clip_frac"] == clip_frac


@pytest.mark.parametrize(
    ("ratio", "adv"), [pytest.param(1.0, 2.0, id="on-policy"), pytest.param(3.0, -0.5, id="no-clipping")]
)
def test_pg_closed_form(ratio, adv):
    value, metrics, dloss = one_token(ratio, adv, kind="pg", **CLIP)
    assert value == pytest.approx(-adv * ratio, rel=1e-5)
    assert dloss == pytest.approx(-adv * ratio, rel=1e-5)
    assert metrics["clip_frac"] == 0.0


def paper_gspo(logp_BT, old_logp_BT, adv_B, mask_BT, clip_low, clip_high):
    """GSPO's objective (Zheng et al. 2025, Eq. 5), negated: the mean over sequences (G, those with a
    token) of min(s_i A_i, clip(s_i) A_i), s_i = exp(mean over y_i's tokens of the log ratio). Every
    sequence weighs the same, whatever its length."""
    terms = []
    for b in range(logp_BT.shape[0]):
        keep = mask_BT[b].bool()
        if not keep.any():
            continue
        s = torch.exp((logp_BT[b][keep] - old_logp_BT[b][keep]).mean())
        terms.append(torch.minimum(s * adv_B[b], s.clamp(1 - clip_low, 1 + clip_high) * adv_B[b]))
    return -sum(terms) / len(terms)


@pytest.mark.parametrize(
    "clip", [pytest.param(0.05, id="some-clipped"), pytest.param(10.0, id="none-clipped")]
)
def test_gspo_token_form_over_sequence_lengths_and_count_is_the_papers_objective(clip):
    """The token form carries each sequence's term on all its tokens; each token weighted by 1 / |y_i| and
    the sum divided by the number of sequences (molt's --algo.loss.agg seq-mean-token-mean, GSPO's
    default there) is GSPO's objective in value and gradient."""
    generator = torch.Generator().manual_seed(2)
    logp_BT = (-torch.rand(4, 5, generator=generator)).requires_grad_(True)
    old_logp_BT = logp_BT.detach() + 0.1 * torch.randn(4, 5, generator=generator)
    adv_B = torch.tensor([1.0, -1.0, 0.5, -2.0])
    mask_BT = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    inverse_length_BT = (1 / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)).expand(4, 5)
    loss_sum, _ = policy_loss(
        logp_BT, old_logp_BT, adv_B, mask_BT, kind="gspo", clip_low=clip, clip_high=clip,
        weights=inverse_length_BT,
    )  # fmt: skip
    loss = loss_sum / 3  # the three sequences with a token
    (grad,) = torch.autograd.grad(loss, logp_BT)
    reference = paper_gspo(logp_BT, old_logp_BT, adv_B, mask_BT, clip, clip)
    (reference_grad,) = torch.autograd.grad(reference, logp_BT)
    assert_close(loss, reference)
    assert_close(grad, reference_grad)


def random_batch(seed=3, num_seqs=4, num_tokens=6):
    generator = torch.Generator().manual_seed(seed)
    logp_BT = (-torch.rand(num_seqs, num_tokens, generator=generator) * 3).requires_grad_(True)
    old_logp_BT = (
        logp_BT.detach() + 0.3 * torch.randn(num_seqs, num_tokens, generator=generator)
    ).requires_grad_()
    adv_BT = torch.randn(num_seqs, num_tokens, generator=generator).requires_grad_(True)
    mask_BT = torch.rand(num_seqs, num_tokens, generator=generator) > 0.3
    mask_BT[-1] = False  # one fully masked row
    return logp_BT, old_logp_BT, adv_BT, mask_BT


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_reaches_logp_only_and_not_masked_tokens(kind):
    logp_BT, old_logp_BT, adv_BT, mask_BT = random_batch()
    weights_BT = torch.rand(mask_BT.shape, requires_grad=True)
    loss, metrics = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, kind=kind, weights=weights_BT, **CLIP)
    loss.backward()
    assert old_logp_BT.grad is None and adv_BT.grad is None and weights_BT.grad is None
    assert torch.all(logp_BT.grad[~mask_BT] == 0)
    assert torch.any(logp_BT.grad[mask_BT] != 0)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("kind", KINDS)
def test_padding_garbage_and_empty_rows_give_no_nan(kind):
    logp_BT, old_logp_BT, adv_BT, mask_BT = random_batch()
    with torch.no_grad():
        logp_BT[~mask_BT] = -torch.inf  # what a padded position may hold
    loss, metrics = policy_loss(logp_BT, old_logp_BT.detach(), adv_BT.detach(), mask_BT, kind=kind, **CLIP)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp_BT.grad).all()
    empty_loss, empty_metrics = policy_loss(
        logp_BT, old_logp_BT, adv_BT, torch.zeros_like(mask_BT), kind=kind, **CLIP
    )
    assert empty_loss.item() == 0.0 and all(v == 0.0 for v in empty_metrics.values())


@pytest.mark.parametrize("kind", ["ppo", "cispo", "pg"])
def test_weights_scale_each_token_loss(kind):
    logp_BT, old_logp_BT, adv_BT, mask_BT = random_batch()
    weights_BT = torch.rand(mask_BT.shape)
    weighted, _ = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, kind=kind, weights=weights_BT, **CLIP)
    for b, t in mask_BT.nonzero().tolist():
        single_mask = torch.zeros_like(mask_BT)
        single_mask[b, t] = True
        token_loss, _ = policy_loss(logp_BT, old_logp_BT, adv_BT, single_mask, kind=kind, **CLIP)
        weighted = weighted - weights_BT[b, t] * token_loss
    assert_close(weighted, torch.tensor(0.0), atol=1e-5, rtol=0)


def test_sequence_advantage_broadcasts_over_tokens():
    logp_BT, old_logp_BT, _, mask_BT = random_batch()
    adv_B = torch.randn(mask_BT.shape[0])
    per_seq, _ = policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, **CLIP)
    per_token, _ = policy_loss(logp_BT, old_logp_BT, adv_B[:, None].expand(mask_BT.shape), mask_BT, **CLIP)
    assert_close(per_seq, per_token)


def window_gradient(kind, num_micro_batches, *, local_mean=False):
    """Accumulated logits gradient of one optimizer window split into micro-batches along B; each micro-batch
    loss is (policy + 0.1 KL - 0.01 entropy) token sums over the window's trainable-token count."""
    generator = torch.Generator().manual_seed(4)
    num_seqs, num_tokens, vocab = 7, 5, 11
    logits_BTV = torch.randn(num_seqs, num_tokens, vocab, generator=generator).requires_grad_(True)
    tokens_BT = torch.randint(0, vocab, (num_seqs, num_tokens), generator=generator)
    with torch.no_grad():
        old_logp_BT = token_logprobs(
            logits_BTV + 0.2 * torch.randn(logits_BTV.shape, generator=generator), tokens_BT
        )
        ref_logp_BT = token_logprobs(
            logits_BTV + 0.2 * torch.randn(logits_BTV.shape, generator=generator), tokens_BT
        )
    mask_BT = torch.rand(num_seqs, num_tokens, generator=generator) > 0.25
    adv_B = grpo(torch.randn(num_seqs, generator=generator), torch.tensor([0, 0, 0, 1, 1, 2, 2]))
    num_window_tokens = mask_BT.sum()
    for rows in torch.arange(num_seqs).tensor_split(num_micro_batches):
        logp_BT = token_logprobs(logits_BTV[rows], tokens_BT[rows])
        loss_sum, _ = policy_loss(logp_BT, old_logp_BT[rows], adv_B[rows], mask_BT[rows], kind=kind, **CLIP)
        loss_sum = loss_sum + 0.1 * masked_sum(kl(logp_BT, ref_logp_BT[rows], kind="k3"), mask_BT[rows])
        loss_sum = loss_sum - 0.01 * masked_sum(entropy_from_logits(logits_BTV[rows]), mask_BT[rows])
        denominator = (
            mask_BT[rows].sum().clamp(min=1) * num_micro_batches if local_mean else num_window_tokens
        )
        (loss_sum / denominator).backward()
    return logits_BTV.grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_micro_batches", [2, 4])
def test_global_token_mean_makes_update_independent_of_micro_batching(kind, num_micro_batches):
    whole = window_gradient(kind, 1)
    assert_close(window_gradient(kind, num_micro_batches), whole)


def test_per_micro_batch_mean_would_change_the_update():
    # The control for the test above: normalising inside each micro-batch is not split-invariant.
    assert not torch.allclose(window_gradient("ppo", 2, local_mean=True), window_gradient("ppo", 1))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # p = 0.5 (logp), p_ref = 0.25: log_r = log(p_ref / p) = -log 2
        pytest.param("k1", math.log(2), id="k1"),
        pytest.param("k2", 0.5 * math.log(2) ** 2, id="k2"),
        pytest.param("k3", 0.5 - 1 + math.log(2), id="k3"),
    ],
)
def test_kl_closed_form_and_gradient_to_logp_only(kind, expected):
    logp_BT = torch.full((1, 1), math.log(0.5), requires_grad=True)
    ref_logp_BT = torch.full((1, 1), math.log(0.25), requires_grad=True)
    value_BT = kl(logp_BT, ref_logp_BT, kind=kind)
    assert value_BT.item() == pytest.approx(expected, rel=1e-6)
    value_BT.sum().backward()
    assert ref_logp_BT.grad is None and logp_BT.grad is not None


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_unbiased_estimators_average_to_true_kl(kind):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ref_probs = torch.tensor([0.25, 0.25, 0.25, 0.25])
    true_kl = (probs * (probs / ref_probs).log()).sum()
    samples = torch.multinomial(probs, 200_000, replacement=True, generator=torch.Generator().manual_seed(5))
    estimate = kl(probs.log()[samples][None], ref_probs.log()[samples][None], kind=kind).mean()
    assert_close(estimate, true_kl, atol=5e-3, rtol=0)


@pytest.mark.parametrize(
    ("value", "old", "ret", "loss", "grad", "clip_frac"),
    [
        pytest.param(2.0, 1.0, 0.0, 2.0, 2.0, 0.0, id="unclipped-larger"),
        pytest.param(0.0, 1.0, 3.0, 4.5, -3.0, 0.0, id="moving-away"),
        pytest.param(2.0, 1.0, 3.0, 1.125, 0.0, 1.0, id="clipped-branch-active"),
    ],
)
def test_value_loss_closed_form(value, old, ret, loss, grad, clip_frac):
    values_BT = torch.tensor([[value, 9.0]], requires_grad=True)
    old_BT = torch.tensor([[old, 0.0]], requires_grad=True)
    returns_BT = torch.tensor([[ret, 0.0]], requires_grad=True)
    mask_BT = torch.tensor([[1, 0]])
    total, metrics = value_loss(values_BT, old_BT, returns_BT, mask_BT, clip=0.5)
    total.backward()
    assert total.item() == pytest.approx(loss)
    assert_close(values_BT.grad, torch.tensor([[grad, 0.0]]))
    assert old_BT.grad is None and returns_BT.grad is None
    assert metrics["value_clip_frac"] == clip_frac
    assert metrics["value_mse"] == pytest.approx((value - ret) ** 2)


def test_masked_sum_ignores_non_finite_padding():
    values_BT = torch.tensor([[1.0, torch.nan], [2.0, torch.inf]])
    assert masked_sum(values_BT, torch.tensor([[1, 0], [1, 0]])).item() == 3.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda: policy_loss(
                torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), **CLIP
            ),
            "must match",
            id="shape",
        ),
        pytest.param(
            lambda: policy_loss(
                torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.ones(0, 3), **CLIP
            ),
            "empty batch",
            id="empty",
        ),
        pytest.param(
            lambda: policy_loss(
                torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), **CLIP
            ),
            "advantages",
            id="adv-shape",
        ),
        pytest.param(
            lambda: policy_loss(
                torch.zeros(2, 3),
                torch.zeros(2, 3),
                torch.zeros(2),
                torch.ones(2, 3),
                kind="cispo",
                dual_clip=3.0,
                **CLIP,
            ),
            "dual_clip",
            id="dual-clip-cispo",
        ),
        pytest.param(
            lambda: policy_loss(
                torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), dual_clip=1.0, **CLIP
            ),
            "dual_clip",
            id="dual-clip-le-1",
        ),
        pytest.param(
            lambda: policy_loss(
                torch.zeros(2, 3),
                torch.zeros(2, 3),
                torch.zeros(2),
                torch.ones(2, 3),
                clip_low=-0.1,
                clip_high=0.2,
            ),
            "clip_low",
            id="negative-clip",
        ),
        pytest.param(
            lambda: kl(torch.zeros(2, 3), torch.zeros(3, 2), kind="k2"), "must match", id="kl-shape"
        ),
        pytest.param(
            lambda: value_loss(
                torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), clip=0.0
            ),
            "clip",
            id="value-clip",
        ),
        pytest.param(lambda: masked_sum(torch.zeros(2, 3), torch.ones(2)), r"\[B, T\]", id="masked-sum-mask"),
    ],
)
def test_losses_refuse_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-mask-tis", "none"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_losses_and_the_correction_read_no_value_back(kind, mode):
    """On a GPU each value read back (a Python float, `.item()`, `.tolist()`) is a device synchronisation
    in the middle of a micro-batch. Meta tensors hold no values, so any read raises: the loss, its
    gradient and every metric are computed without one, and the metrics stay 0-dim tensors."""
    gen = torch.Generator().manual_seed(0)
    mask_BT = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.float32).to("meta")
    old_BT, rollout_BT, ref_BT, returns_BT = (-torch.rand(3, 4, generator=gen).to("meta") for _ in range(4))
    logp_BT = (-torch.rand(3, 4, generator=gen)).to("meta").requires_grad_()
    weights_BT, _, corr = rollout_correction(old_BT, rollout_BT, mask_BT, mode=mode)
    loss, metrics = policy_loss(
        logp_BT,
        old_BT,
        torch.ones(3).to("meta"),
        mask_BT,
        kind=kind,
        **CLIP,
        dual_clip=3.0 if kind in ("ppo", "gspo") else None,
        weights=weights_BT,
    )
    loss = loss + masked_sum(kl(logp_BT, ref_BT, kind="k3"), mask_BT)
    value_sum, value_metrics = value_loss(logp_BT, old_BT, returns_BT, mask_BT, clip=0.2)
    (loss + value_sum).backward()
    assert logp_BT.grad is not None and logp_BT.grad.shape == (3, 4)
    for name, value in {**corr, **metrics, **value_metrics}.items():
        assert isinstance(value, torch.Tensor) and value.shape == () and value.is_meta, name
