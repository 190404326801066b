"""An all-equal group gets advantage 0, exactly, under every outcome estimator (DESIGN §3).

The rewards here are not exactly representable in binary (0.7, 0.1, 1/3), so a float group mean is off by
rounding; a std-normalised estimator that divides that rounding by a rounding-sized std turns it into
advantages of order 0.05. The reference works in exact rational arithmetic on the very floats the
estimator sees (`Fraction` of each stored value), so "exact formula value" means the formula in real
numbers, rounded once at the end.
"""

import math
from fractions import Fraction

import pytest
import torch
from torch.testing import assert_close

from rlestimators import ESTIMATORS

VALUES = [0.7, 0.1, 1 / 3]
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float64, id="float64")]


def exact_advantage(name: str, rewards: list[float], groups: list[int]) -> list[float]:
    """DESIGN §3's table in exact rationals; only square roots and the final value are rounded."""
    members = {g: [Fraction(r) for r, h in zip(rewards, groups, strict=True) if h == g] for g in groups}
    mean = {g: sum(m) / len(m) for g, m in members.items()}
    centered = [Fraction(r) - mean[g] for r, g in zip(rewards, groups, strict=True)]
    out = []
    for c, g in zip(centered, groups, strict=True):
        n = len(members[g])
        if name in ("reinforce", "dr_grpo", "reinforce_pp"):
            out.append(float(c))
        elif name == "rloo":
            out.append(0.0 if n == 1 else float(c * n / (n - 1)))
        elif name == "maxrl":
            out.append(float(c / mean[g]) if mean[g] > 0 else 0.0)
        else:  # grpo
            variance = sum((m - mean[g]) ** 2 for m in members[g]) / (n - 1) if n > 1 else Fraction(0)
            out.append(float(c) / (math.sqrt(variance) + 1e-6))
    if name == "reinforce_pp":
        std = math.sqrt(sum(c * c for c in centered) / max(len(centered) - 1, 1))
        out = [a / (std + 1e-6) for a in out]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [2, 3, 7, 16])
@pytest.mark.parametrize("value", VALUES, ids=["0.7", "0.1", "1/3"])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_an_all_equal_group_gets_exactly_zero(name, value, size, dtype):
    adv_B = ESTIMATORS[name](torch.full((size,), value, dtype=dtype), torch.full((size,), 5))
    assert torch.equal(adv_B, torch.zeros(size, dtype=dtype)), adv_B.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_equal_groups_in_a_mixed_batch_get_zero_and_varied_ones_their_formula(name, dtype):
    # Equal groups of 0.7 x 7, 1/3 x 5, 0.1 x 2; varied groups beside them, one nearly equal
    # (three 0.7 and one 0.1), one at a large offset (where a plain float mean loses digits).
    equal = [([0.7] * 7, 11), ([1 / 3] * 5, -2), ([0.1] * 2, 40)]
    varied = [([0.7, 0.7, 0.7, 0.1], 3), ([0.1, 1 / 3, 0.7], 8), ([1000.7, 1000.1, 1000.7], 6)]
    parts = equal[:1] + varied[:1] + equal[1:2] + varied[1:] + equal[2:]  # interleaved on purpose
    rewards_B = torch.tensor([r for rewards, _ in parts for r in rewards], dtype=dtype)
    groups_B = torch.tensor([g for rewards, g in parts for _ in rewards])
    is_equal_B = torch.isin(groups_B, torch.tensor([g for _, g in equal]))

    adv_B = ESTIMATORS[name](rewards_B, groups_B)

    assert torch.equal(adv_B[is_equal_B], torch.zeros(int(is_equal_B.sum()), dtype=dtype))
    expected = exact_advantage(name, rewards_B.tolist(), groups_B.tolist())
    expected_B = torch.tensor(expected, dtype=torch.float64)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    assert_close(adv_B[~is_equal_B].double(), expected_B[~is_equal_B], **tolerance)
