"""`molt._objective.step_loss`, the policy's whole per-micro-batch objective, against a hand-written
reference: per token, in Python floats, from the papers' formulas, with its gradient in closed form.

No Ray, no model: the inputs are made-up tensors. The reference restates each formula rather than calling
rlestimators, so a change to any term (the surrogate of each loss kind, each correction's weights, the
entropy bonus, each KL estimator, the one global denominator) shows here.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from molt._config_algo import kl_kind
from molt._flags import resolve
from molt._objective import step_loss
from molt.config import KL, Advantage, Algo, ConfigError, Correction, Loss

# Trainable tokens per row; row 3 is all masked, like the padding rows of a rank's shard.
MASK_BT = torch.tensor(
    [
        [0, 0, 1, 1, 1, 1, 0],
        [0, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0, 0],
    ],
    dtype=torch.float32,
)
ADVANTAGE_B = torch.tensor([1.5, -1.0, 0.5, 0.0, -2.0])
NUM_TOKENS = int(MASK_BT.sum()) + 9  # the step's count: other micro-batches and ranks hold 9 more
NUM_SEQS = 4 + 2  # the step's sequences: rows 0, 1, 2 and 4 here, 2 more elsewhere
AGG_CONSTANT = 16  # --algo.loss.agg_constant (Dr. GRPO's generation budget)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """logp, entropy, old, rollout and reference logprobs, advantages; off-policy enough that every clip,
    cap and mask acts somewhere."""
    gen = torch.Generator().manual_seed(seed)
    shape = MASK_BT.shape
    logp_BT = -0.1 - 3 * torch.rand(shape, generator=gen)
    old_logp_BT = logp_BT + 0.25 * torch.randn(shape, generator=gen)
    old_logp_BT[1, 3] = logp_BT[1, 3] - 1.5  # ratio e^1.5 on a negative advantage: the dual clip's case
    return {
        "logp_BT": logp_BT,
        "entropy_BT": 2 * torch.rand(shape, generator=gen),
        "old_logp_BT": old_logp_BT,
        "rollout_logp_BT": old_logp_BT + 0.25 * torch.randn(shape, generator=gen),
        "advantages_BT": ADVANTAGE_B[:, None] * MASK_BT,
        "mask_BT": MASK_BT,
        "ref_logp_BT": logp_BT + 0.3 * torch.randn(shape, generator=gen),
    }


def _algo(kind="ppo", dual_clip=None, mode="tis", kl_kind="k3", agg="auto") -> Algo:
    low, high = (0.02, 0.05) if kind == "gspo" else (0.2, 0.28)  # a sequence's ratio stays nearer 1
    constant = AGG_CONSTANT if agg == "seq-mean-token-sum-norm" else 0
    loss = Loss(kind=kind, clip_low=low, clip_high=high, dual_clip=dual_clip, agg=agg, agg_constant=constant)
    return Algo(
        loss=loss,
        correction=Correction(mode=mode, token_cap=1.5, token_bounds=(0.8, 1.25), seq_bounds=(0.9, 1.1)),
        kl=KL(coef=0.05, kind=kl_kind),
        entropy_coef=0.01,
    )


def _weight(mode: str, ratio: float, keep: bool, correction: Correction) -> float:
    """The rollout correction's weight of one token (ratio: trainer's old policy over the engine's)."""
    if mode == "none":
        return 1.0
    if mode == "mis":  # Liu et al. 2025: the ratio inside the bounds, else 0
        low, high = correction.token_bounds
        return ratio if low <= ratio <= high else 0.0
    # tis (Yao et al. 2025): the ratio capped; seq-mask-tis: that, on kept sequences only
    return min(ratio, correction.token_cap) if keep else 0.0


