"""Rollout routing replay (paper §3.5 "MoE consistency"; Ma et al., 2025): train on the engine's experts.

The engine returns, per request, the experts each token was routed to (vLLM: base64 `.npy`, shape
`(num_tokens - 1, num_layers, top_k)`; the last token was never forwarded). `decode_routed_experts`
turns that into a tensor aligned with the token trace. `RoutingReplay` then makes a transformers MoE
model use exactly those experts: a forward hook on each top-k router swaps in the recorded indices and
recomputes their weights from the router's own current logits (softmax, gather, renormalise when the
router normalises), so gradients still reach the router. Rows marked -1 keep the router's own choice.

Shapes: `N` tokens as the routers see them (batch × sequence, flattened), `L` MoE layers, `K` top-k,
`T` tokens of one trace. Supported routers: transformers' `*TopKRouter` modules returning
`(logits, scores, indices)` (Qwen3-MoE and its relatives). Anything else is refused at construction.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["decode_routed_experts", "RoutingReplay"]


def decode_routed_experts(
    encoded: str, *, num_tokens: int | None = None, prompt_start: int = 0
) -> torch.Tensor:
    """vLLM's `routed_experts` string → int64 `experts_TLK`, row t = experts used when token t was input.

    `num_tokens` is the trace length (prompt + completion); `prompt_start` the number of leading prompt
    tokens the engine skipped (`routed_experts_prompt_start`). Rows without data (those skipped and
    the last token) are -1, which `RoutingReplay` leaves to the router.
    """
    import numpy as np

    experts_nLK = torch.from_numpy(
        np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False).astype(np.int64)
    )
    if experts_nLK.ndim != 3:
        raise ValueError(
            f"routed experts must be (tokens, layers, top_k), got shape {tuple(experts_nLK.shape)}"
        )
    num_rows = experts_nLK.shape[0]
    num_tokens = num_rows + 1 + prompt_start if num_tokens is None else num_tokens
    if num_rows != num_tokens - 1 - prompt_start:
        raise ValueError(
            f"{num_rows} routing rows do not fit a trace of {num_tokens} tokens with "
            f"prompt_start={prompt_start} (expected {num_tokens - 1 - prompt_start}: one per forwarded token)"
        )
    experts_TLK = torch.full((num_tokens, *experts_nLK.shape[1:]), -1, dtype=torch.int64)
    experts_TLK[prompt_start : num_tokens - 1] = experts_nLK
    return experts_TLK


def _is_topk_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


class RoutingReplay:
    """Record or replay the experts of every top-k router of `model` (in module order = layer order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if _is_topk_router(m)]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no transformers *TopKRouter module to replay")
        self.recorded: torch.Tensor | None = None  # experts_NLK of the last `record()`

    @contextmanager
    def record(self) -> Iterator[RoutingReplay]:
        """Within the block, every forward's expert choices are appended to `self.recorded`."""
        calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        hooks = [
            router.register_forward_hook(
                lambda _m, _a, out, layer=layer: calls[layer].append(out[2].detach())
            )
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()
        per_layer = [torch.cat(c) for c in calls] if calls[0] else []
        self.recorded = torch.stack(per_layer, dim=1) if per_layer else None

    @contextmanager
    def replay(self, experts: torch.Tensor) -> Iterator[RoutingReplay]:
        """Within the block, routers use `experts` (`[N, L, K]` or `[B, T, L, K]`, -1 = router's choice)."""
        experts_NLK = experts.reshape(-1, *experts.shape[-2:]).long()
        if experts_NLK.shape[1] != len(self.routers):
            raise ValueError(
                f"replay has {experts_NLK.shape[1]} layers, the model has {len(self.routers)} routers"
            )
        hooks = [
            router.register_forward_hook(lambda m, _a, out, layer=layer: _swap(m, out, experts_NLK[:, layer]))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()


def _swap(router: torch.nn.Module, output: tuple, want_NK: torch.Tensor) -> tuple:
    logits_NE, scores_NK, indices_NK = output
    if want_NK.shape != indices_NK.shape:
        raise ValueError(
            f"replay covers {tuple(want_NK.shape)} tokens×top_k, the router sees {tuple(indices_NK.shape)}: "
            "align the recorded experts with the batch (same tokens, same order)"
        )
    want_NK = want_NK.to(indices_NK.device)
    indices_NK = torch.where((want_NK < 0).any(-1, keepdim=True), indices_NK, want_NK)
    # Same arithmetic as the router's forward, on the chosen experts (weights keep their gradient).
    top_NK = torch.softmax(logits_NE, dim=-1, dtype=torch.float).gather(-1, indices_NK)
    if getattr(router, "norm_topk_prob", False):
        top_NK = top_NK / top_NK.sum(dim=-1, keepdim=True)
    return logits_NE, top_NK.to(scores_NK.dtype), indices_NK
