"""The algorithm, both halves: a batch's advantages (`score`) and the policy's loss on one micro-batch
(`step_loss`), each a plain function.

**Advantages.** `score` turns the rollouts' rewards into each trainable token's advantage under
`--algo.advantage.estimator`: an outcome estimator (`rlestimators.ESTIMATORS`, one advantage per rollout
against its group, `outcome_advantages`) or a token-level one (`ADVANTAGES`: `gae` with a critic's values,
`opd` with a teacher's logprobs). What each reads beside the rewards (a critic, a teacher, the policy's
logprobs before the step) is one row of `molt._config_algo.TOKEN_ESTIMATORS`, which also decides the
groups a run starts and the checks. A KL penalty in the reward (`--algo.kl.in_reward`) is folded into the
rewards first. Adding an estimator: docs/adding-an-estimator.md.

**The loss.** `step_loss`:

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

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgspec
import torch

from molt._batch import StepInputs, TrainBatch
from molt._config_algo import estimator_needs, kl_kind, loss_agg
from molt.config import Algo, Config
from rlestimators import ESTIMATORS, gae, kl, masked_sum, opd, policy_loss, rollout_correction


@dataclass(frozen=True)
class Scored:
    """A batch scored for its optimizer steps (`score`)."""

    batch: TrainBatch  # with each trainable token's advantage
    policy: StepInputs  # what the policy's steps read
    critic: StepInputs | None  # what the critic's steps read; None without a critic
    advantages: torch.Tensor  # what the advantage metrics count: per rollout, or per trainable token
    metrics: dict[str, float]


@dataclass(frozen=True)
class Advantages:
    """What an advantage function gives `score`."""

    advantages_BT: torch.Tensor  # each trainable token's advantage (0 elsewhere)
    counted: torch.Tensor  # what the advantage metrics count: per rollout, or per trainable token
    critic: StepInputs | None = None  # the inputs of the critic's steps, for an estimator with one
    metrics: dict[str, float] = field(default_factory=dict)


def score(
    batch: TrainBatch,
    rewards_R: torch.Tensor,
    rows_R: torch.Tensor,
    groups,
    config: Config,
    first_window: Sequence[int] = (),
) -> Scored:
    """`batch`'s advantages under --algo.advantage.estimator and the inputs of its optimizer steps, from
    the rollouts' rewards (`rewards_R`; `rows_R`: each rollout's rows, consecutive in the batch) and the
    passes of `groups` (`.policy`, and `.reference`, `.critic`, `.teacher` where the run has them: these
    calls block, so the loop runs this in a thread). `first_window`: the rows of the batch's first
    optimizer step."""
    algo, mask_BT = config.algo, batch.loss_mask_BT
    in_reward = groups.reference is not None and algo.kl.in_reward
    # The policy's logprobs before the step, which every ratio is taken against. The first window's step
    # takes them from its own forward, nothing having stepped before it (`molt.loop.train_windows`); a
    # separate pass gives them to the later windows' rows (--train.mini_batches), or to every row where
    # they are needed before any step (an estimator that reads them, a KL penalty in the reward).
    if estimator_needs(algo.advantage.estimator).old_logp or in_reward:
        old_logp_BT = groups.policy.logprobs(batch, trained_only=True)
    elif config.train.mini_batches > 1 and (later := sorted(set(range(len(mask_BT))) - set(first_window))):
        old_logp_BT = torch.full(batch.tokens_BT.shape, torch.nan)  # NaN: read by no step
        part_BT = groups.policy.logprobs(batch.select(later), trained_only=True)
        old_logp_BT[later, : part_BT.shape[1]] = part_BT
    else:
        old_logp_BT = None
    # Every use of these logprobs is masked to the trained tokens, which alone the passes compute.
    ref_logp_BT = None if groups.reference is None else groups.reference.logprobs(batch, trained_only=True)
    metrics = {}
    if in_reward:  # --algo.kl.in_reward: a per-rollout penalty instead of a loss term
        assert old_logp_BT is not None and ref_logp_BT is not None  # a separate pass; a reference group
        kl_BT = kl(old_logp_BT, ref_logp_BT, kind=kl_kind(algo.kl)) * mask_BT
        metrics["train/kl"] = (kl_BT.sum() / mask_BT.sum()).item()  # per trained token
        rewards_R = rewards_R - algo.kl.coef * rollout_sums(kl_BT, rows_R)
        ref_logp_BT = None  # no loss term
    advantage = ADVANTAGES.get(algo.advantage.estimator, outcome_advantages)
    got = advantage(batch, rewards_R, rows_R, old_logp_BT, groups, config)
    scored = replace(batch, advantages_BT=got.advantages_BT)
    policy = StepInputs(old_logp_BT=old_logp_BT, ref_logp_BT=ref_logp_BT)  # ref: the KL loss term
    return Scored(scored, policy, got.critic, got.counted, metrics | got.metrics)


def outcome_advantages(batch, rewards_R, rows_R, old_logp_BT, groups, config: Config) -> Advantages:
    """An outcome estimator (`rlestimators.ESTIMATORS`): one advantage per rollout, against the others of
    its group (`--rollout.group_size` consecutive rollouts), on every trainable token of its rows."""
    group_ids_R = torch.arange(len(rewards_R)).div(config.rollout.group_size, rounding_mode="floor")
    advantages_R = ESTIMATORS[config.algo.advantage.estimator](rewards_R, group_ids_R)
    return Advantages(advantages_R.repeat_interleave(rows_R)[:, None] * batch.loss_mask_BT, advantages_R)


def gae_advantages(batch, rewards_R, rows_R, old_logp_BT, groups, config: Config) -> Advantages:
    """gae: the critic's values; each rollout's reward sits on its rows' last sampled token."""
    gae_cfg, mask_BT = config.algo.gae, batch.loss_mask_BT
    values_BT = groups.critic.values(batch)
    rewards_BT = last_token_rewards(mask_BT, rewards_R.repeat_interleave(rows_R))
    advantages_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, gamma=gae_cfg.gamma, lam=gae_cfg.lam)
    advantages_BT = whitened(advantages_BT, mask_BT) if gae_cfg.whiten else advantages_BT
    critic = StepInputs(old_values_BT=values_BT, returns_BT=returns_BT)
    metrics = {"critic/explained_variance": explained_variance(values_BT, returns_BT, mask_BT)}
    return Advantages(advantages_BT, advantages_BT[mask_BT != 0], critic, metrics)


