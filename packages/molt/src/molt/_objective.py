"""The policy's objective for one micro-batch, as one pure function of tensors: `step_loss`.

    loss = (sum_t  w_t * surrogate_t  -  entropy_coef * sum_t H_t  +  kl.coef * sum_t KL_t) / num_tokens

over the micro-batch's trainable tokens t, where w is the rollout correction's weight of the engine-vs-
trainer mismatch (`rlestimators.rollout_correction`, DESIGN invariant 2), the surrogate is
`--algo.loss.kind`'s (`rlestimators.policy_loss`), H the entropy of the distribution each token was
sampled from and KL the estimator against the reference policy (`rlestimators.kl`, `--algo.kl.kind`: k2's
expected gradient is that of KL(pi || ref), k3's that of KL(ref || pi); k1's is 0, and validation refuses
it here). `train/kl` is the mean of the estimator's value, an estimate of KL(pi || ref) whichever kind
trains (k2's biased at third order in the log-ratio). `num_tokens` is the ONE denominator of DESIGN §6
(paper §3.6): the trainable tokens of the whole optimizer step, on all ranks and in all micro-batches.
The micro-batches' losses summed over ranks are the step's global token mean, so the update does not
depend on how the step is split.

It lives in molt, not rlestimators, because it fixes what rlestimators refuses to: the denominator, the
terms molt's config turns on, and the numerators of molt's `train/*` metrics. The policy worker
(`molt._actor.PolicyWorker`) computes the logprobs and entropies, calls it and runs the backward.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import torch

from molt.config import Algo
from rlestimators import kl, masked_sum, policy_loss, rollout_correction

__all__ = ["step_loss"]


def step_loss(
    logp_BT: torch.Tensor,
    entropy_BT: torch.Tensor,
    old_logp_BT: torch.Tensor | None,
    rollout_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    num_tokens: int,
    algo: Algo,
    ref_logp_BT: torch.Tensor | None = None,
    lag_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step's loss (module docstring), and its metric numerators.

    `logp_BT`: the policy's logprob of each token (with gradient); `entropy_BT`: its entropy, with gradient
    only where `algo.entropy_coef` trains it. `old_logp_BT`: the logprobs the surrogate's ratio is taken
    against; None: `logp_BT` itself, detached (a batch that is one optimizer step, where they are the same
    numbers). `rollout_logp_BT`: the engine's. `ref_logp_BT`: the reference policy's; given, it adds the KL
    term. The numerators are sums over the micro-batch (token sums; `rows_rejected` and `rows`, the
    sequences of the correction's mask and all sequences with a trainable token); divided by the step's
    token count they are the `train/*` metrics. `lag_BT` (None: all 0): how many versions older than the
    old logprobs' weights the engine's were on each token; `train/mismatch_kl` sums the k3 estimate of
    KL(rollout || old) over lag-0 tokens only, where engine and trainer held the same weights (the
    engine-vs-trainer mismatch alone), `train/staleness_kl` over the others (mismatch plus policy lag),
    each with its token count (`lag0_tokens`, `lagged_tokens`) as its own denominator.
    """
    old_logp_BT = logp_BT.detach() if old_logp_BT is None else old_logp_BT
    correction = algo.correction
    weights_BT, keep_B, _ = rollout_correction(
        old_logp_BT,
        rollout_logp_BT,
        mask_BT,
        mode=correction.mode,
        token_cap=correction.token_cap,
        token_bounds=correction.token_bounds,
        seq_bounds=correction.seq_bounds,
    )
    loss = algo.loss
    pg_sum, pg_metrics = policy_loss(
        logp_BT,
        old_logp_BT,
        advantages_BT,
        mask_BT,
        kind=loss.kind,
        clip_low=loss.clip_low,
        clip_high=loss.clip_high,
        dual_clip=loss.dual_clip,
        weights=weights_BT,
    )
    entropy_sum = masked_sum(entropy_BT, mask_BT)
    total = pg_sum - algo.entropy_coef * entropy_sum
    num_trainable = (mask_BT != 0).sum()
    has_tokens_B = (mask_BT != 0).any(dim=1)  # shard padding rows are not sequences
    sums = {
        "train/policy_loss": pg_sum.detach(),
        "train/entropy": entropy_sum.detach(),
        "train/clip_frac": pg_metrics["clip_frac"] * num_trainable,
        **_mismatch_sums(old_logp_BT, rollout_logp_BT, mask_BT, lag_BT),
        "train/correction_weight_mean": masked_sum(weights_BT, mask_BT),
        "train/correction_weight_dev": masked_sum((weights_BT - 1).abs(), mask_BT),  # 0: all weigh 1
        "rows_rejected": (has_tokens_B & ~keep_B).sum(),
        "rows": has_tokens_B.sum(),
    }
    if ref_logp_BT is not None:  # the KL loss term against a reference policy (--algo.kl.coef)
        kl_sum = masked_sum(kl(logp_BT, ref_logp_BT, kind=algo.kl.kind), mask_BT)
        total = total + algo.kl.coef * kl_sum
        sums["train/kl"] = kl_sum.detach()
    return total / num_tokens, sums


def _mismatch_sums(old_logp_BT, rollout_logp_BT, mask_BT, lag_BT) -> dict[str, torch.Tensor]:
    """k3 of KL(rollout || old) (`rlestimators.rollout_correction`'s `mismatch_kl`, per token) summed over
    the lag-0 and the lagged trainable tokens, and their counts."""
    trainable_BT = mask_BT != 0
    log_ratio_BT = (old_logp_BT.detach() - rollout_logp_BT) * trainable_BT
    k3_BT = torch.expm1(log_ratio_BT) - log_ratio_BT
    lagged_BT = trainable_BT & (lag_BT != 0) if lag_BT is not None else torch.zeros_like(trainable_BT)
    lag0_BT = trainable_BT & ~lagged_BT
    return {
        "train/mismatch_kl": (k3_BT * lag0_BT).sum(),
        "train/staleness_kl": (k3_BT * lagged_BT).sum(),
        "lag0_tokens": lag0_BT.sum(),
        "lagged_tokens": lagged_BT.sum(),
    }
