"""The policy's objective for one micro-batch, as one pure function of tensors: `step_loss`.

    loss = sum_t  c_t * (w_t * surrogate_t  -  entropy_coef * H_t  +  kl.coef * KL_t)  /  D

over the micro-batch's trainable tokens t, where w is the rollout correction's weight of the engine-vs-
trainer mismatch (`rlestimators.rollout_correction`, DESIGN invariant 2), the surrogate is
`--algo.loss.kind`'s (`rlestimators.policy_loss`), H the entropy of the distribution each token was
sampled from and KL the estimator against the reference policy (`rlestimators.kl`, `--algo.kl.kind`: k2's
expected gradient is that of KL(pi || ref), k3's that of KL(ref || pi); k1's is 0, and validation refuses
it here). `train/kl` is the mean of the estimator's value, an estimate of KL(pi || ref) whichever kind
trains (k2's biased at third order in the log-ratio).

`--algo.loss.agg` sets the token weight c and the ONE denominator D of DESIGN §6 (paper §3.6), counted
over the whole optimizer step, on all ranks and in all micro-batches (verl's names):

- `token-mean`: c = 1, D = the step's trainable tokens. Every token weighs the same, so a long reply
  weighs more than a short one in proportion to its length.
- `seq-mean-token-mean`: c = 1 / (the row's trainable tokens), D = the step's sequences. Each sequence's
  token mean, sequences weighing the same: GSPO's objective (Zheng et al. 2025, Eq. 5).
- `seq-mean-token-sum-norm`: c = 1, D = the step's sequences x `--algo.loss.agg_constant`. Each
  sequence's token sum over a constant, averaged over sequences: Dr. GRPO's (Liu et al. 2025, §3.2).

A sequence is one training row. A compacted rollout has several; each is a separate context the policy
scored, GSPO's sequence ratio is taken per row (`rlestimators.policy_loss`), and c needs nothing beyond
the row, so a micro-batch or rank holding some of a rollout's rows computes its share alone. c is local to
a row and D global to the step, so the micro-batches' losses summed over ranks are the step's loss and the
update does not depend on how the step is split or packed.

It lives in molt, not rlestimators, because it fixes what rlestimators refuses to: the denominator, the
terms molt's config turns on, and the numerators of molt's `train/*` metrics. The policy worker
(`molt._actor.PolicyWorker`) computes the logprobs and entropies, calls it and runs the backward.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import torch

from molt._config_algo import loss_agg
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
    num_seqs: int,
    algo: Algo,
    ref_logp_BT: torch.Tensor | None = None,
    lag_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step's loss (module docstring), and its metric numerators.

    `logp_BT`: the policy's logprob of each token (with gradient); `entropy_BT`: its entropy, with gradient
    only where `algo.entropy_coef` trains it. `old_logp_BT`: the logprobs the surrogate's ratio is taken
    against; None: `logp_BT` itself, detached (a batch that is one optimizer step, where they are the same
    numbers). `rollout_logp_BT`: the engine's. `ref_logp_BT`: the reference policy's; given, it adds the KL
    term. `num_tokens`, `num_seqs`: the step's trainable tokens and sequences (the denominator's counts).
    The numerators are sums over the micro-batch (token sums; `rows_rejected` and `rows`, the sequences of
    the correction's mask and all sequences with a trainable token); divided by the step's token count they
    are the `train/*` metrics, `train/policy_loss` the policy term as `--algo.loss.agg` weighs it. `lag_BT`
    (None: all 0): how many versions older than the old logprobs' weights the engine's were on each token;
    `train/mismatch_kl` sums the k3 estimate of KL(rollout || old) over lag-0 tokens only, where engine and
    trainer held the same weights (the engine-vs-trainer mismatch alone), `train/staleness_kl` over the
    others (mismatch plus policy lag), each with its token count (`lag0_tokens`, `lagged_tokens`) as its
    own denominator.
    """
    scale_BT, denominator = _aggregation(mask_BT, algo, num_tokens=num_tokens, num_seqs=num_seqs)
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
        weights=weights_BT * scale_BT,
    )
    entropy_sum = masked_sum(entropy_BT, mask_BT)
    total = pg_sum - algo.entropy_coef * masked_sum(entropy_BT * scale_BT, mask_BT)
    num_trainable = (mask_BT != 0).sum()
    has_tokens_B = (mask_BT != 0).any(dim=1)  # shard padding rows are not sequences
    sums = {
        "train/policy_loss": pg_sum.detach() * num_tokens / denominator,  # / num_tokens: as trained
        "train/entropy": entropy_sum.detach(),
        "train/clip_frac": pg_metrics["clip_frac"] * num_trainable,
        **_mismatch_sums(old_logp_BT, rollout_logp_BT, mask_BT, lag_BT),
        "train/correction_weight_mean": masked_sum(weights_BT, mask_BT),
        "train/correction_weight_dev": masked_sum((weights_BT - 1).abs(), mask_BT),  # 0: all weigh 1
        "rows_rejected": (has_tokens_B & ~keep_B).sum(),
        "rows": has_tokens_B.sum(),
    }
    if ref_logp_BT is not None:  # the KL loss term against a reference policy (--algo.kl.coef)
        kl_BT = kl(logp_BT, ref_logp_BT, kind=algo.kl.kind)
        total = total + algo.kl.coef * masked_sum(kl_BT * scale_BT, mask_BT)
        sums["train/kl"] = masked_sum(kl_BT, mask_BT).detach()
    return total / denominator, sums


def _aggregation(mask_BT: torch.Tensor, algo: Algo, *, num_tokens: int, num_seqs: int):
    """`--algo.loss.agg`'s token weight c [B, T] and the step's denominator D (module docstring)."""
    agg, ones_BT = loss_agg(algo), torch.ones(mask_BT.shape, device=mask_BT.device)
    if agg == "token-mean":
        return ones_BT, num_tokens
    if agg == "seq-mean-token-mean":
        row_tokens_B1 = (mask_BT != 0).sum(dim=1, keepdim=True).clamp(min=1)
        return ones_BT / row_tokens_B1, num_seqs
    assert algo.loss.agg_constant > 0, "validation fills --algo.loss.agg_constant"
    return ones_BT, num_seqs * algo.loss.agg_constant


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