def opd_advantages(batch, rewards_R, rows_R, old_logp_BT, groups, config: Config) -> Advantages:
    """opd: the teacher's logprobs of the student's own tokens, against the student's before the step."""
    mask_BT = batch.loss_mask_BT
    advantages_BT = opd(old_logp_BT, groups.teacher.logprobs(batch, trained_only=True), mask_BT)
    metrics = {"teacher/reverse_kl": -(advantages_BT.sum() / mask_BT.sum()).item()}
    return Advantages(advantages_BT, advantages_BT[mask_BT != 0], metrics=metrics)


# Token-level pieces of GAE (`--algo.advantage.estimator gae`), over a batch's trainable tokens.


def last_token_rewards(mask_BT: torch.Tensor, rewards_B: torch.Tensor) -> torch.Tensor:
    """[B, T] token rewards for GAE: each row's reward on its last trainable token, 0 elsewhere. Every
    segment of a compacted rollout gets the rollout's reward (as every segment shares an outcome
    advantage); a segment's value after its last token is 0, so segments do not bootstrap each other."""
    # each row's last trainable column: the largest of its trainable columns' numbers 1..T
    last_B = ((mask_BT != 0) * torch.arange(1, mask_BT.shape[1] + 1)).argmax(dim=1)
    rewards_BT = torch.zeros_like(mask_BT)
    rewards_BT[torch.arange(len(rewards_B)), last_B] = rewards_B * (mask_BT.sum(dim=1) > 0)
    return rewards_BT


def whitened(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """`values_BT` shifted and scaled to mean 0, std 1 over the trainable tokens (0 elsewhere)."""
    trained = values_BT[mask_BT != 0]
    std = trained.std(unbiased=False) if trained.numel() > 1 else torch.tensor(0.0)
    return (values_BT - trained.mean()) / (std + 1e-8) * (mask_BT != 0)


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over trainable tokens: 1 is a perfect critic, 0 one no
    better than a constant, below 0 worse; 0 when the returns do not vary."""
    trained = mask_BT != 0
    returns, values = returns_BT[trained], values_BT[trained]
    variance = returns.var(unbiased=False)
    return 0.0 if variance == 0 else (1 - (returns - values).var(unbiased=False) / variance).item()


# The token-level estimators by --algo.advantage.estimator name (what each reads:
# `molt._config_algo.TOKEN_ESTIMATORS`); every other name is an outcome estimator.
ADVANTAGES = {"gae": gae_advantages, "opd": opd_advantages}


def rollout_sums(values_BT: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
    """Each rollout's sum of `values_BT` over its rows (`rows_R` consecutive rows each)."""
    owner_B = torch.arange(len(rows_R)).repeat_interleave(rows_R)
    return torch.zeros(len(rows_R)).index_add_(0, owner_B, values_BT.sum(dim=1).float())


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
    correction = msgspec.structs.asdict(algo.correction)  # its fields are `rollout_correction`'s keywords
    weights_BT, keep_B, _ = rollout_correction(old_logp_BT, rollout_logp_BT, mask_BT, **correction)
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
    total = pg_sum - algo.entropy_coef * masked_sum(entropy_BT * scale_BT, mask_BT)
    trainable_BT = mask_BT != 0
    # k3 of KL(rollout || old) per token (`rlestimators.rollout_correction`'s `mismatch_kl`), summed over
    # the lag-0 and the lagged trainable tokens apart
    log_ratio_BT = (old_logp_BT.detach() - rollout_logp_BT) * trainable_BT
    k3_BT = torch.expm1(log_ratio_BT) - log_ratio_BT
    lagged_BT = trainable_BT & (lag_BT != 0) if lag_BT is not None else torch.zeros_like(trainable_BT)
    lag0_BT = trainable_BT & ~lagged_BT
    has_tokens_B = trainable_BT.any(dim=1)  # shard padding rows are not sequences
    sums = {
        "train/policy_loss": pg_sum.detach() * num_tokens / denominator,  # / num_tokens: as trained
        "train/entropy": masked_sum(entropy_BT, mask_BT).detach(),
        "train/clip_frac": pg_metrics["clip_frac"] * trainable_BT.sum(),
        "train/mismatch_kl": (k3_BT * lag0_BT).sum(),
        "train/staleness_kl": (k3_BT * lagged_BT).sum(),
        "lag0_tokens": lag0_BT.sum(),
        "lagged_tokens": lagged_BT.sum(),
        "train/correction_weight_mean": masked_sum(weights_BT, mask_BT),
        "train/correction_weight_dev": masked_sum((weights_BT - 1).abs(), mask_BT),  # 0: all weigh 1
        "rows_rejected": (has_tokens_B & ~keep_B).sum(),
        "rows": has_tokens_B.sum(),
    }
    if ref_logp_BT is not None:  # the KL loss term against a reference policy (--algo.kl.coef)
        kl_BT = kl(logp_BT, ref_logp_BT, kind=kl_kind(algo.kl))
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
