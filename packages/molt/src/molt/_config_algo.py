"""The algorithm's flag groups (`--algo.*`: estimator, loss, correction, KL, filters, critic, teacher) and
the base of every flag group. `molt.config` re-exports them; `molt --help` reads these field docstrings too.

The Literal types restate rlestimators' names and `molt._filters.FILTERS`' instead of importing them
(rlestimators and the filters import torch, and `molt --help` loads this module); tests check they agree.
"""

from typing import Annotated, Literal, dataclass_transform

import msgspec
from msgspec import Meta

OutcomeEstimator = Literal["reinforce", "rloo", "grpo", "dr_grpo", "reinforce_pp", "maxrl"]
"""`rlestimators.EstimatorName`: the keys of `rlestimators.ESTIMATORS`; each baselines against its group."""
EstimatorName = Literal[OutcomeEstimator, "gae", "opd"]
"""An outcome estimator, or one of the token-level `rlestimators.gae` / `rlestimators.opd`."""
PolicyLossKind = Literal["ppo", "gspo", "cispo", "pg"]


class Needs(msgspec.Struct, frozen=True):
    """What an advantage estimator reads beside the rewards; the groups a run starts, the checks and the
    loop read it (`estimator_needs`)."""

    critic: bool = False  # a value model's values: a critic group trains beside the policy
    teacher: bool = False  # a frozen teacher's logprobs of the policy's tokens: --algo.teacher.model
    rewards: bool = True  # the rollouts' rewards (and so the KL penalty --algo.kl.in_reward folds in)
    old_logp: bool = False  # the policy's logprobs before the step, as a separate pass


# The token-level estimators; every outcome estimator (`rlestimators.ESTIMATORS`) reads the rewards alone.
TOKEN_ESTIMATORS = {"gae": Needs(critic=True), "opd": Needs(teacher=True, rewards=False, old_logp=True)}


def estimator_needs(name: str) -> Needs:
    """What `--algo.advantage.estimator name` reads (`TOKEN_ESTIMATORS`, else the rewards alone)."""
    return TOKEN_ESTIMATORS.get(name, Needs())


LossAgg = Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["auto", "k1", "k2", "k3"]  # rlestimators.KLKind, and auto (`kl_kind`)
CorrectionMode = Literal["tis", "mis", "seq-mask-tis", "none"]
FilterName = Literal["all_equal_rewards", "truncated"]
"""The keys of `molt._filters.FILTERS`: the group filters --algo.filters composes."""


