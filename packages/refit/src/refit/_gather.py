"""Full parameters of a (possibly FSDP2-sharded) module, gathered one at a time.

`full_params(module)` is the sender's source: its `specs` (name, dtype, full shape) are known without
any communication (a DTensor knows its global shape), and iterating it all-gathers one parameter at
a time with `DTensor.full_tensor()`, so a rank never holds more than one gathered parameter (or one
LoRA layer's three, below) beyond its own shards. Every rank of the FSDP group must iterate it in the
same order (the gather is a collective); only rank 0 sends. Names are the module's own
`named_parameters()` names, which for a transformers model under `fully_shard` are the Hugging Face
checkpoint names vLLM loads.

A LoRA-wrapped linear layer (NeMo AutoModel's `LinearLoRA`: `weight` W at its checkpoint name, `lora_A`
and `lora_B` linear children, a `scale` of alpha / rank) streams as one merged weight,
W + scale * B @ A (computed in float32, then cast), under W's name; its adapters are not sent. Engines
that serve the base model thus serve the trained one, and a delta refit diffs the merged values.
`adapter_params(module)` streams the other way round: the adapters alone (`lora_A` / `lora_B` weights,
under PEFT's names `base_model.model.<checkpoint path>.lora_A.weight`, which vLLM's LoRA loader reads),
for engines that serve the adapter on the frozen base.

It refuses nothing and renames nothing: a model whose trainer names differ from its checkpoint names
(e.g. transformers' fused MoE experts) is caught by the name check in `update_weights`.
Imports only torch (runs on a GPU machine without vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from refit._buckets import ParamSpec


class FullParams:
    """Re-iterable stream of `(name, full tensor)`; `specs` describes it without gathering."""

    def __init__(
        self, module: torch.nn.Module, *, dtype: torch.dtype | None = None, adapters: bool = False
    ) -> None:
        self.module, self.dtype, self.adapters = module, dtype, adapters
        self.specs = [
            ParamSpec(name, dtype or param.dtype, tuple(param.shape)) for name, param, _ in self._sources()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param, lora in self._sources():
            tensor = _gather(param) if lora is None else _merged(_gather(param), lora)
            yield name, tensor if self.dtype is None else tensor.to(self.dtype)

    def _sources(self) -> Iterator[tuple[str, torch.nn.Parameter, torch.nn.Module | None]]:
        """(checkpoint name, parameter, the LoRA layer whose merge it is or None), in `named_parameters`
        order, a shared (tied) parameter once, the adapters' own parameters left out; with `adapters`,
        only those, under PEFT's names."""
        modules = dict(self.module.named_modules())
        if self.adapters:
            for prefix, module in modules.items():
                for part in ("lora_A", "lora_B") if _is_lora(module) else ():
                    name = f"base_model.model.{checkpoint_name(prefix)}.{part}.weight"
                    yield name, getattr(module, part).weight, None
            return
        adapters = {id(child) for m in modules.values() if _is_lora(m) for child in (m.lora_A, m.lora_B)}
        for name, param in self.module.named_parameters():  # a shared parameter once, as torch gives it
            prefix, _, leaf = name.rpartition(".")
            owner = modules[prefix]
            if id(owner) in adapters:
                continue
            lora = owner if leaf == "weight" and _is_lora(owner) else None
            yield checkpoint_name(name), param, lora


def _is_lora(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("lora_A", "lora_B", "scale"))


def _gather(param: torch.Tensor) -> torch.Tensor:
    """The whole of `param`: a DTensor shard all-gathered (a collective), unless every rank already holds
    it whole (each placement replicated or over a mesh dimension of one rank, e.g. FSDP2 on one GPU)."""
    tensor = param.detach()
    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    if all(p.is_replicate() or mesh.size(dim) == 1 for dim, p in enumerate(tensor.placements)):
        return tensor.to_local()
    return tensor.full_tensor()


def _merged(weight: torch.Tensor, lora: Any) -> torch.Tensor:
    """W + scale * B @ A of one LoRA layer ([out, in] + [out, r] @ [r, in]), in W's dtype. `lora` is
    what `_is_lora` accepts (NeMo's `LinearLoRA`, untyped)."""
    a = _gather(lora.lora_A.weight).float()
    b = _gather(lora.lora_B.weight).float()
    return (weight.float() + lora.scale * (b @ a)).to(weight.dtype)


def checkpoint_name(name: str) -> str:
    """A parameter's checkpoint name: without the wrapper segment that activation checkpointing
    (torch's `checkpoint_wrapper`, which AutoModel applies) inserts into module paths."""
    return name.replace("_checkpoint_wrapped_module.", "")


def full_params(module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> FullParams:
    """The full parameters of `module` under their names, optionally cast to `dtype` for the wire; a
    LoRA layer's weight merged with its adapter (module docstring)."""
    return FullParams(module, dtype=dtype)


def adapter_params(module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> FullParams:
    """The LoRA adapters of `module` alone, under PEFT's names (module docstring)."""
    return FullParams(module, dtype=dtype, adapters=True)
