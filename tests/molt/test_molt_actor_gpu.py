"""The policy actor's GPU path: NeMo AutoModel's own loader (`NeMoAutoModelForCausalLM`) over NCCL.

Runs only with CUDA (the `gpu` marker). One rank, driven without Ray (`PolicyWorker` is a plain class),
so it runs on a GPU machine that has AutoModel but neither Ray nor vLLM.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from molt._batch import collate
from molt.config import Actor, Config, Rollout
from molt.vllm_server import free_port

pytestmark = pytest.mark.gpu


def test_automodel_worker_on_cuda_matches_transformers_and_trains(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from molt._actor import PolicyWorker

    config = msgspec.structs.replace(
        Config(), actor=Actor(lr=1e-2, micro_batch_size=2), rollout=Rollout(temperature=0.7)
    )
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
    assert (
        type(worker.model).__module__.startswith("nemo_automodel") or next(worker.model.parameters()).is_cuda
    )

    rows = [([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [0.0, 0.0, 0.0, -4.0, -4.0], 1.0),
            ([1, 6, 7, 13], [0, 0, 1, 1], [0.0, 0.0, -4.0, -4.0], -1.0),
            ([1, 8, 14], [0, 0, 1], [0.0, 0.0, -4.0], 0.5)]  # fmt: skip
    batch = collate(rows, pad_id=0)
    logp_BT = worker.logprobs(batch)

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(batch.tokens_BT).logits[:, :-1] / 0.7
    expected_BT = torch.log_softmax(logits.float(), -1).gather(-1, batch.tokens_BT[:, 1:, None])[..., 0]
    mask_BT = batch.loss_mask_BT[:, 1:] > 0
    torch.testing.assert_close(logp_BT[:, 1:][mask_BT], expected_BT[mask_BT], atol=2e-4, rtol=2e-4)

    metrics = worker.train_step(batch, logp_BT)
    assert metrics["train/grad_norm"] > 0 and metrics["train/lr"] == pytest.approx(1e-2)
    after_BT = worker.logprobs(batch)
    advantages_BT = batch.advantages_BT
    moved_BT = (after_BT - logp_BT)[batch.loss_mask_BT > 0]
    assert (moved_BT * advantages_BT[batch.loss_mask_BT > 0] > 0).float().mean() > 0.5
    torch.distributed.destroy_process_group()


def test_critic_and_frozen_workers_on_cuda(tiny_model_dir):
    """The critic (transformers' value-head model, sharded by AutoModel) and a frozen policy on a GPU."""
    from molt._actor import PolicyWorker
    from molt._critic import CriticWorker, data_parallel_only

    rows = [([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [0.0] * 5, 0.0),
            ([1, 6, 7, 13], [0, 0, 1, 1], [0.0] * 4, 0.0)]  # fmt: skip
    batch = collate(rows, pad_id=0)
    returns_BT = batch.loss_mask_BT * 2.0
    critic = CriticWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), data_parallel_only(Config()))
    assert next(critic.model.parameters()).is_cuda
    values_BT = critic.values(batch)
    assert torch.equal(values_BT, torch.zeros_like(values_BT))
    step = critic.train_step
    losses = [step(batch, critic.values(batch), returns_BT)["critic/value_loss"] for _ in range(5)]
    assert losses[0] == pytest.approx(2.0) and losses[-1] < losses[0]
    torch.distributed.destroy_process_group()

    frozen = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), Config(), trainable=False)
    assert frozen.optimizer is None and not any(p.requires_grad for p in frozen.model.parameters())
    assert frozen.logprobs(batch).shape == batch.tokens_BT.shape
    torch.distributed.destroy_process_group()


def test_compiled_layers_train_as_the_eager_ones(tiny_model_dir):
    """--actor.compile: the same logprobs and the same step, over two row lengths (a static compile, then a
    dynamic one)."""
    from molt._actor import PolicyWorker

    batches = [
        collate([([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [-4.0] * 5, 1.0),
                 ([1, 6, 7, 13], [0, 0, 1, 1], [-4.0] * 4, -1.0)], pad_id=0),
        collate([([1, 8, 14, 3, 5, 9, 2], [0, 0, 1, 1, 1, 1, 1], [-4.0] * 7, 0.5)], pad_id=0),
    ]  # fmt: skip
    results = []
    for compiled in (False, True):
        config = msgspec.structs.replace(
            Config(),
            actor=Actor(lr=1e-2, micro_batch_size=2, compile=compiled),
            rollout=Rollout(temperature=0.7),
        )
        worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
        layers = worker.model.model.layers
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        runs = []
        for batch in batches:
            logp_BT = worker.logprobs(batch)
            runs.append((logp_BT, worker.train_step(batch), worker.logprobs(batch)))
        results.append(runs)
        torch.distributed.destroy_process_group()
    for (eager_logp, eager_metrics, eager_after), (logp, metrics, after) in zip(*results, strict=True):
        torch.testing.assert_close(logp, eager_logp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(after, eager_after, atol=1e-4, rtol=1e-4)
        for name, value in eager_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-3, abs=1e-5), name
