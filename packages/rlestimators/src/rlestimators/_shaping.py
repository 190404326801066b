"""Batch shaping and evaluation: DAPO's dynamic filter and the unbiased pass@k estimator.

Legend: B samples, G distinct groups in the batch.
"""

from typing import overload

import torch

from rlestimators._checks import check_groups


def dynamic_filter(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Keep flag per sample [B] (bool): False for every member of a group whose rewards are all equal.

    DAPO's dynamic sampling (Yu et al. 2025, §3.2): such a group has zero advantage under any group baseline
    and so adds no gradient, only noise in the token count. A group of size 1 is all-equal and is dropped.
    Group ids are arbitrary integers in any order.
    """
    check_groups(rewards, group_ids)
    _, inverse_B, count_G = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards_B = rewards.detach()
    num_groups = count_G.numel()
    max_G = rewards_B.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse_B, rewards_B, "amax")
    min_G = rewards_B.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse_B, rewards_B, "amin")
    return (max_G > min_G)[inverse_B]


@overload
def pass_at_k(n: int, c: int, k: int) -> float: ...
@overload
def pass_at_k(n: int, c: torch.Tensor, k: int) -> torch.Tensor: ...
def pass_at_k(n: int, c: int | torch.Tensor, k: int) -> float | torch.Tensor:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, Codex, Eq. 1):
    1 - C(n - c, k) / C(n, k), in the paper's numerically stable product form
    1 - prod_{i = n-c+1}^{n} (1 - k / i); it is exactly 1 when n - c < k.

    `n` and `k` are ints with 1 <= k <= n (the same n for every problem). `c` is an int (returns a float) or
    an integer tensor of per-problem correct counts (returns a float64 tensor of its shape; average it over
    problems for the benchmark's pass@k).
    """
    if not (isinstance(n, int) and isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"need ints with 1 <= k <= n, got n={n!r}, k={k!r}")
    correct = torch.as_tensor(c)
    if correct.is_floating_point() or correct.dtype == torch.bool:
        raise ValueError(f"c must be an int or an integer tensor of correct counts, got {correct.dtype}")
    if bool(((correct < 0) | (correct > n)).any()):
        raise ValueError(f"correct counts must lie in [0, n={n}], got {c!r}")
    # fail_prob_J[j] = prod_{i=j+1}^{n} (1 - k/i) = C(j, k) / C(n, k): the chance that k draws without
    # replacement miss all n - j correct samples. fail_prob_J[n] = 1 (empty product); for j < k the product
    # holds the factor i = k, so it is exactly 0.
    factors = 1.0 - k / torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)
    fail_prob_J = torch.cat([factors.flip(0).cumprod(0).flip(0), factors.new_ones(1)])
    pass_prob = 1.0 - fail_prob_J[n - correct.long()]
    return pass_prob.item() if isinstance(c, int) else pass_prob
