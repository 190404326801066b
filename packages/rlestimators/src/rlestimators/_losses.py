"""Policy, KL and value losses. Every loss returns a *sum* over trainable tokens, never a mean.

Why sums: the trainer divides every term (policy, KL, entropy) by one denominator counted over the whole
optimizer-step window, summed over micro-batches and data-parallel ranks (DESIGN §6): its trainable tokens,
its sequences, or its sequences times a constant. Summing here and dividing once there makes the update
independent of how the window is split. This module refuses any per-micro-batch normalisation for that
reason; a per-sequence weight (GSPO's 1 / |y_i|) is the caller's, through `policy_loss`'s `weights`, and
sequence-level objectives (GSPO) are spread over their tokens so that the same denominators apply.

Gradients reach `logp` (and `values`) only: `old_logp`, `ref_logp`, advantages, returns and correction
weights are detached here. Tokens outside the mask contribute nothing, not even NaN.

Legend: B sequences, T tokens.
"""

from typing import Literal, get_args

import torch

from rlestimators._checks import check_bt, check_choice, check_floating

PolicyLossKind = Literal["ppo", "gspo", "cispo", "pg"]
KLKind = Literal["k1", "k2", "k3"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values[B, T]` over trainable tokens (`mask != 0`): the numerator of the global token mean.

    Use it for the KL and entropy terms; divide it, like `policy_loss`'s sum, by the window's trainable-token
    count. `torch.where` (not a product) keeps a non-finite value on a padded token out of the sum.
    """
    check_bt("mask", mask, floating=False, values=values)
    return torch.where(mask != 0, values, 0.0).sum()


def masked_means(trainable_BT: torch.Tensor, **values_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over trainable tokens, each a detached 0-dim float32 tensor on the inputs' device.

    Nothing is read back: on a GPU a Python float is a device synchronisation, and a loss that made one per
    micro-batch would leave the GPU idle while the host queues the backward. `float()` a metric where it
    is logged. A call with no trainable token reports 0.0 rather than NaN.
    """
    num_trainable = trainable_BT.sum().clamp(min=1)
    sums = [torch.where(trainable_BT, v.detach().float(), 0.0).sum() for v in values_BT.values()]
    return dict(zip(values_BT, (torch.stack(sums) / num_trainable).unbind(), strict=True))


def seq_ratios(log_ratio_BT: torch.Tensor, trainable_BT: torch.Tensor) -> torch.Tensor:
    """Each sequence's ratio [B]: exp of the mean log ratio over its trainable tokens (the geometric mean of
    their ratios; exactly 1 for a sequence without any). GSPO's s_i and the seq-mask-tis correction's test."""
    return (log_ratio_BT.sum(dim=-1) / trainable_BT.sum(dim=-1).clamp(min=1)).exp()


def _clipped_surrogate(ratio_BT, adv_BT, clip_low: float, clip_high: float, dual_clip: float | None):
    """PPO's clipped surrogate (Schulman et al. 2017, Eq. 7) as a per-token loss, optionally dual-clipped
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games", dual-clip PPO): for A < 0 the loss is capped
    at dual_clip * |A|, so a huge ratio on a bad action cannot blow up the update.

    Returns the loss, where the clipped branch is active (its gradient is 0), and where the dual cap is.
    """
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    is_clipped_BT = clipped_BT > unclipped_BT
    if dual_clip is None:
        return loss_BT, is_clipped_BT, torch.zeros_like(is_clipped_BT)
    cap_BT = -dual_clip * adv_BT
    is_capped_BT = (adv_BT < 0) & (loss_BT > cap_BT)
    return torch.where(is_capped_BT, cap_BT, loss_BT), is_clipped_BT, is_capped_BT


def _gspo_ratio(logp_BT, log_ratio_BT, trainable_BT):
    """GSPO-token ratio (Zheng et al. 2025, "Group Sequence Policy Optimization", §4.3):
    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], with s_i = exp(mean over the sequence's tokens of log ratio).

    Its value is the sequence ratio s_i on every token and its gradient s_i * grad log pi(y_t). With one
    advantage per sequence, the token sum of the clipped loss is |y_i| times GSPO's sequence loss, in value
    and in gradient: this is how the sequence term is spread over tokens for the global token mean.
    """
    # where, not a product: a -inf logp on a padded token must not reach the gradient as NaN.
    token_term_BT = torch.where(trainable_BT, logp_BT - logp_BT.detach(), 0.0)
    return seq_ratios(log_ratio_BT.detach(), trainable_BT)[:, None] * token_term_BT.exp()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: PolicyLossKind = "ppo",
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss summed over trainable tokens, and metrics over those tokens (`masked_means`).

    `logp`, `old_logp`, `mask`: [B, T]; `advantages`: [B] (one per sequence, broadcast over its tokens) or
    [B, T]; `weights` (optional, [B, T]): the rollout-correction weights of `rollout_correction`, which
    multiply each token's loss. With ratio r = exp(logp - old_logp) per token:

    - `ppo`: PPO clipped surrogate (Schulman et al. 2017, Eq. 7) with the asymmetric range
      [1 - clip_low, 1 + clip_high] (DAPO's clip-higher, Yu et al. 2025); `dual_clip` caps negative-advantage
      tokens at dual_clip * |A| (Ye et al. 2020).
    - `gspo`: the same clipped surrogate on the sequence ratio (geometric mean of token ratios over the mask),
      GSPO (Zheng et al. 2025) in its token form; each token carries its sequence's term (see `_gspo_ratio`),
      so the sum is sum_i |y_i| * loss_i; GSPO's objective weighs each token by 1 / |y_i| and divides by
      the number of sequences (molt's `--algo.loss.agg seq-mean-token-mean`). GSPO's clip ranges are
      ~1e-4, not PPO's 0.2.
    - `cispo`: CISPO (MiniMax-M1, 2025, §3.1): loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp;
      the clipped IS weight never removes a token's gradient, it only bounds its size.
    - `pg`: unclipped importance-weighted policy gradient, loss = -A * r. Its gradient is -A * r * grad logp,
      which is REINFORCE's -A * grad logp when logp == old_logp (on-policy). clip_low/clip_high are unused.

    Metrics, means over trainable tokens: `clip_frac` (tokens whose clipped branch is active; for cispo,
    whose IS weight was clipped), `dual_clip_frac`, `ratio_mean`, `approx_kl` (k3 estimate of
    KL(old || new)). Returns `(loss_sum, metrics)`.
    """
    check_bt("mask", mask, logp=logp, old_logp=old_logp)
    check_floating(advantages=advantages)
    if advantages.shape not in (mask.shape, mask.shape[:1]):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(mask.shape)}, got shape {tuple(advantages.shape)}"
        )
    if weights is not None:
        check_bt("mask", mask, weights=weights)
    check_choice("policy loss kind", kind, get_args(PolicyLossKind))
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    if dual_clip is not None and (kind not in ("ppo", "gspo") or dual_clip <= 1.0):
        raise ValueError(
            f"dual_clip must be None or > 1 and needs kind 'ppo' or 'gspo'; got {dual_clip}, {kind}"
        )

    trainable_BT = mask != 0
    logp_BT = logp.float()
    # [B, 1] or [B, T]: broadcast over the tokens by every product below.
    adv_BT = (advantages[:, None] if advantages.dim() == 1 else advantages).detach().float()
    log_ratio_BT = torch.where(trainable_BT, logp_BT - old_logp.detach().float(), 0.0)
    ratio_BT = log_ratio_BT.exp()
    is_clipped_BT = is_capped_BT = torch.zeros_like(trainable_BT)  # what kind "pg" clips: nothing

    if kind in ("ppo", "gspo"):
        if kind == "gspo":
            ratio_BT = _gspo_ratio(logp_BT, log_ratio_BT, trainable_BT)
        loss_BT, is_clipped_BT, is_capped_BT = _clipped_surrogate(
            ratio_BT, adv_BT, clip_low, clip_high, dual_clip
        )
    elif kind == "cispo":
        is_weight_BT = ratio_BT.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
        loss_BT = -is_weight_BT * adv_BT * logp_BT
        is_clipped_BT = is_weight_BT != ratio_BT.detach()
    else:  # "pg"
        loss_BT = -adv_BT * ratio_BT

    if weights is not None:
        loss_BT = loss_BT * weights.detach().float()
    loss_sum = torch.where(trainable_BT, loss_BT, 0.0).sum()
    metrics = masked_means(
        trainable_BT,
        clip_frac=is_clipped_BT,
        dual_clip_frac=is_capped_BT,
        ratio_mean=ratio_BT,
        approx_kl=torch.expm1(log_ratio_BT) - log_ratio_BT,
    )
    return loss_sum, metrics


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL estimators of Schulman 2020 ("Approximating KL Divergence"), with log_r = ref_logp - logp.

    Their values, on tokens sampled from pi, estimate KL(pi || pi_ref):

    - `k1` = -log_r (unbiased, high variance, can be negative)
    - `k2` = log_r**2 / 2 (biased, exact to second order in log_r; low variance, >= 0)
    - `k3` = (exp(log_r) - 1) - log_r (unbiased, low variance, >= 0; GRPO's KL term, Shao et al. 2024, Eq. 4)

    As a loss term their gradient is what counts, and that is another matter (Tang & Munos 2025, "On a few
    pitfalls in KL divergence gradient estimation for RL"): differentiated on sampled tokens (the sampling
    is not differentiated), each gives g(x) * grad logp(x), whose expectation over x ~ pi is

    - `k1`: g = 1, so sum_x grad pi(x) = 0: the term moves nothing, whatever its value;
    - `k2`: g = -log_r, so sum_x grad pi(x) * log(pi / pi_ref) = grad KL(pi || pi_ref);
    - `k3`: g = 1 - exp(log_r), so sum_x (pi - pi_ref) * grad log pi = grad KL(pi_ref || pi), the other
      direction: the forward, mass-covering KL, though its value estimates KL(pi || pi_ref).

    A loss term therefore takes k2 (or k3, naming KL(pi_ref || pi)), never k1. A penalty in the reward is
    detached and enters through the score function, where E[k1 * grad logp] = grad KL(pi || pi_ref): k1
    is right there, and k2 and k3 are not (k3 gives grad KL(pi || pi_ref) - grad KL(pi_ref || pi)); both
    are second order in log_r, so such a penalty barely acts near the reference. Each statement holds per
    token for samples of pi itself (on-policy); tests/rlestimators checks them by exact enumeration.

    Returns [B, T] with gradient through `logp` only; reduce it with `masked_sum`.
    """
    check_bt("logp", logp, ref_logp=ref_logp)
    check_floating(logp=logp)
    check_choice("kl kind", kind, get_args(KLKind))
    log_r_BT = ref_logp.detach().float() - logp.float()
    if kind == "k1":
        return -log_r_BT
    if kind == "k2":
        return 0.5 * log_r_BT.square()
    return torch.expm1(log_r_BT) - log_r_BT


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of PPO implementations (OpenAI baselines' ppo2; Engstrom et al. 2020,
    "Implementation Matters in Deep RL", §3): per token 0.5 * max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clamp(V - V_old, -clip, clip). Pass `clip=float("inf")` for the plain squared error.

    Returns `(sum over trainable tokens, metrics)`; metrics: `value_clip_frac` (tokens where the clipped
    branch is active), `value_mse` (mean (V - R)^2). Gradient reaches `values` only.
    """
    check_bt("mask", mask, values=values, old_values=old_values, returns=returns)
    if not clip > 0:
        raise ValueError(f"clip must be > 0 (float('inf') disables clipping), got {clip}")
    trainable_BT = mask != 0
    values_BT = values.float()
    old_values_BT = old_values.detach().float()
    returns_BT = returns.detach().float()
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    unclipped_sq_BT = (values_BT - returns_BT).square()
    clipped_sq_BT = (clipped_values_BT - returns_BT).square()
    loss_BT = 0.5 * torch.maximum(unclipped_sq_BT, clipped_sq_BT)
    metrics = masked_means(
        trainable_BT, value_clip_frac=clipped_sq_BT > unclipped_sq_BT, value_mse=unclipped_sq_BT
    )
    return torch.where(trainable_BT, loss_BT, 0.0).sum(), metrics
