"""The policy actor: batch layout and logprob alignment, and the FSDP2 actor on real Ray and gloo.

The actor tests share three groups started once for the module (starting a rank imports AutoModel,
~20 s): 1 rank at temperature 0.7 with every row in one padded micro-batch, 2 ranks at temperature 0.7
with one packed micro-batch each (the two compared by the key test: padded against packed, one rank
against two, one budget against another), and 1 rank at temperature 1 with lr 1e-2, packed.

Legend: B sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import torch

from molt._batch import StepInputs, collate, shifted_logprobs
from molt.config import Config
from rlestimators import rollout_correction

LENGTHS = (7, 11, 9, 6, 10)  # odd row count: the 2-rank shards get an all-masked padding row
PROMPT_LEN = 4


def _sequences(
    seed: int, advantages, lengths=LENGTHS
) -> list[tuple[list[int], list[int], list[float], float]]:
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for length, advantage in zip(lengths, advantages, strict=True):
        token_ids = torch.randint(4, 100, (length,), generator=gen).tolist()
        loss_mask = [0] * PROMPT_LEN + [1] * (length - PROMPT_LEN)
        logprobs = (-3 * torch.rand(length, generator=gen)).tolist()
        sequences.append((token_ids, loss_mask, logprobs, advantage))
    return sequences


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _naive_logprobs(model, token_ids: list[int], temperature: float) -> torch.Tensor:
    """log p(token t | tokens before t) for t >= 1 of one unpadded sequence: [T - 1]."""
    ids_1T = torch.tensor([token_ids])
    logits_TV = model(ids_1T).logits[0, :-1] / temperature
    return torch.log_softmax(logits_TV, dim=-1).gather(-1, ids_1T[0, 1:, None])[:, 0]


# --- batch layout ---


def test_collate_pads_masks_and_broadcasts_the_advantage():
    batch = collate(
        [([5, 6, 7], [0, 1, 1], [0.0, -0.5, -1.5], 2.0), ([8, 9], [0, 1], [-9.0, -0.25], -1.0)], pad_id=3
    )
    torch.testing.assert_close(batch.tokens_BT, torch.tensor([[5, 6, 7], [8, 9, 3]]))
    torch.testing.assert_close(batch.loss_mask_BT, torch.tensor([[0.0, 1, 1], [0, 1, 0]]))
    torch.testing.assert_close(batch.rollout_logp_BT, torch.tensor([[0.0, -0.5, -1.5], [0, -0.25, 0]]))
    torch.testing.assert_close(batch.advantages_BT, torch.tensor([[0.0, 2, 2], [0, -1, 0]]))
    assert batch.num_tokens == 3


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        pytest.param([([1, 2], [1, 1], [0.0, 0.0], 1.0)], "loss_mask\\[0\\]", id="first-token-trainable"),
        pytest.param([([1, 2], [0, 1], [0.0], 1.0)], "one entry per token", id="ragged-lists"),
        pytest.param([], "at least one", id="empty"),
    ],
)
def test_collate_refuses(sequences, message):
    with pytest.raises(ValueError, match=message):
        collate(sequences, pad_id=0)


def test_select_keeps_the_rows_asked_for_with_the_columns_they_need():
    batch = collate(_sequences(1, [1.0] * 5), pad_id=0)
    part = batch.select([3, 0])  # lengths 6 and 7
    assert part.tokens_BT.shape == (2, 7) and part.num_tokens == batch.num_tokens
    assert part.row_lengths == [6, 7]
    for name in ("tokens_BT", "loss_mask_BT", "rollout_logp_BT", "advantages_BT"):
        torch.testing.assert_close(getattr(part, name), getattr(batch, name)[[3, 0], :7])
    empty = batch.select([])  # a rank's or micro-batch's turn in lock-step with nothing to compute
    assert empty.tokens_BT.shape == (1, 1) and not empty.loss_mask_BT.any()


def test_micro_batches_follow_the_plan_or_pack_within_the_budget():
    batch = collate(_sequences(1, [1.0] * 5), pad_id=0)  # lengths 7, 11, 9, 6, 10
    planned = batch.micro_batches(16)
    assert sorted(row for rows in planned for row in rows) == [0, 1, 2, 3, 4]
    assert all(sum(LENGTHS[row] for row in rows) <= 16 for rows in planned)
    padded = batch.micro_batches(20, packed=False)
    assert all(len(rows) * max(LENGTHS[row] for row in rows) <= 20 for rows in padded)
    given = dataclasses.replace(batch, plan=((4,), (), (0, 1, 2, 3)))
    assert given.micro_batches(16) == [[4], [], [0, 1, 2, 3]]


def test_a_rank_starts_with_torchs_expandable_segments_on_cuda_unless_the_driver_sets_the_allocator(
    monkeypatch,
):
    # Fixed-size segments fragmented under the packed micro-batches' changing shapes until the agentic
    # loop ran out of memory on one H100 (BENCHMARKS, the packed actor); a user's own setting is kept.
    from molt._group import worker_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert worker_env(on_gpu=False) == {"OMP_NUM_THREADS": "1"}
    assert worker_env(on_gpu=True) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert worker_env(on_gpu=True) == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}


def test_train_batch_refuses_mismatched_tensors():
    batch = collate(_sequences(2, [1.0] * 2, lengths=(5, 6)), pad_id=0)
    with pytest.raises(ValueError, match="advantages_BT must be float32"):
        dataclasses.replace(batch, advantages_BT=batch.advantages_BT[:1])


def test_a_step_is_refused_rows_of_another_shape_or_no_trainable_token():
    batch = collate(_sequences(2, [1.0] * 2, lengths=(5, 6)), pad_id=0)
    batch.check_step(StepInputs(old_logp_BT=torch.zeros(2, 6)))
    with pytest.raises(ValueError, match=r"returns_BT must be \(2, 6\), got \(2, 5\)"):
        batch.check_step(StepInputs(old_values_BT=torch.zeros(2, 6), returns_BT=torch.zeros(2, 5)))
    untrainable = collate([([1, 2, 3], [0, 0, 0], [0.0] * 3, 1.0)], pad_id=0)
    with pytest.raises(ValueError, match="at least one trainable token"):
        untrainable.check_step(StepInputs())


@pytest.mark.parametrize("temperature", [pytest.param(1.0, id="t1"), pytest.param(0.7, id="t0.7")])
def test_shifted_logprobs_are_the_logprob_of_each_token_given_its_prefix(tiny_model_dir, temperature):
    model = _hf_model(tiny_model_dir)
    sequences = _sequences(3, [1.0] * 3, lengths=(6, 9, 4))
    batch = collate(sequences, pad_id=0)
    with torch.no_grad():
        logp_BT = shifted_logprobs(model(batch.tokens_BT).logits, batch.tokens_BT, temperature=temperature)
    assert not logp_BT[:, 0].any()
    for row, (token_ids, *_) in enumerate(sequences):
        expected_T = _naive_logprobs(model, token_ids, temperature)
        torch.testing.assert_close(logp_BT[row, 1 : len(token_ids)], expected_T, atol=1e-5, rtol=0)


# --- the actor on Ray ---


def _config(
    *,
    temperature: float,
    budget: int,
    lr: float,
    pack: bool = True,
    warmup_steps: int = 0,
    loss_kind: str = "",
) -> Config:
    """Micro-batches of `budget` tokens, packed or padded (`pack`). `loss_kind`: that policy loss with
    tight clip bounds (0.05); empty: the default loss."""
    config = Config()
    loss = msgspec.structs.replace(config.algo.loss, kind=loss_kind or "ppo", clip_low=0.05, clip_high=0.05)
    return msgspec.structs.replace(
        config,
        algo=msgspec.structs.replace(config.algo, loss=loss) if loss_kind else config.algo,
        actor=msgspec.structs.replace(
            config.actor,
            lr=lr,
            micro_batch_tokens=budget,
            pack=pack,
            warmup_steps=warmup_steps,
            grad_clip=1.0,
        ),
        rollout=msgspec.structs.replace(config.rollout, temperature=temperature),
    )


GROUPS = {  # name: (num_ranks, config)
    "one_rank": (1, _config(temperature=0.7, budget=4096, pack=False, lr=1e-3)),  # padded, one micro-batch
    "two_ranks": (2, _config(temperature=0.7, budget=24, lr=1e-3)),  # packed: rows 11, 7, 6 | 10, 9
    "t1": (1, _config(temperature=1.0, budget=20, lr=1e-2, warmup_steps=2)),  # packed, two rows or so
}


STARTED_S: dict = {}  # a group of `groups` -> seconds from its construction until its ranks had loaded


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    """The module's three actor groups, started concurrently on one local Ray."""
    import ray

    from molt._group import PolicyGroup

    def start(config, num_ranks):
        started = time.monotonic()
        group = PolicyGroup(tiny_model_dir, config, num_ranks)
        STARTED_S[group] = time.monotonic() - started
        return group

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with ThreadPoolExecutor(len(GROUPS)) as pool:
        futures = {name: pool.submit(start, config, ranks) for name, (ranks, config) in GROUPS.items()}
        started = {name: future.result() for name, future in futures.items()}
    yield started
    for group in started.values():
        group.shutdown()
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_rank", "two_ranks"])
def test_a_group_says_where_its_start_went(groups, name):
    """The run's start-up line splits the actor's seconds (`timing/startup_actor_*`): each rank's load
    (its process group, the model, the optimizer) and its warm-up, within what the group's start took.
    On a CPU nothing compiles: no warm-up runs."""
    parts = groups[name].startup_seconds()
    assert set(parts) == {"load", "warm_up"}
    assert 0.05 < parts["load"] < STARTED_S[groups[name]]
    assert 0 <= parts["warm_up"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize(("name", "temperature"), [("t1", 1.0), ("one_rank", 0.7), ("two_ranks", 0.7)])
def test_group_logprobs_equal_a_transformers_forward(groups, tiny_model_dir, name, temperature):
    model = _hf_model(tiny_model_dir)
    sequences = _sequences(4, [1.0] * 5)
    logp_BT = groups[name].logprobs(collate(sequences, pad_id=0))
    assert logp_BT.shape == (5, max(LENGTHS))
    for row, (token_ids, *_) in enumerate(sequences):
        expected_T = _naive_logprobs(model, token_ids, temperature)
        torch.testing.assert_close(logp_BT[row, 1 : len(token_ids)], expected_T, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_one_global_batch_gives_the_same_update_on_one_or_two_ranks(groups):
    one, two = groups["one_rank"], groups["two_ranks"]
    before = one.full_state()
    for name, tensor in two.full_state().items():
        assert torch.equal(tensor, before[name]), f"{name}: the groups must start from the same weights"
    batch = collate(_sequences(5, [1.5, -1.0, 0.5, -0.25, 2.0]), pad_id=0)
    gen = torch.Generator().manual_seed(6)
    # Off-policy old logprobs, so that clipping acts, and engine logprobs near them, so that the rollout
    # correction's weights are uneven.
    logp_BT = one.logprobs(batch)
    old_logp_BT, engine_logp_BT = (logp_BT + 0.3 * torch.randn(logp_BT.shape, generator=gen) for _ in "ab")
    lagged_BT = batch.loss_mask_BT * torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])[:, None]  # rows 1, 3: lag 1
    batch = dataclasses.replace(batch, rollout_logp_BT=engine_logp_BT * batch.loss_mask_BT, lag_BT=lagged_BT)

    metrics_one = one.train_step(batch, StepInputs(old_logp_BT=old_logp_BT))
    metrics_two = two.train_step(batch, StepInputs(old_logp_BT=old_logp_BT))

    assert set(metrics_one) == {
        "train/policy_loss",
        "train/entropy",
        "train/clip_frac",
        "train/mismatch_kl",
        "train/staleness_kl",
        "train/lag0_frac",
        "train/seq_masked_frac",
        "train/correction_weight_mean",
        "train/correction_weight_dev",
        "train/grad_norm",
        "train/lr",
        "train/skipped_updates",
    }
    assert metrics_one["train/skipped_updates"] == 0.0
    assert 0 < metrics_one["train/clip_frac"] < 1
    for name, mask_BT in [("mismatch", batch.loss_mask_BT - lagged_BT), ("staleness", lagged_BT)]:
        _, _, mismatch = rollout_correction(old_logp_BT, batch.rollout_logp_BT, mask_BT)  # over those tokens
        expected = float(mismatch["mismatch_kl"])
        assert metrics_one[f"train/{name}_kl"] == pytest.approx(expected, rel=1e-5), name
    assert metrics_one["train/lag0_frac"] == pytest.approx(1 - (lagged_BT.sum() / batch.num_tokens).item())
    assert metrics_one["train/seq_masked_frac"] == 0.0  # tis keeps every sequence
    assert metrics_one["train/grad_norm"] > 1.0  # so clipping to 1.0 acted, on the global norm
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    after_one, after_two = one.full_state(), two.full_state()
    # Adam's first step moves every weight by about lr (1e-3) whatever its gradient's size, except where
    # the gradient is near Adam's eps (1e-8): there the step follows the gradient's size, and summation
    # order noise shows (up to 2e-5 seen). Every weight moves the same way, by the same step within 5%.
    for name, tensor in after_one.items():
        assert not torch.equal(tensor, before[name]), f"{name} did not move"
        assert ((after_two[name] - before[name]) * (tensor - before[name]) >= 0).all(), (
            f"{name}: opposite moves"
        )
        torch.testing.assert_close(after_two[name], tensor, atol=5e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_a_non_finite_gradient_changes_no_weight_on_any_rank(groups):
    """One rank's row has a NaN advantage: its gradient, and so the global norm both ranks reduce, is NaN.
    Both skip the update: the weights stay bit for bit (clipping by a NaN norm would have made them all
    NaN), and the step says so."""
    group = groups["two_ranks"]
    before = group.full_state()
    batch = collate(_sequences(11, [1.0, -0.5, float("nan"), 2.0, -1.0]), pad_id=0)
    metrics = group.train_step(batch)
    assert metrics["train/skipped_updates"] == 1.0
    assert metrics["train/grad_norm"] != metrics["train/grad_norm"]  # NaN
    for name, tensor in group.full_state().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.slow
def test_a_step_without_old_logprobs_equals_one_given_the_logprob_pass(groups, tiny_model_dir, tmp_path):
    """`train_step(batch)` takes the old logprobs from its own forward (one pass): the same metrics and
    update as passing those of a separate `logprobs` pass, from the same checkpointed state."""
    from molt._checkpoint import write_loop_state

    group = groups["two_ranks"]  # one packed micro-batch a rank
    batch = collate(_sequences(10, [1.0, -0.5, 0.25, 2.0, -1.0]), pad_id=0)
    group.save(tmp_path / "ckpt")
    write_loop_state(tmp_path / "ckpt", 1, [], tiny_model_dir)
    separate = group.train_step(batch, StepInputs(old_logp_BT=group.logprobs(batch)))
    after_separate = group.full_state()

    group.load(tmp_path / "ckpt")
    one_forward = group.train_step(batch)
    for key, value in separate.items():
        assert one_forward[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for name, tensor in group.full_state().items():
        torch.testing.assert_close(tensor, after_separate[name], atol=1e-7, rtol=0, msg=name)


@pytest.mark.slow
def test_a_step_raises_the_logprob_of_positive_advantage_tokens(groups, tiny_model_dir):
    group = groups["t1"]
    batch = collate(_sequences(7, [1.0, 1.0, -1.0, -1.0], lengths=(8, 9, 8, 9)), pad_id=0)
    mask_BT = batch.loss_mask_BT
    logp_before_BT = group.logprobs(batch)
    # The engine sampled with the trainer's weights: the correction weighs every token 1.
    batch = dataclasses.replace(batch, rollout_logp_BT=logp_before_BT * mask_BT)
    metrics = group.train_step(batch)  # old logprobs from the step's own forward
    logp_after_BT = group.logprobs(batch)

    # On-policy (ratio 1), weights 1: the PPO loss is -mean(advantage) over the window's tokens.
    assert metrics["train/policy_loss"] == pytest.approx(
        -(batch.advantages_BT.sum() / batch.num_tokens).item()
    )
    assert metrics["train/clip_frac"] == 0.0
    assert metrics["train/mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/lr"] == pytest.approx(0.5e-2)  # the first of two warm-up steps
    # Entropy of the distribution each trained token was sampled from, as transformers computes it.
    with torch.no_grad():
        logits_BTV = _hf_model(tiny_model_dir)(batch.tokens_BT).logits
    entropy_next_BT = torch.distributions.Categorical(logits=logits_BTV).entropy()
    entropy_BT = torch.nn.functional.pad(entropy_next_BT[:, :-1], (1, 0))
    assert metrics["train/entropy"] == pytest.approx(((entropy_BT * mask_BT).sum() / batch.num_tokens).item())

    change_B = ((logp_after_BT - logp_before_BT) * mask_BT).sum(dim=1) / mask_BT.sum(dim=1)
    assert (change_B[:2] > 0).all() and (change_B[2:] < 0).all(), change_B


@pytest.mark.slow
def test_reference_logprobs_add_a_kl_term_reported_as_its_token_mean(groups):
    group = groups["t1"]
    batch = collate(_sequences(9, [1.0, -1.0], lengths=(8, 9)), pad_id=0)
    logp_BT = group.logprobs(batch)
    ref_logp_BT = logp_BT - 0.1 * batch.loss_mask_BT  # log r = ref - logp = -0.1 on every trained token
    metrics = group.train_step(batch, StepInputs(ref_logp_BT=ref_logp_BT))
    k2 = 0.1**2 / 2  # Schulman's k2 estimator (the default --algo.kl.kind) at log r = -0.1
    assert metrics["train/kl"] == pytest.approx(k2, rel=1e-4)


@pytest.mark.slow
def test_each_loss_kind_gives_its_own_update_once_the_ratio_departs_from_one(groups, tiny_model_dir):
    """--train.mini_batches 2: the second window's ratio is taken against the logprobs before the first
    step, so it departs from 1, the clip binds, and ppo, gspo, cispo and pg update differently."""
    from molt._group import PolicyGroup
    from molt.loop import train_windows

    kinds = ("ppo", "gspo", "cispo", "pg")
    configs = {kind: _config(temperature=1.0, budget=4096, lr=2e-2, loss_kind=kind) for kind in kinds}
    with ThreadPoolExecutor(len(kinds)) as pool:
        starts = {kind: pool.submit(PolicyGroup, tiny_model_dir, configs[kind], 1) for kind in kinds}
        started = {kind: start.result() for kind, start in starts.items()}
    try:
        batch = collate(
            _sequences(11, [1.0, -1.0, 0.5, 1.5, -0.5, -1.5], lengths=(8, 9, 7, 8, 9, 7)), pad_id=0
        )
        before = started["pg"].full_state()
        logp_BT = started["pg"].logprobs(batch)  # every group starts from the same weights
        batch = dataclasses.replace(batch, rollout_logp_BT=logp_BT * batch.loss_mask_BT)  # on-policy engine
        metrics, after = {}, {}
        for kind, group in started.items():
            old = StepInputs(old_logp_BT=group.logprobs(batch))
            metrics[kind] = train_windows(group, batch.windows(2, [1] * 6, (0, 1)), old)
            after[kind] = group.full_state()
    finally:
        for group in started.values():
            group.shutdown()
    for kind in kinds:
        assert any(not torch.equal(after[kind][n], before[n]) for n in before), f"{kind} did not move"
    for first, second in itertools.combinations(kinds, 2):
        differs = max((after[first][n] - after[second][n]).abs().max().item() for n in before)
        assert differs > 1e-6, f"{first} and {second} gave the same update"
    assert metrics["ppo"]["train/clip_frac"] > 0  # the 0.05 bounds bind in the second window
    assert metrics["cispo"]["train/clip_frac"] > 0
    assert metrics["pg"]["train/clip_frac"] == 0.0  # pg never clips


@pytest.mark.slow
def test_the_first_window_takes_its_old_logprobs_from_its_own_forward(tiny_model_dir):
    """`train_windows`: nothing has stepped before the first window, so its step reads no old logprobs
    (`score` leaves NaN on its rows); the update equals the one that reads the separate pass's."""
    from molt._actor import PolicyWorker
    from molt.loop import train_windows
    from molt.vllm_server import free_port

    batch = collate(_sequences(12, [1.0, -1.0, 0.5, 1.5, -0.5, -1.5], lengths=(8, 9, 7, 8, 9, 7)), pad_id=0)
    windows = batch.windows(2, [1] * 6, (0, 1))
    config = _config(temperature=1.0, budget=4096, lr=2e-2, loss_kind="ppo")
    states, metrics = [], []
    for first_read in (True, False):
        worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
        try:
            old_BT = worker.logprobs(batch)
            if not first_read:
                old_BT[windows[0][1]] = torch.nan
            metrics.append(train_windows(worker, windows, StepInputs(old_logp_BT=old_BT)))
            states.append(worker.full_state())
        finally:
            torch.distributed.destroy_process_group()
    assert metrics[0]["train/clip_frac"] > 0, metrics  # the second window's ratio departs from 1
    for name, tensor in states[0].items():
        torch.testing.assert_close(states[1][name], tensor, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_train_step_refuses_a_batch_without_trainable_tokens(groups):
    batch = collate([([1, 2, 3], [0, 0, 0], [0.0] * 3, 1.0)], pad_id=0)
    with pytest.raises(ValueError, match="at least one trainable token"):
        groups["t1"].train_step(batch)


def _engine_sample(url: str, prompt: list[int], temperature: float) -> tuple[list[int], list[float], str]:
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 6, "temperature": temperature, "seed": 0, "logprobs": 0},
    }
    reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    logprobs = [item["logprob"] for item in choice["logprobs"]["content"]]
    return choice["token_ids"], logprobs, choice["weight_versions"][-1]["version"]


@pytest.mark.slow
def test_refit_sends_the_trained_weights_to_a_vllm_engine(groups, tiny_model_dir, tmp_path):
    """After a step and a refit, the engine samples with the trainer's weights: its processed logprobs
    (temperature 0.7) equal the 2-rank group's recomputation (DESIGN invariant 3, end to end)."""
    import refit
    from molt.vllm_server import VLLMServer

    group = groups["two_ranks"]
    batch = collate(_sequences(8, [1.0, -1.0, 2.0], lengths=(8, 9, 10)), pad_id=0)
    group.train_step(batch)
    prompt = [5, 17, 33, 60, 2, 41]
    log = tmp_path / "vllm.log"
    with VLLMServer(
        tiny_model_dir, extra_args=refit.engine_flags(refit.GLOO_BACKEND), log_path=log
    ) as server:
        seconds = group.refit([server.url], version=1)
        tokens, logprobs, version = _engine_sample(server.url, prompt, 0.7)
    assert version == "1"
    assert {"pause", "transfer", "finish", "resume"} <= set(seconds)
    row = prompt + tokens
    expected_T = group.logprobs(collate([(row, [0] * len(row), [0.0] * len(row), 0.0)], pad_id=0))[
        0, len(prompt) :
    ]
    torch.testing.assert_close(torch.tensor(logprobs), expected_T, atol=1e-4, rtol=0)
    initial_T = _naive_logprobs(_hf_model(tiny_model_dir), row, 0.7)[len(prompt) - 1 :]
    assert (initial_T - expected_T).abs().max() > 1e-3  # the engine no longer serves the initial weights


@pytest.mark.slow
def test_a_checkpoint_resumes_the_update_exactly_on_another_rank_count_and_exports(
    groups, tiny_model_dir, tmp_path
):
    from transformers import AutoModelForCausalLM

    from molt._checkpoint import export, write_loop_state

    two, one = groups["two_ranks"], groups["one_rank"]
    batch = collate(_sequences(8, [1.0, -0.5, 0.25, 2.0, -1.0]), pad_id=0)

    def step(group):
        return group.train_step(batch)

    step(two)  # Adam's moments and the schedule are now off their initial values
    two.save(tmp_path / "ckpt")
    write_loop_state(tmp_path / "ckpt", 1, [], tiny_model_dir)
    saved = two.full_state()
    metrics_two, after_two = step(two), two.full_state()

    one.load(tmp_path / "ckpt")  # one rank reads what two ranks wrote
    assert all(torch.equal(tensor, saved[name]) for name, tensor in one.full_state().items())
    metrics_one, after_one = step(one), one.full_state()
    for key, value in metrics_two.items():
        assert metrics_one[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for name, tensor in after_two.items():
        torch.testing.assert_close(after_one[name], tensor, atol=1e-6, rtol=0, msg=name)

    exported = AutoModelForCausalLM.from_pretrained(export(tmp_path / "ckpt", tmp_path / "hf"))
    written = {path.name for path in (tmp_path / "hf").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= written
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
