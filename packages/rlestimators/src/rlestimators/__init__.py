"""rlestimators: pure torch functions for LLM reinforcement learning.

Advantage estimators, policy/KL/value losses, chunked token logprobs and entropy, rollout correction, DAPO
filtering and pass@k. No state, no classes, any device; torch is the only dependency. Losses return token
sums: divide every term by one global count of trainable tokens (see the README).
"""

from rlestimators._advantages import (
    ESTIMATORS,
    EstimatorName,
    dr_grpo,
    gae,
    grpo,
    maxrl,
    opd,
    reinforce,
    reinforce_pp,
    rloo,
)
from rlestimators._correction import CorrectionMode, rollout_correction
from rlestimators._logprobs import entropy_from_logits, lm_head_logprobs, token_logprobs
from rlestimators._losses import KLKind, PolicyLossKind, kl, masked_sum, policy_loss, value_loss
from rlestimators._shaping import dynamic_filter, pass_at_k

__all__ = [
    "ESTIMATORS",
    "CorrectionMode",
    "EstimatorName",
    "KLKind",
    "PolicyLossKind",
    "dr_grpo",
    "dynamic_filter",
    "entropy_from_logits",
    "gae",
    "grpo",
    "kl",
    "lm_head_logprobs",
    "masked_sum",
    "maxrl",
    "opd",
    "pass_at_k",
    "policy_loss",
    "reinforce",
    "reinforce_pp",
    "rloo",
    "rollout_correction",
    "token_logprobs",
    "value_loss",
]
