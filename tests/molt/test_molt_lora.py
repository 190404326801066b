"""--actor.lora.*: the policy trains LoRA adapters only, and refits and exports carry the merged weights.

The worker runs in this process on gloo (one rank, no Ray).

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from molt._batch import collate
from molt.config import Actor, Config, LoRA
from molt.vllm_server import free_port

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

ROWS = [([1, 5, 9, 11, 12, 7], [0, 0, 0, 1, 1, 1], [-4.0] * 6, 1.0),
        ([1, 6, 7, 13, 8, 9], [0, 0, 1, 1, 1, 1], [-4.0] * 6, -1.0)]  # fmt: skip


def _config(**lora) -> Config:
    return msgspec.structs.replace(Config(), actor=Actor(lr=1e-2, lora=LoRA(rank=4, alpha=8.0, **lora)))


@pytest.fixture
def worker(tiny_model_dir):
    from molt._actor import PolicyWorker

    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), _config())
    yield worker
    torch.distributed.destroy_process_group()


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_only_the_adapters_train(worker):
    trainable = {name for name, p in worker.model.named_parameters() if p.requires_grad}
    num_layers = worker.model.config.num_hidden_layers
    assert len(trainable) == 2 * 7 * num_layers  # lora_A and lora_B on the seven projections of each layer
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in worker.model.parameters() if p.requires_grad}

    batch = collate(ROWS, pad_id=0)
    before = _values(worker.model)
    worker.train_step(batch)
    after = _values(worker.model)
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and moved <= trainable, moved - trainable
    assert all(".lora_B." in name for name in moved)  # B starts at 0, so A's first gradient is 0
    worker.train_step(batch)
    moved = {name for name, value in _values(worker.model).items() if not torch.equal(before[name], value)}
    assert moved == trainable


def test_refit_sends_the_merged_weights_under_the_checkpoint_names(worker, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    import refit

    batch = collate(ROWS, pad_id=0)
    for _ in range(2):  # both A and B away from their initial values
        worker.train_step(batch)
    sent = {}

    def capture(engines, params, *, version, delta=False):
        sent.update(specs=params.specs, tensors=dict(params))

    monkeypatch.setattr(refit, "update_weights", capture)
    worker.refit(["http://127.0.0.1:1"], refit.GLOO_BACKEND, 1, "127.0.0.1")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert [spec.name for spec in sent["specs"]] == list(base.state_dict())
    params = dict(worker.model.named_parameters())
    for name, tensor in sent["tensors"].items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in params:
            a, b = params[f"{module}.lora_A.weight"], params[f"{module}.lora_B.weight"]
            torch.testing.assert_close(tensor, params[name] + 8.0 / 4 * b @ a)
        else:
            assert torch.equal(tensor, params[name]), name

    # The base model with the merged weights computes what the LoRA policy computes.
    base.load_state_dict(sent["tensors"])
    with torch.no_grad():
        logits_BTV = base(batch.tokens_BT).logits[:, :-1]
    expected_BT = torch.log_softmax(logits_BTV, -1).gather(-1, batch.tokens_BT[:, 1:, None])[..., 0]
    torch.testing.assert_close(worker.logprobs(batch)[:, 1:], expected_BT, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_resumes_the_adapters_and_exports_the_merged_model(worker, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    import refit
    from molt._checkpoint import export, write_loop_state

    batch = collate(ROWS, pad_id=0)
    for _ in range(2):
        worker.train_step(batch)
    step = tmp_path / "step_000002"
    worker.save(str(step))
    write_loop_state(step, 2, [], tiny_model_dir)
    merged = dict(refit.full_params(worker.model))
    trained = _values(worker.model)
    worker.train_step(batch)  # the resumed worker must continue from here, optimizer state included
    continued = _values(worker.model)

    worker.load(str(step))
    assert all(torch.equal(value, trained[name]) for name, value in _values(worker.model).items())
    worker.train_step(batch)
    for name, value in _values(worker.model).items():
        torch.testing.assert_close(value, continued[name], atol=0, rtol=0)

    exported = AutoModelForCausalLM.from_pretrained(export(step, tmp_path / "out"), dtype=torch.float32)
    state = exported.state_dict()
    assert set(state) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)
