"""Rollout correction: importance weights for the mismatch between the engine's and the trainer's logprobs.

The engine samples with its own kernels (and, under asynchrony, an older policy version), so the trainer's
recomputed `old_logp` differs from the engine's `rollout_logp` (Yao et al. 2025; Liu et al. 2025, "When Speed
Kills Stability"). This module turns the per-token ratio into detached weights
and a per-sequence keep flag, and always measures the mismatch, whatever the mode (DESIGN §1, invariant 3).
It refuses to decide the loss denominator: rejected sequences weigh 0, and the trainer keeps dividing by
the window's trainable-token count.

Legend: B sequences, T tokens.
"""

from typing import Literal, get_args

import torch

from rlestimators._checks import check_bt, check_choice
from rlestimators._losses import masked_means, seq_ratios

CorrectionMode = Literal["tis", "mis", "seq-mask-tis", "none"]


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: CorrectionMode = "tis",
    token_cap: float = 2.0,
    token_bounds: tuple[float, float] = (0.5, 2.0),
    seq_bounds: tuple[float, float] = (0.99, 1.01),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights [B, T], per-sequence keep [B] (bool) and metrics (0-dim tensors, nothing read
    back: `masked_means`), with ratio = exp(old_logp - rollout_logp) per trainable token (the trainer's
    policy over the engine's):

    - `tis`: truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
      You Off-Policy RL Training"): weight = min(ratio, token_cap).
    - `mis`: masked importance sampling (Liu et al. 2025, "When Speed Kills Stability"): weight = ratio where
      it lies in `token_bounds` (inclusive), else 0.
    - `seq-mask-tis`: a sequence is kept only if the geometric mean of its token ratios (exp of the masked
      mean log-ratio) lies in `seq_bounds` (inclusive); kept tokens weigh min(ratio, token_cap), tokens of a
      rejected sequence weigh 0.
    - `none`: weights 1, all kept.

    Weights carry no gradient and already include `keep` (pass them as `policy_loss(weights=...)`); `keep`
    is returned for logging and for callers that drop sequences. Tokens outside the mask weigh 1 (neutral:
    the mask removes them). A sequence with no trainable token is kept.

    Metrics: `mismatch_kl` (mean over trainable tokens of the k3 estimate of KL(rollout || old), on samples
    from the engine), `seq_masked_frac` (fraction of the B sequences not kept), `token_masked_frac`
    (trainable tokens whose weight is 0), `token_capped_frac` (trainable tokens whose ratio exceeds
    `token_cap` under tis and seq-mask-tis, those of a rejected sequence, which weigh 0, included).
    """
    check_bt("mask", mask, old_logp=old_logp, rollout_logp=rollout_logp)
    check_choice("rollout correction mode", mode, get_args(CorrectionMode))
    if not token_cap > 0:
        raise ValueError(f"token_cap must be > 0, got {token_cap}")
    for name, bounds in (("token_bounds", token_bounds), ("seq_bounds", seq_bounds)):
        if not 0.0 <= bounds[0] <= bounds[1]:
            raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {bounds}")

    trainable_BT = mask != 0
    log_ratio_BT = torch.where(trainable_BT, old_logp.detach().float() - rollout_logp.detach().float(), 0.0)
    ratio_BT = log_ratio_BT.exp()
    keep_B = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    capped_BT = torch.zeros_like(trainable_BT)

    if mode == "none":
        weights_BT = torch.ones_like(ratio_BT)
    elif mode == "mis":
        low, high = token_bounds
        weights_BT = torch.where((ratio_BT >= low) & (ratio_BT <= high), ratio_BT, 0.0)
    else:  # "tis" and "seq-mask-tis"
        capped_BT = ratio_BT > token_cap
        weights_BT = ratio_BT.clamp(max=token_cap)
        if mode == "seq-mask-tis":
            seq_ratio_B = seq_ratios(log_ratio_BT, trainable_BT)
            keep_B = (seq_ratio_B >= seq_bounds[0]) & (seq_ratio_B <= seq_bounds[1])
            # A sequence without trainable tokens has nothing to correct: keep it (its ratio is exactly 1).
            keep_B |= ~trainable_BT.any(dim=-1)
            weights_BT = torch.where(keep_B[:, None], weights_BT, 0.0)
    weights_BT = torch.where(trainable_BT, weights_BT, 1.0)  # neutral where the mask removes the token

    metrics = masked_means(
        trainable_BT,
        # k3 with r = p_old / p_rollout on rollout samples: (r - 1) - log r, an unbiased KL(rollout || old).
        mismatch_kl=torch.expm1(log_ratio_BT) - log_ratio_BT,
        token_masked_frac=weights_BT == 0,
        token_capped_frac=capped_BT,
    )
    metrics["seq_masked_frac"] = 1.0 - keep_B.float().mean()
    return weights_BT, keep_B, metrics
