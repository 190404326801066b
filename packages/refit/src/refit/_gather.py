"""Full parameters of a (possibly FSDP2-sharded) module, gathered one at a time.

`full_params(module)` is the sender's source: its `specs` (name, dtype, full shape) are known without
any communication (a DTensor knows its global shape), and iterating it all-gathers one parameter at
a time with `DTensor.full_tensor()`, so a rank never holds more than one gathered parameter beyond
its own shards. Every rank of the FSDP group must iterate it in the same order (the gather is a
collective); only rank 0 sends. Names are the module's own `named_parameters()` names, which for a
transformers model under `fully_shard` are the Hugging Face checkpoint names vLLM loads.

It refuses nothing and renames nothing: a model whose trainer names differ from its checkpoint names
(e.g. transformers' fused MoE experts) is caught by the name check in `update_weights`.
Imports only torch (runs on a GPU machine without vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from refit._buckets import ParamSpec

__all__ = ["FullParams", "full_params"]


class FullParams:
    """Re-iterable stream of `(name, full tensor)`; `specs` describes it without gathering."""

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.dtype = dtype
        self.specs = [
            ParamSpec(checkpoint_name(name), dtype or param.dtype, tuple(param.shape))
            for name, param in module.named_parameters()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            yield checkpoint_name(name), self._materialize(param)

    def _materialize(self, param: torch.Tensor) -> torch.Tensor:
        tensor = param.detach()
        gather = getattr(tensor, "full_tensor", None)  # a DTensor shard: all-gather (a collective)
        if callable(gather):
            tensor = gather()
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        return tensor


_WRAPPED = "_checkpoint_wrapped_module."  # torch's activation-checkpoint wrapper adds it to every name


def checkpoint_name(name: str) -> str:
    """A parameter's checkpoint name: without the wrapper segment that activation checkpointing
    (torch's `checkpoint_wrapper`, which AutoModel applies) inserts into module paths."""
    return name.replace(_WRAPPED, "")


def full_params(module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> FullParams:
    """The full parameters of `module` under their names, optionally cast to `dtype` for the wire."""
    return FullParams(module, dtype=dtype)