def _surrogate(kind: str, ratio: float, adv: float, logp: float, loss: Loss) -> tuple[float, float, bool]:
    """One token's surrogate, its derivative in that token's logp, and whether it counts as clipped.
    For gspo `ratio` is the sequence's and the derivative is GSPO-token's: ratio x d logp."""
    low, high = 1 - loss.clip_low, 1 + loss.clip_high
    if kind == "pg":  # -A r
        return -adv * ratio, -adv * ratio, False
    if kind == "cispo":  # -sg(clip(r)) A logp (MiniMax-M1 §3.1): the gradient survives the clip
        weight = min(max(ratio, low), high)
        return -weight * adv * logp, -weight * adv, weight != ratio
    unclipped, clipped = -adv * ratio, -adv * min(max(ratio, low), high)  # PPO, Schulman et al. 2017
    is_clipped = clipped > unclipped  # the clipped branch is flat in logp
    value, grad = (clipped, 0.0) if is_clipped else (unclipped, -adv * ratio)
    if loss.dual_clip is not None and adv < 0 and value > -loss.dual_clip * adv:  # Ye et al. 2020
        value, grad = -loss.dual_clip * adv, 0.0
    return value, grad, is_clipped


def _kl(kind: str, logp: float, ref: float) -> tuple[float, float]:
    """Schulman's k2 and k3 with log r = ref - logp, and d / d logp (what each follows in expectation, and
    why k1 is refused in the loss, is tests/rlestimators/test_rlestimators_kl_gradients.py's)."""
    log_r = ref - logp
    if kind == "k2":
        return log_r**2 / 2, -log_r
    return math.exp(log_r) - 1 - log_r, 1 - math.exp(log_r)


def _aggregation(agg: str, kind: str, num_row_tokens: int) -> tuple[float, float]:
    """A row's token weight and the step's denominator, as verl names them (auto: GSPO's for gspo)."""
    if agg == "seq-mean-token-mean" or (agg == "auto" and kind == "gspo"):  # GSPO, Eq. 5
        return 1 / num_row_tokens, NUM_SEQS
    if agg == "seq-mean-token-sum-norm":  # Dr. GRPO: each sequence's token sum over a constant
        return 1.0, NUM_SEQS * AGG_CONSTANT
    return 1.0, NUM_TOKENS


def _reference(x: dict[str, torch.Tensor], algo: Algo, *, with_reference: bool = True) -> dict:
    """The objective token by token: loss, d loss / d logp, d loss / d entropy, and the numerators."""
    t = {name: tensor.tolist() for name, tensor in x.items()}
    num_rows, num_cols = MASK_BT.shape
    loss, sums = 0.0, dict.fromkeys(["entropy", "kl", "clipped", "mismatch", "weight", "dev"], 0.0)
    rows = rows_rejected = 0
    policy = 0.0  # the policy term as aggregated
    grad_logp = [[0.0] * num_cols for _ in range(num_rows)]
    grad_entropy = [[0.0] * num_cols for _ in range(num_rows)]
    for b in range(num_rows):
        tokens = [c for c in range(num_cols) if t["mask_BT"][b][c]]
        if not tokens:
            continue
        rows += 1
        scale, denominator = _aggregation(algo.loss.agg, algo.loss.kind, len(tokens))
        log_mismatch = [t["old_logp_BT"][b][c] - t["rollout_logp_BT"][b][c] for c in tokens]
        seq_mismatch = math.exp(sum(log_mismatch) / len(tokens))  # the geometric mean of the ratios
        low, high = algo.correction.seq_bounds
        keep = algo.correction.mode != "seq-mask-tis" or low <= seq_mismatch <= high
        rows_rejected += not keep
        seq_ratio = math.exp(sum(t["logp_BT"][b][c] - t["old_logp_BT"][b][c] for c in tokens) / len(tokens))
        for c, log_m in zip(tokens, log_mismatch, strict=True):
            logp, adv = t["logp_BT"][b][c], t["advantages_BT"][b][c]
            weight = _weight(algo.correction.mode, math.exp(log_m), keep, algo.correction)
            ratio = seq_ratio if algo.loss.kind == "gspo" else math.exp(logp - t["old_logp_BT"][b][c])
            value, grad, is_clipped = _surrogate(algo.loss.kind, ratio, adv, logp, algo.loss)
            entropy = t["entropy_BT"][b][c]
            loss += scale * (weight * value - algo.entropy_coef * entropy) / denominator
            policy += scale * weight * value / denominator
            grad_logp[b][c] += scale * weight * grad / denominator
            grad_entropy[b][c] = -scale * algo.entropy_coef / denominator
            if with_reference:
                kl_value, kl_grad = _kl(algo.kl.kind, logp, t["ref_logp_BT"][b][c])
                loss += scale * algo.kl.coef * kl_value / denominator
                grad_logp[b][c] += scale * algo.kl.coef * kl_grad / denominator
                sums["kl"] += kl_value
            sums["entropy"] += entropy
            sums["clipped"] += is_clipped
            sums["mismatch"] += math.exp(log_m) - 1 - log_m  # k3 of KL(rollout || old)
            sums["weight"] += weight
            sums["dev"] += abs(weight - 1)
    numerators = {
        "train/policy_loss": policy * NUM_TOKENS,  # divided by the token count: the policy term
        "train/entropy": sums["entropy"],
        "train/clip_frac": sums["clipped"],
        "train/mismatch_kl": sums["mismatch"],  # every token lag 0 here (no lag_BT)
        "train/staleness_kl": 0.0,
        "lag0_tokens": int(MASK_BT.sum()),
        "lagged_tokens": 0,
        "train/correction_weight_mean": sums["weight"],
        "train/correction_weight_dev": sums["dev"],
        "rows_rejected": rows_rejected,
        "rows": rows,
        **({"train/kl": sums["kl"]} if with_reference else {}),
    }
    return {
        "loss": loss,
        "grad_logp_BT": torch.tensor(grad_logp),
        "grad_entropy_BT": torch.tensor(grad_entropy),
        "sums": numerators,
    }


