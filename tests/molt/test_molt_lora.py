"""--actor.lora.*: the policy trains LoRA adapters only; refits send the adapters alone, checkpoints resume
them, and exports write them (or, with merged=True, the merged weights).

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


def test_refit_sends_the_adapters_alone_under_peft_names(worker, tiny_model_dir, monkeypatch):
    import refit

    batch = collate(ROWS, pad_id=0)
    for _ in range(2):  # both A and B away from their initial values
        worker.train_step(batch)
    sent = {}

    def capture(engines, params, *, version, delta=False, lora=None):
        sent.update(specs=params.specs, tensors=dict(params), lora=lora)

    monkeypatch.setattr(refit, "update_weights", capture)
    worker.refit(["http://127.0.0.1:1"], refit.GLOO_BACKEND, 1, "127.0.0.1")
    assert sent["lora"]["r"] == 4 and sent["lora"]["lora_alpha"] == 8.0
    assert sorted(sent["lora"]["target_modules"]) == sorted(LoRA().target_modules)
    params = {name: p for name, p in worker.model.named_parameters() if ".lora_" in name}
    assert [spec.name for spec in sent["specs"]] == [f"base_model.model.{name}" for name in params]
    for name, param in params.items():
        assert torch.equal(sent["tensors"][f"base_model.model.{name}"], param.detach()), name


def test_a_checkpoint_resumes_the_adapters_and_exports_them_or_the_merged_model(
    worker, tiny_model_dir, tmp_path
):
    from safetensors.torch import load_file
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
    adapters = {name: tensor.clone() for name, tensor in refit.adapter_params(worker.model)}
    trained = _values(worker.model)
    worker.train_step(batch)  # the resumed worker must continue from here, optimizer state included
    continued = _values(worker.model)

    worker.load(str(step))
    assert all(torch.equal(value, trained[name]) for name, value in _values(worker.model).items())
    worker.train_step(batch)
    for name, value in _values(worker.model).items():
        torch.testing.assert_close(value, continued[name], atol=0, rtol=0)

    # By default the adapter, as a PEFT directory; with merged=True the model with it merged in.
    adapter_dir = export(step, tmp_path / "adapter")
    config = msgspec.json.decode((adapter_dir / "adapter_config.json").read_bytes())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    written = load_file(adapter_dir / "adapter_model.safetensors")
    assert set(written) == set(adapters)
    assert all(torch.equal(written[name], tensor) for name, tensor in adapters.items())
    assert (adapter_dir / "tokenizer_config.json").is_file()

    exported = AutoModelForCausalLM.from_pretrained(
        export(step, tmp_path / "out", merged=True), dtype=torch.float32
    )
    state = exported.state_dict()
    assert set(state) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)


@pytest.mark.parametrize("models", [["tiny"], ["tiny", "policy"]], ids=["base-only", "serves-adapter"])
def test_an_attached_engine_must_serve_the_adapter(models):
    """--vllm.urls with --actor.lora.rank: an engine that lists no adapter `policy` is refused up front."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from molt._engines import check_attached

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            listed = {"data": [{"id": name} for name in models]}
            body = json.dumps(listed if self.path == "/v1/models" else {})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert check_attached([url]) == [url]  # no LoRA: any engine that answers
        if "policy" in models:
            assert check_attached([url], lora=True) == [url]
        else:
            with pytest.raises(ValueError, match="serves no LoRA adapter 'policy'"):
                check_attached([url], lora=True)
    finally:
        server.shutdown()
        server.server_close()
