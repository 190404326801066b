"""The policy actor's logprob head (`molt._lean.LogprobHead`): the model's LM head gives token
logprobs and entropies from its input, and a train step with it equals one through the logits.

One rank of the real `PolicyWorker` in this process (AutoModel over gloo, the tiny Qwen3 with tied
embeddings); the logits path is the same worker with the head's request left unset.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from host_reads import ValuesReadBack

from molt._batch import collate
from molt.config import FSDP, Config
from molt.vllm_server import free_port

pytestmark = [  # importing AutoModel in this process (the actor runs here)
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

ROWS = [  # (tokens, loss mask): the second row is right padded
    ([1, 5, 9, 11, 12, 7, 30, 41], [0, 0, 0, 1, 1, 1, 1, 1]),
    ([1, 6, 7, 13, 8], [0, 0, 1, 1, 1]),
]


def _config(temperature: float, entropy_coef: float) -> Config:
    config = Config()
    return msgspec.structs.replace(
        config,
        actor=msgspec.structs.replace(config.actor, lr=1e-2, micro_batch_tokens=16),
        algo=msgspec.structs.replace(config.algo, entropy_coef=entropy_coef),
        rollout=msgspec.structs.replace(config.rollout, temperature=temperature),
    )


def _step(model_dir, config: Config, *, through_the_logits: bool) -> tuple[torch.Tensor, dict, dict]:
    """Logprobs before the step, the step's metrics and the parameters after it."""
    from molt._actor import PolicyWorker

    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(model_dir), config)
    try:
        assert worker._logprob_head is not None
        if through_the_logits:
            worker._logprob_head = None  # the head's forward then gives the logits, as before
        advantages = [1.0, -1.0]
        batch = collate(
            [
                (tokens, mask, [-2.0] * len(tokens), a)
                for (tokens, mask), a in zip(ROWS, advantages, strict=True)
            ],
            pad_id=0,
        )
        logp_BT = worker.logprobs(batch)
        metrics = worker.train_step(batch)
        params = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
        return logp_BT, metrics, params
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    ("temperature", "entropy_coef"),
    [
        pytest.param(1.0, 0.0, id="logprobs-alone-at-T1"),  # the head's low-precision backward
        pytest.param(0.7, 0.05, id="entropy-bonus-at-T0.7"),  # the entropy's gradient trains too
    ],
)
def test_a_train_step_with_the_head_equals_one_through_the_logits(tiny_model_dir, temperature, entropy_coef):
    config = _config(temperature, entropy_coef)
    head_logp_BT, head_metrics, head_params = _step(tiny_model_dir, config, through_the_logits=False)
    logits_logp_BT, logits_metrics, logits_params = _step(tiny_model_dir, config, through_the_logits=True)
    torch.testing.assert_close(head_logp_BT, logits_logp_BT, rtol=1e-5, atol=1e-5)
    assert head_metrics.keys() == logits_metrics.keys()
    for name, value in head_metrics.items():
        assert value == pytest.approx(logits_metrics[name], rel=1e-4, abs=1e-6), name
    # AdamW's first step moves each weight by about lr x the sign of its gradient, so a near-zero gradient
    # that rounds the other way flips a whole step: compare the updates by direction.
    initial = _initial(tiny_model_dir)
    for name, param in head_params.items():
        head_update, logits_update = param - initial[name], logits_params[name] - initial[name]
        cosine = torch.nn.functional.cosine_similarity(head_update.flatten(), logits_update.flatten(), dim=0)
        opposite = ((head_update * logits_update) < 0).float().mean()
        assert cosine > 0.999 and opposite < 1e-3, name
    assert head_params["model.embed_tokens.weight"].ne(initial["model.embed_tokens.weight"]).any(), (
        "the tied head's weight trains through the head"
    )


def _initial(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t.float() for name, t in load_file(str(next(model_dir.glob("*.safetensors")))).items()}


def test_no_head_under_tensor_parallelism_or_for_a_head_with_bias():
    from molt._lean import LogprobHead, use_logprob_head

    tensor_parallel = msgspec.structs.replace(Config(), fsdp=FSDP(tp_size=2))
    model = torch.nn.Module()
    head = torch.nn.Linear(4, 8, bias=False)
    model.get_output_embeddings = lambda: head
    assert use_logprob_head(model, tensor_parallel) is None
    assert type(head) is torch.nn.Linear
    assert use_logprob_head(model, Config()) is head and isinstance(head, LogprobHead)
    biased = torch.nn.Linear(4, 8, bias=True)
    model.get_output_embeddings = lambda: biased
    assert use_logprob_head(model, Config()) is None
    assert type(biased) is torch.nn.Linear


def test_the_head_reads_nothing_back_and_the_worker_refuses_ids_past_the_vocabulary(tiny_model_dir):
    """The ids are checked on the host's copy before the forward, so the head's own forward reads no
    value back from the device (on a GPU, a synchronisation in the middle of every forward)."""
    from molt._actor import PolicyWorker

    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), _config(1.0, 0.0))
    try:
        head = worker._logprob_head
        assert head is not None
        vocab, hidden = head.weight.shape
        tokens_BT = torch.tensor([[1, 5, 9, 11]])
        for positions_N in (None, torch.tensor([1, 2])):
            with head.logprobs_of(tokens_BT, positions_N), ValuesReadBack() as during:
                head(torch.randn(1, 4, hidden))
            assert during.reads == 0
        rows = [([1, 5, vocab, 11], [0, 0, 1, 1], [-2.0] * 4, 1.0)]
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\).* to {vocab}"):
            worker.logprobs(collate(rows, pad_id=0))
    finally:
        torch.distributed.destroy_process_group()
