"""The PPO critic (`molt._critic`) and the frozen groups, on real Ray and gloo with the tiny model.

The critic is a value head on the policy's architecture; a fresh head starts at zero. Its update, like the
policy's, does not depend on the number of ranks, it fits the returns it is trained on, and a checkpoint
written by two ranks resumes on one. A frozen group (`trainable=False`: reference, teacher) computes the
same logprobs as a trainable one and refuses to train.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from molt._batch import StepInputs, collate
from molt.config import Config

pytestmark = pytest.mark.slow

LENGTHS = (7, 11, 9, 6, 10)
PROMPT_LEN = 4


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in LENGTHS:
        token_ids = torch.randint(4, 100, (length,), generator=gen).tolist()
        rows.append((token_ids, [0] * PROMPT_LEN + [1] * (length - PROMPT_LEN), [0.0] * length, 0.0))
    return collate(rows, pad_id=0)


def _config(budget: int) -> Config:
    config = Config()
    algo = msgspec.structs.replace(
        config.algo, critic=msgspec.structs.replace(config.algo.critic, lr=1e-2, value_clip=10.0)
    )
    actor = msgspec.structs.replace(config.actor, micro_batch_tokens=budget, warmup_steps=1)
    return msgspec.structs.replace(config, algo=algo, actor=actor)


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    """A 1-rank and a 2-rank critic (different micro-batches), a trainable and a frozen policy."""
    import ray

    from molt._critic import CriticGroup
    from molt._group import PolicyGroup

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    starts = {
        "critic_one": lambda: CriticGroup(tiny_model_dir, _config(4096), 1),
        "critic_two": lambda: CriticGroup(tiny_model_dir, _config(12), 2),
        "policy": lambda: PolicyGroup(tiny_model_dir, Config(), 1),
        "frozen": lambda: PolicyGroup(tiny_model_dir, Config(), 1, trainable=False),
    }
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
        started = {name: future.result() for name, future in futures.items()}
    yield started
    for group in started.values():
        group.shutdown()
    ray.shutdown()


def _returns(batch):
    """A return per trainable token that depends on the row: something for the critic to fit."""
    return batch.loss_mask_BT * torch.arange(1.0, batch.num_rows + 1)[:, None]


def test_a_new_value_head_starts_at_zero_and_one_step_is_the_same_on_one_or_two_ranks(groups):
    one, two = groups["critic_one"], groups["critic_two"]
    batch = _batch()
    values_one, values_two = one.values(batch), two.values(batch)
    assert values_one.shape == batch.tokens_BT.shape
    assert torch.equal(values_one, torch.zeros_like(values_one)) and torch.equal(values_two, values_one)

    returns_BT = _returns(batch)
    metrics_one = one.train_step(batch, StepInputs(old_values_BT=values_one, returns_BT=returns_BT))
    metrics_two = two.train_step(batch, StepInputs(old_values_BT=values_two, returns_BT=returns_BT))
    assert set(metrics_one) >= {"critic/value_loss", "critic/grad_norm", "critic/lr", "critic/value_mean"}
    # the first loss is 0.5 * mean(R^2) over trainable tokens, whatever the split
    expected = 0.5 * (returns_BT.square().sum() / batch.num_tokens).item()
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert metrics_one["critic/value_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics_one["critic/lr"] == pytest.approx(1e-2)
    torch.testing.assert_close(two.values(batch), one.values(batch), atol=1e-5, rtol=0)


def test_the_critic_fits_its_returns_and_resumes_on_another_rank_count(groups, tmp_path):
    one, two = groups["critic_one"], groups["critic_two"]
    batch = _batch(1)
    returns_BT = _returns(batch)
    losses = []
    for _ in range(8):
        losses.append(
            two.train_step(batch, StepInputs(old_values_BT=two.values(batch), returns_BT=returns_BT))[
                "critic/value_loss"
            ]
        )
    assert losses[-1] < 0.5 * losses[0], losses

    two.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "scheduler.pt").is_file()
    one.load(tmp_path / "ckpt")  # one rank reads what two ranks wrote, optimizer included
    torch.testing.assert_close(one.values(batch), two.values(batch), atol=1e-5, rtol=0)
    after_two = two.train_step(batch, StepInputs(old_values_BT=two.values(batch), returns_BT=returns_BT))
    after_one = one.train_step(batch, StepInputs(old_values_BT=one.values(batch), returns_BT=returns_BT))
    assert after_one["critic/value_loss"] == pytest.approx(after_two["critic/value_loss"], rel=1e-4)
    torch.testing.assert_close(one.values(batch), two.values(batch), atol=1e-4, rtol=0)


def test_a_frozen_group_gives_the_policys_logprobs_and_refuses_to_train(groups):
    batch = _batch(2)
    frozen, policy = groups["frozen"], groups["policy"]
    logp_BT = frozen.logprobs(batch)
    torch.testing.assert_close(logp_BT, policy.logprobs(batch), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.train_step(batch, StepInputs(old_logp_BT=logp_BT))