# msgspec subclasses inherit `frozen`; type checkers (PEP 681) need it as the groups' default.
@dataclass_transform(kw_only_default=True, frozen_default=True)
class Group(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Base of every flag group: keyword-only, immutable, and an unknown key is an error."""


class Advantage(Group):
    """How rewards become advantages."""

    estimator: EstimatorName = "reinforce_pp"
    """Outcome estimator from rlestimators.ESTIMATORS, or gae (starts a critic) or opd (starts a teacher)."""


class Loss(Group):
    """The clipped policy loss (rlestimators.policy_loss)."""

    kind: PolicyLossKind = "ppo"
    """Policy loss: ppo (token ratio clip), gspo (sequence ratio), cispo (clipped IS weight), pg (no clip)."""
    clip_low: Annotated[float, Meta(ge=0, lt=1)] = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_low."""
    clip_high: Annotated[float, Meta(ge=0)] = 0.28
    """Upper clip range: the ratio is clipped at 1 + clip_high (DAPO clip-higher)."""
    dual_clip: Annotated[float, Meta(gt=1)] | None = None
    """Dual-clip bound c > 1 for negative advantages; none disables it."""
    agg: LossAgg = "auto"
    """How the window's token losses become one number (verl's names), always over the whole optimizer step:
    token-mean (every trainable token weighs the same: / trainable tokens), seq-mean-token-mean (each
    sequence's token mean, sequences weighing the same: / sequences; GSPO's form), seq-mean-token-sum-norm
    (each sequence's token sum over --algo.loss.agg_constant, averaged over sequences: Dr. GRPO's). auto =
    seq-mean-token-mean under --algo.loss.kind gspo, else seq-mean-token-sum-norm under
    --algo.advantage.estimator dr_grpo, else token-mean. A sequence is one training row."""
    agg_constant: Annotated[int, Meta(ge=0)] = 0
    """The constant of --algo.loss.agg seq-mean-token-sum-norm (Dr. GRPO's generation budget); 0 = the
    --rollout.max_new_tokens budget."""


Ratio = Annotated[float, Meta(gt=0)]
"""A bound on an importance ratio (pi / pi_old), which is positive."""


class Correction(Group):
    """Importance correction of engine-vs-trainer mismatch and staleness (rlestimators.rollout_correction,
    whose keyword arguments these fields are)."""

    mode: CorrectionMode = "tis"
    """tis (truncated token weights), mis (masked token weights), seq-mask-tis, or none (on-policy only)."""
    token_cap: Annotated[float, Meta(gt=0)] = 2.0
    """Cap on token importance weights under tis and seq-mask-tis."""
    token_bounds: tuple[Ratio, Ratio] = (0.5, 2.0)
    """Token ratios outside (low, high) get weight 0 under mis."""
    seq_bounds: tuple[Ratio, Ratio] = (0.99, 1.01)
    """Sequences whose geometric-mean ratio lies outside (low, high) are masked under seq-mask-tis."""


class KL(Group):
    """KL penalty against the reference policy (the initial weights): a loss term, or a penalty in the
    reward. train/kl is the mean of the estimator's value per trained token, an estimate of KL(pi || ref)."""

    coef: Annotated[float, Meta(ge=0)] = 0.0
    """KL coefficient; 0 disables the penalty and loads no reference model."""
    kind: KLKind = "auto"
    """KL estimator (Schulman 2020). As a loss term, k2's expected gradient is that of KL(pi || ref); k3's
    (GRPO's) is that of KL(ref || pi), the other direction, though its value estimates KL(pi || ref); k1's
    is zero, so k1 is refused there. In the reward (--algo.kl.in_reward true) only k1's is that of
    KL(pi || ref); k2's and k3's are second order in the log-ratio (the run says so at start). auto: k2 as
    a loss term, k1 in the reward."""
    in_reward: bool = False
    """true: subtract the KL from the reward; false: add it to the loss."""


class Teacher(Group):
    """The teacher of on-policy distillation."""

    model: str = ""
    """Hugging Face directory of the teacher; required by --algo.advantage.estimator opd."""


class GAE(Group):
    """Generalised Advantage Estimation (with a critic)."""

    gamma: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """Discount per token."""
    lam: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """GAE lambda."""
    whiten: bool = True
    """Normalise the step's advantages to mean 0, std 1 over its trainable tokens."""


class Critic(Group):
    """The PPO critic started by --algo.advantage.estimator gae: a value head on a causal LM."""

    model: str = ""
    """Hugging Face directory the critic starts from; empty = the policy's initial weights."""
    lr: Annotated[float, Meta(gt=0)] = 1e-3
    """The critic's AdamW learning rate."""
    value_clip: Annotated[float, Meta(gt=0)] = 0.2
    """Clip range of the value loss around the values before the step."""


class Algo(Group):
    """The RL algorithm: estimator, loss, correction, KL, and the critic and teacher groups."""

    advantage: Advantage = Advantage()
    loss: Loss = Loss()
    correction: Correction = Correction()
    kl: KL = KL()
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Entropy bonus coefficient; 0 disables it."""
    filters: list[FilterName] = msgspec.field(default_factory=list)
    """Filters every finished prompt group must pass, in the order given (comma-separated; molt._filters):
    all_equal_rewards drops a group whose rewards are all equal (DAPO dynamic sampling), truncated one with
    a sample cut at the token limit. A dropped group is replaced by a new one; pool/filtered/<name> counts
    each filter's drops."""
    filter_max_batches: Annotated[int, Meta(ge=1)] = 10
    """With --algo.filters: the run stops when more than this many x --rollout.prompts_per_step groups are
    dropped while one step waits for its groups (verl's max_num_gen_batches), naming filters and prompts."""
    teacher: Teacher = Teacher()
    gae: GAE = GAE()
    critic: Critic = Critic()


def kl_kind(kl: KL) -> Literal["k1", "k2", "k3"]:
    """--algo.kl.kind with auto resolved (its docstring): the estimator whose gradient is KL(pi || ref)'s
    where the penalty acts."""
    if kl.kind != "auto":
        return kl.kind
    return "k1" if kl.in_reward else "k2"


def loss_agg(algo: Algo) -> LossAgg:
    """--algo.loss.agg with auto resolved (its docstring): the papers' own weighting for gspo and dr_grpo."""
    if algo.loss.agg != "auto":
        return algo.loss.agg
    if algo.loss.kind == "gspo":  # Zheng et al. 2025, Eq. 5: 1/G sum_i of the sequence's clipped term
        return "seq-mean-token-mean"
    if algo.advantage.estimator == "dr_grpo":  # Liu et al. 2025, §3.2: no 1/|o_i|, a constant instead
        return "seq-mean-token-sum-norm"
    return "token-mean"
