"""The sender's parameter names are the checkpoint's, also under activation checkpointing."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import refit


def test_activation_checkpointing_leaves_the_refit_names_as_the_checkpoints():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    wrapped = torch.nn.Sequential(plain[0], checkpoint_wrapper(plain[1]))  # as AutoModel wraps layers
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_parameters())
    params = refit.full_params(wrapped)
    assert [spec.name for spec in params.specs] == [name for name, _ in plain.named_parameters()]
    assert [name for name, _ in params] == [name for name, _ in plain.named_parameters()]


def test_a_one_rank_fsdp_model_streams_its_shards_as_they_are_without_a_gather(monkeypatch):
    """FSDP2 over one rank (the actor on one GPU): each shard is already the whole parameter, so the
    stream takes it as it is: the unsharded values, and no all-gather called (it costs a collective's
    dispatch for every parameter of every refit)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from molt.vllm_server import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        reference = {name: p.detach().clone() for name, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters())

        def no_gather(self):
            raise AssertionError("a one-rank shard was all-gathered")

        monkeypatch.setattr(DTensor, "full_tensor", no_gather)
        streamed = dict(refit.full_params(model, dtype=torch.bfloat16))
        assert list(streamed) == list(reference)
        for name, value in reference.items():
            assert torch.equal(streamed[name], value.to(torch.bfloat16)), name
    finally:
        dist.destroy_process_group()
