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
