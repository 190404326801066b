"""rollout_correction: each mode against its closed form, the mismatch metrics, detached weights, masking."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlestimators import rollout_correction

# Sequence 0 has token ratios 0.4, 1, 1.5, 3 (geometric mean 1.8 ** 0.25 ~ 1.158, rejected by (0.99, 1.01));
# sequence 1 has 1, 1.005 and one padded token (geometric mean ~ 1.0025, kept); sequence 2 is all padding.
RATIOS = [[0.4, 1.0, 1.5, 3.0], [1.0, 1.005, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]


def correction(mode, **kwargs):
    rollout_logp_BT = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    old_logp_BT = rollout_logp_BT + torch.tensor(RATIOS).log()
    return rollout_correction(old_logp_BT, rollout_logp_BT, torch.tensor(MASK), mode=mode, **kwargs)


@pytest.mark.parametrize(
    ("mode", "weights", "keep", "token_masked_frac", "token_capped_frac"),
    [
        pytest.param("tis", [[0.4, 1, 1.5, 2], [1, 1.005, 1, 1], [1] * 4], [1, 1, 1], 0.0, 1 / 6, id="tis"),
        pytest.param("mis", [[0, 1, 1.5, 0], [1, 1.005, 1, 1], [1] * 4], [1, 1, 1], 2 / 6, 0.0, id="mis"),
        pytest.param(
            "seq-mask-tis", [[0] * 4, [1, 1.005, 1, 1], [1] * 4], [0, 1, 1], 4 / 6, 1 / 6, id="seq-mask-tis"
        ),
        pytest.param("none", [[1] * 4] * 3, [1, 1, 1], 0.0, 0.0, id="none"),
    ],
)
def test_mode_closed_form(mode, weights, keep, token_masked_frac, token_capped_frac):
    weights_BT, keep_B, metrics = correction(mode)
    assert_close(weights_BT, torch.tensor(weights, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert keep_B.dtype == torch.bool and keep_B.tolist() == [bool(k) for k in keep]
    assert metrics["seq_masked_frac"] == pytest.approx(keep.count(0) / 3)
    assert metrics["token_masked_frac"] == pytest.approx(token_masked_frac)
    assert metrics["token_capped_frac"] == pytest.approx(token_capped_frac)


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-mask-tis", "none"])
def test_mismatch_kl_is_k3_mean_over_trainable_tokens_in_every_mode(mode):
    _, _, metrics = correction(mode)
    trainable = [
        r for row, m in zip(RATIOS, MASK, strict=True) for r, keep in zip(row, m, strict=True) if keep
    ]
    expected = sum(r - 1 - math.log(r) for r in trainable) / len(trainable)
    assert metrics["mismatch_kl"] == pytest.approx(expected, rel=1e-5)


def test_bounds_are_inclusive_and_configurable():
    weights_BT, _, _ = correction("mis", token_bounds=(1.0, 1.0))
    assert weights_BT[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # a ratio of exactly 1 lies in [1, 1]
    _, keep_B, _ = correction("seq-mask-tis", seq_bounds=(0.5, 2.0))
    assert keep_B.all()


def test_weights_are_detached_and_agree_with_no_mismatch():
    logp_BT = torch.randn(2, 3, requires_grad=True)
    weights_BT, keep_B, metrics = rollout_correction(logp_BT, logp_BT, torch.ones(2, 3), mode="seq-mask-tis")
    assert not weights_BT.requires_grad
    assert_close(weights_BT, torch.ones(2, 3))
    assert keep_B.all() and metrics["mismatch_kl"] == 0.0


def test_fully_masked_batch_gives_finite_metrics():
    weights_BT, keep_B, metrics = rollout_correction(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert keep_B.all() and torch.isfinite(weights_BT).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"mode": "ratio"}, "choose one of", id="mode"),
        pytest.param({"token_cap": 0.0}, "token_cap", id="cap"),
        pytest.param({"token_bounds": (2.0, 0.5)}, "token_bounds", id="token-bounds"),
        pytest.param({"seq_bounds": (-1.0, 1.0)}, "seq_bounds", id="seq-bounds"),
    ],
)
def test_refuses_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


@pytest.mark.parametrize(
    ("old", "rollout", "mask", "message"),
    [
        pytest.param(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), "must match", id="shape"),
        pytest.param(torch.zeros(0, 3), torch.zeros(0, 3), torch.ones(0, 3), "empty batch", id="empty"),
    ],
)
def test_refuses_bad_shapes(old, rollout, mask, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction(old, rollout, mask)


@pytest.mark.parametrize(
    ("mode", "kwargs"),
    [
        pytest.param("mis", {"token_bounds": (1.5, 2.0)}, id="mis-bounds-without-1"),
        pytest.param("seq-mask-tis", {}, id="seq-mask-tis-rejected-row"),
    ],
)
def test_tokens_outside_the_mask_weigh_1_in_every_mode(mode, kwargs):
    # a rejected row (ratio 3 on both trainable tokens) and a bound that excludes a ratio of 1 leave
    # the prompt and padding tokens, which the mask removes, at the neutral weight
    old_logp_BT = torch.tensor([[0.0, math.log(3.0), math.log(3.0), 0.0]])
    mask_BT = torch.tensor([[0, 1, 1, 0]])
    weights_BT, _, _ = rollout_correction(old_logp_BT, torch.zeros(1, 4), mask_BT, mode=mode, **kwargs)
    assert weights_BT[0, [0, 3]].tolist() == [1.0, 1.0]