def _run(x: dict[str, torch.Tensor], algo: Algo, **overrides):
    """`step_loss` on `x` (every input tracked by autograd), its value, numerators and the gradient of
    every input (None: it has no path to the loss)."""
    leaves = {name: tensor.clone().requires_grad_(name != "mask_BT") for name, tensor in x.items()}
    args = {**leaves, **overrides}
    loss, sums = step_loss(
        args["logp_BT"], args["entropy_BT"], args["old_logp_BT"], args["rollout_logp_BT"],
        args["advantages_BT"], args["mask_BT"], num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, algo=algo,
        ref_logp_BT=args["ref_logp_BT"],
    )  # fmt: skip
    tracked = [name for name in leaves if name != "mask_BT"]
    grads = torch.autograd.grad(loss, [leaves[name] for name in tracked], allow_unused=True)
    return loss, sums, dict(zip(tracked, grads, strict=True))


KINDS = [
    pytest.param("ppo", None, id="ppo"),
    pytest.param("ppo", 3.0, id="ppo-dual-clip"),
    pytest.param("gspo", None, id="gspo"),
    pytest.param("cispo", None, id="cispo"),
    pytest.param("pg", None, id="pg"),
]
MODES = [pytest.param(mode, id=mode) for mode in ("tis", "mis", "seq-mask-tis", "none")]
AGGS = [pytest.param(agg, id=agg) for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kind", "dual_clip"), KINDS)
def test_step_loss_is_the_hand_written_objective(kind, dual_clip, mode):
    x, algo = _inputs(), _algo(kind, dual_clip, mode)
    expected = _reference(x, algo)
    loss, sums, grads = _run(x, algo)
    assert_close(loss, torch.tensor(expected["loss"]), rtol=1e-5, atol=1e-6)
    assert_close(grads["logp_BT"], expected["grad_logp_BT"], rtol=1e-4, atol=1e-7)
    assert_close(grads["entropy_BT"], expected["grad_entropy_BT"], rtol=1e-5, atol=1e-8)
    assert sums.keys() == expected["sums"].keys()
    for name, value in expected["sums"].items():
        assert sums[name].item() == pytest.approx(value, rel=1e-5, abs=1e-5), name
    # Gradient reaches the policy's logprobs and entropies only: the rest are data.
    for name in ("old_logp_BT", "rollout_logp_BT", "advantages_BT", "ref_logp_BT"):
        assert grads[name] is None or not grads[name].any(), name
    # The case exercises what it names: the clip binds, the correction weighs, masks and rejects.
    if kind in ("ppo", "gspo", "cispo"):
        assert expected["sums"]["train/clip_frac"] > 0
    if mode != "none":
        assert expected["sums"]["train/correction_weight_dev"] > 0
    if mode == "seq-mask-tis":
        assert 0 < expected["sums"]["rows_rejected"] < expected["sums"]["rows"]


def test_the_dual_clip_caps_the_loss_of_a_large_ratio_on_a_negative_advantage():
    x = _inputs()
    plain, _, _ = _run(x, _algo("ppo", None, "none"))
    capped, _, _ = _run(x, _algo("ppo", 3.0, "none"))
    # token (1, 3): ratio e^1.5 = 4.48, advantage -1: loss 4.48 uncapped, 3.0 capped
    assert_close(plain - capped, torch.tensor((math.exp(1.5) - 3.0) / NUM_TOKENS), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kl_kind", [pytest.param("k2", id="k2"), pytest.param("k3", id="k3")])
def test_each_kl_estimator_adds_its_term(kl_kind):
    x, algo = _inputs(1), _algo(kl_kind=kl_kind)
    expected = _reference(x, algo)
    loss, sums, grads = _run(x, algo)
    assert_close(loss, torch.tensor(expected["loss"]), rtol=1e-5, atol=1e-6)
    assert_close(grads["logp_BT"], expected["grad_logp_BT"], rtol=1e-4, atol=1e-7)
    assert sums["train/kl"].item() == pytest.approx(expected["sums"]["train/kl"], rel=1e-5)


def test_k1_in_the_loss_is_refused_naming_why_and_the_fix_and_stays_valid_in_the_reward():
    kl_term = ["--algo.kl.coef", "0.1", "--algo.kl.kind", "k1"]
    with pytest.raises(ConfigError) as error:
        resolve(kl_term)
    for says in (
        "--algo.kl.kind k1",
        "zero expected gradient",
        "--algo.kl.kind k2",
        "--algo.kl.in_reward true",
    ):
        assert says in str(error.value), str(error.value)
    assert resolve([*kl_term, "--algo.kl.in_reward", "true"]).algo.kl.kind == "k1"
    assert kl_kind(resolve(kl_term[:2]).algo.kl) == "k2"  # auto in the loss: its gradient is KL(pi || ref)'s


def test_mismatch_kl_sums_lag_0_tokens_only_and_staleness_kl_the_lagged_ones():
    """Under asynchrony a token sampled by older weights differs from the trainer's old logprobs by the
    engine mismatch AND the policy's lag: `train/mismatch_kl` keeps the tokens the engine sampled with
    the trainer's own weights, `train/staleness_kl` the rest; the loss does not change."""
    x, algo = _inputs(5), _algo()
    lag_BT = torch.tensor(
        [[0, 0, 0, 0, 1, 1, 0], [0, 2, 2, 2, 2, 2, 2], [0] * 7, [0] * 7, [0, 0, 1, 0, 0, 0, 0]]
    )
    lag_BT = lag_BT.float() * MASK_BT
    args = [x[name] for name in ("logp_BT", "entropy_BT", "old_logp_BT", "rollout_logp_BT", "advantages_BT")]
    common = dict(num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, algo=algo, ref_logp_BT=x["ref_logp_BT"])
    loss, sums = step_loss(*args, MASK_BT, **common, lag_BT=lag_BT)
    plain_loss, _ = step_loss(*args, MASK_BT, **common)
    k3 = {0: 0.0, 1: 0.0}  # by lag != 0, summed by hand over the trainable tokens
    counts = {0: 0, 1: 0}
    for b, c in MASK_BT.nonzero().tolist():
        log_r = (x["old_logp_BT"][b, c] - x["rollout_logp_BT"][b, c]).item()
        lagged = int(lag_BT[b, c].item() != 0)
        k3[lagged] += math.exp(log_r) - 1 - log_r
        counts[lagged] += 1
    assert counts == {0: 6, 1: 9}  # the case has both kinds
    assert sums["train/mismatch_kl"].item() == pytest.approx(k3[0], rel=1e-5)
    assert sums["train/staleness_kl"].item() == pytest.approx(k3[1], rel=1e-5)
    assert (sums["lag0_tokens"].item(), sums["lagged_tokens"].item()) == (6, 9)
    assert_close(loss, plain_loss)


def test_without_reference_logprobs_there_is_no_kl_term():
    x, algo = _inputs(2), _algo()
    expected = _reference(x, algo, with_reference=False)
    loss, sums, grads = _run(x, algo, ref_logp_BT=None)
    assert "train/kl" not in sums
    assert_close(loss, torch.tensor(expected["loss"]), rtol=1e-5, atol=1e-6)
    assert_close(grads["logp_BT"], expected["grad_logp_BT"], rtol=1e-4, atol=1e-7)


def test_without_old_logprobs_the_ratio_is_one_and_the_gradient_is_the_same():
    """None takes the old logprobs from this forward, detached: the same as passing them."""
    x, algo = _inputs(3), _algo("ppo", None, "tis")
    on_policy = {**x, "old_logp_BT": x["logp_BT"]}
    loss, sums, grads = _run(x, algo, old_logp_BT=None)
    expected_loss, expected_sums, expected_grads = _run(on_policy, algo)
    assert_close(loss, expected_loss)
    assert_close(grads["logp_BT"], expected_grads["logp_BT"])
    assert sums["train/clip_frac"].item() == 0.0  # ratio 1: nothing to clip
    for name, value in expected_sums.items():
        assert_close(sums[name], value, msg=name)


@pytest.mark.parametrize("mode", ["none", "tis", "mis", "seq-mask-tis"])
@pytest.mark.parametrize(("kind", "dual_clip"), KINDS)
def test_the_objective_reads_no_value_back(kind, dual_clip, mode):
    """The loss and its metric numerators are built without a value read back (on a GPU each is a
    device synchronisation between a micro-batch's forward and its backward, where the GPU then waits
    for the host; one H100 step of four micro-batches spent about 40 ms so): meta tensors hold no values,
    so any read raises."""
    x = {name: value.to("meta") for name, value in _inputs(5).items()}
    x["logp_BT"].requires_grad_()
    lag_BT = torch.zeros(MASK_BT.shape, dtype=torch.int64, device="meta")
    loss, sums = step_loss(
        **x, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, algo=_algo(kind, dual_clip, mode), lag_BT=lag_BT
    )
    loss.backward()
    assert x["logp_BT"].grad is not None
    assert all(isinstance(value, torch.Tensor) and value.is_meta for value in sums.values())


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(("kind", "dual_clip"), KINDS)
def test_step_loss_is_the_hand_written_objective_under_each_aggregation(kind, dual_clip, agg):
    x, algo = _inputs(5), _algo(kind, dual_clip, "tis", agg=agg)
    expected = _reference(x, algo)
    loss, sums, grads = _run(x, algo)
    assert_close(loss, torch.tensor(expected["loss"]), rtol=1e-5, atol=1e-6)
    assert_close(grads["logp_BT"], expected["grad_logp_BT"], rtol=1e-4, atol=1e-7)
    assert_close(grads["entropy_BT"], expected["grad_entropy_BT"], rtol=1e-5, atol=1e-8)
    for name, value in expected["sums"].items():
        assert sums[name].item() == pytest.approx(value, rel=1e-5, abs=1e-5), name


def _shares(algo: Algo, lengths=(2, 20)) -> tuple[list[float], float]:
    """Each sequence's share of the gradient (the sum over its tokens of |d loss / d logp|) and the whole,
    for sequences of `lengths` trainable tokens, advantage 1 each, on-policy and without correction."""
    num_cols = max(lengths) + 1
    mask_BT = torch.zeros(len(lengths), num_cols)
    for b, n in enumerate(lengths):
        mask_BT[b, 1 : n + 1] = 1
    logp_BT = torch.full(mask_BT.shape, -1.0, requires_grad=True)
    loss, _ = step_loss(
        logp_BT, torch.zeros_like(mask_BT), logp_BT.detach(), logp_BT.detach(), mask_BT, mask_BT,
        num_tokens=sum(lengths), num_seqs=len(lengths), algo=algo,
    )  # fmt: skip
    (grad_BT,) = torch.autograd.grad(loss, logp_BT)
    per_seq = grad_BT.abs().sum(dim=1)
    return (per_seq / per_seq.sum()).tolist(), per_seq.sum().item()


@pytest.mark.parametrize(
    ("kind", "estimator", "agg", "shares", "total"),
    [
        # DAPO's token-level mean (Yu et al. 2025, Eq. 8): 1 / sum_i |o_i| * sum_i sum_t
        pytest.param("ppo", "grpo", "auto", [2 / 22, 20 / 22], 1.0, id="ppo-token-mean"),
        pytest.param("gspo", "grpo", "token-mean", [2 / 22, 20 / 22], 1.0, id="gspo-token-mean"),
        # GSPO (Zheng et al. 2025, Eq. 5): 1/G sum_i of the sequence's term, whatever its length
        pytest.param("gspo", "grpo", "auto", [0.5, 0.5], 1.0, id="gspo-paper"),
        pytest.param("ppo", "grpo", "seq-mean-token-mean", [0.5, 0.5], 1.0, id="ppo-seq-mean"),
        # Dr. GRPO (Liu et al. 2025, §3.2): 1/G sum_i sum_t / MAX_TOKENS (here 16)
        pytest.param("ppo", "dr_grpo", "auto", [2 / 22, 20 / 22], 22 / (2 * 16), id="dr-grpo-paper"),
    ],
)
def test_gradient_shares_of_a_2_and_a_20_token_sequence_are_the_papers(kind, estimator, agg, shares, total):
    constant = 16 if estimator == "dr_grpo" else 0
    loss = Loss(kind=kind, clip_low=0.2, clip_high=0.28, agg=agg, agg_constant=constant)
    algo = Algo(advantage=Advantage(estimator=estimator), loss=loss, correction=Correction(mode="none"))
    got_shares, got_total = _shares(algo)
    assert got_shares == pytest.approx(shares, rel=1e-5)
    assert got_total == pytest.approx(total, rel=1e-5)


def test_each_kind_and_estimator_defaults_to_its_papers_aggregation():
    def agg(*args):
        loss = resolve(list(args)).algo.loss
        return loss.agg, loss.agg_constant

    assert agg() == ("token-mean", 0)
    assert agg("--algo.loss.kind", "gspo") == ("seq-mean-token-mean", 0)
    assert agg("--algo.advantage.estimator", "dr_grpo") == ("seq-mean-token-sum-norm", 2)  # max_new_tokens
    assert agg("--algo.advantage.estimator", "dr_grpo", "--algo.loss.agg_constant", "4096") == (
        "seq-mean-token-sum-norm",
        4096,
    )
    assert agg("--algo.loss.kind", "gspo", "--algo.loss.agg", "token-mean") == ("token-mean", 0)
    with pytest.raises(ConfigError, match="--algo.loss.agg_constant 8 divides only under"):
        resolve(["--algo.loss.agg_constant", "8"])


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kind", [pytest.param(kind, id=kind) for kind in ("ppo", "gspo", "cispo", "pg")])
def test_micro_batches_under_the_one_denominator_add_up_to_the_whole(kind, agg):
    """Rows split over micro-batches (or ranks), each divided by the step's denominator: the losses and
    their gradients add up to the whole's, whatever the split (DESIGN §6)."""
    x, algo = _inputs(4), _algo(kind, None, "seq-mask-tis", agg=agg)
    whole, whole_sums, whole_grads = _run(x, algo)
    parts = [_run({name: t[rows] for name, t in x.items()}, algo) for rows in (slice(0, 2), slice(2, 5))]
    assert_close(parts[0][0] + parts[1][0], whole)
    assert_close(torch.cat([part[2]["logp_BT"] for part in parts]), whole_grads["logp_BT"])
    for name, value in whole_sums.items():
        assert_close(parts[0][1][name] + parts[1][1][name], value, msg=name)
