"""dynamic_filter and pass_at_k against closed forms and exact binomials."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlestimators import dynamic_filter, pass_at_k


@pytest.mark.parametrize(
    ("rewards", "groups", "keep"),
    [
        pytest.param(
            [1.0, 0.0, 1.0, 1.0], [5, 5, -2, -2], [True, True, False, False], id="one-group-all-equal"
        ),
        pytest.param([0.0, 0.0, 0.0], [1, 1, 1], [False, False, False], id="all-zero"),
        pytest.param([0.3, 0.5, 0.3], [9, 4, 9], [False, False, False], id="singleton-and-equal-pair"),
        pytest.param([0.1, 0.2, 0.3, 0.1], [0, 1, 0, 1], [True, True, True, True], id="interleaved-groups"),
    ],
)
def test_dynamic_filter_drops_groups_with_equal_rewards(rewards, groups, keep):
    keep_B = dynamic_filter(torch.tensor(rewards), torch.tensor(groups))
    assert keep_B.dtype == torch.bool and keep_B.tolist() == keep


def test_dynamic_filter_refuses_mismatched_input():
    with pytest.raises(ValueError, match="one group id per reward"):
        dynamic_filter(torch.zeros(3), torch.zeros(2, dtype=torch.int64))


def exact_pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_exact_binomial_everywhere():
    for n in range(1, 13):
        for k in range(1, n + 1):
            for c in range(n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        pytest.param(10, 0, 1, 0.0, id="none-correct"),
        pytest.param(10, 10, 5, 1.0, id="all-correct"),
        pytest.param(10, 3, 1, 0.3, id="pass@1-is-c-over-n"),
        pytest.param(10, 3, 8, 1.0, id="n-minus-c-below-k"),
        pytest.param(2000, 1, 1000, 0.5, id="large-n-stable"),
    ],
)
def test_pass_at_k_closed_form(n, c, k, expected):
    value = pass_at_k(n, c, k)
    assert isinstance(value, float)
    assert value == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_accepts_a_tensor_of_correct_counts():
    counts = torch.tensor([[0, 1], [5, 16]])
    expected = torch.tensor(
        [[exact_pass_at_k(16, c, 4) for c in row] for row in counts.tolist()], dtype=torch.float64
    )
    assert_close(pass_at_k(16, counts, 4), expected)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        pytest.param(4, 1, 5, "1 <= k <= n", id="k-above-n"),
        pytest.param(4, 1, 0, "1 <= k <= n", id="k-zero"),
        pytest.param(4.0, 1, 1, "1 <= k <= n", id="float-n"),
        pytest.param(4, 5, 1, r"\[0, n=4\]", id="c-above-n"),
        pytest.param(4, torch.tensor([0.5]), 1, "integer", id="float-counts"),
    ],
)
def test_pass_at_k_refuses_bad_input(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)
