"""Rollout routing replay (paper §3.5 "MoE consistency"; Ma et al., 2025): train on the engine's experts.

The engine returns, per request, the experts each token was routed to (vLLM: base64 `.npy`, shape
`(num_tokens - 1, num_layers, top_k)`; the last token was never forwarded). `decode_routed_experts`
turns that into a tensor aligned with the token trace. `RoutingReplay` then makes an MoE model use
exactly those experts while the expert weights are recomputed from the router's own current scores,
so gradients still reach the router. Rows marked -1 keep the router's own choice. Two kinds of router:

- transformers' `*TopKRouter` modules returning `(logits, scores, indices)` (Qwen3-MoE and relatives):
  a forward hook swaps in the recorded indices and redoes the router's arithmetic on them (softmax,
  gather, renormalise unless the router's `norm_topk_prob` is false).
- NeMo AutoModel's `Gate` (every AutoModel MoE model: DeepSeek-V3, Qwen3-MoE, GLM-4-MoE, ...): the gate
  itself passes its fresh top-k indices through `self.router_replay.apply(indices)` and gathers its
  weights from whatever comes back (`nemo_automodel.components.moe.router_replay`). We put a handle of
  our own in that slot for the duration of a block, so replay works whether or not the model was built
  with `MoEConfig.enable_routing_replay`, and AutoModel's process-global `RouterReplay` registry (one
  list for every model built in the process, in construction order) is neither used nor disturbed.

Shapes: `N` tokens as the routers see them (batch × sequence, flattened), `L` layers, `K` top-k,
`T` tokens of one trace. vLLM's routes have a column for every decoder layer, dense ones included
(their column is unused); replay takes either that or one column per router, and finds each router's
column by the decoder-layer index in its module name (`...layers.<i>...`). A model with neither kind
of router is refused at construction.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch


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


def _router_kind(module: torch.nn.Module) -> str | None:
    if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k"):
        return "transformers"
    if hasattr(module, "router_replay") and hasattr(module, "topk"):  # AutoModel's Gate and its subclasses
        return "automodel"
    return None


class _Tap:
    """One router's hook into its own top-k choice: record it (`want_NK` None) or replace it, counting
    the tokens whose recorded experts differ from the router's own (as sets)."""

    def __init__(self, want_NK: torch.Tensor | None = None) -> None:
        self.want_NK = want_NK
        self.seen: list[torch.Tensor] = []
        self.compared: torch.Tensor | int = 0  # tokens with a recorded route
        self.differed: torch.Tensor | int = 0  # of those, routed elsewhere by the router itself

    def apply(self, indices_NK: torch.Tensor) -> torch.Tensor:
        """The indices the router goes on with (AutoModel's Gate calls this by this name)."""
        if self.want_NK is None:
            self.seen.append(indices_NK.detach())
            return indices_NK
        if self.want_NK.shape != indices_NK.shape:
            raise ValueError(
                f"replay covers {tuple(self.want_NK.shape)} tokens×top_k, the router sees "
                f"{tuple(indices_NK.shape)}: align the recorded experts with the batch "
                "(same tokens, same order)"
            )
        want_NK = self.want_NK.to(indices_NK.device)
        known_N = (want_NK >= 0).all(-1)
        same_N = (want_NK.sort(-1).values == indices_NK.sort(-1).values).all(-1)
        self.compared = self.compared + known_N.sum()
        self.differed = self.differed + (known_N & ~same_N).sum()
        return torch.where(known_N[:, None], want_NK, indices_NK)


class RoutingReplay:
    """Record or replay the experts of every router of `model` (in module order = layer order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = [(name, module) for name, module in model.named_modules() if _router_kind(module)]
        self.routers = [module for _, module in named]
        if not self.routers:
            raise ValueError(
                f"{type(model).__name__} has no router to replay (transformers *TopKRouter or AutoModel Gate)"
            )
        # Each router's decoder layer (None where its name has no `layers.<i>`).
        self.layer_ids = [
            int(m[1]) if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name)) else None for name, _ in named
        ]
        self.recorded: torch.Tensor | None = None  # experts_NLK of the last `record()`
        # Of the last `replay()`: (token-layers routed elsewhere by the routers themselves, compared).
        self.mismatch: tuple[torch.Tensor | int, torch.Tensor | int] = (0, 0)

    @contextmanager
    def record(self) -> Iterator[RoutingReplay]:
        """Within the block, every forward's expert choices are appended to `self.recorded`."""
        taps = [_Tap() for _ in self.routers]
        with self._tapped(taps):
            yield self
        self.recorded = torch.stack([torch.cat(tap.seen) for tap in taps], dim=1) if taps[0].seen else None

    @contextmanager
    def replay(self, experts: torch.Tensor) -> Iterator[RoutingReplay]:
        """Within the block, routers use `experts` (`[N, L, K]` or `[B, T, L, K]`, -1 = router's choice);
        L is one column per router, or one per decoder layer (module docstring). After it, `mismatch`
        counts the (token, router) pairs whose router would have chosen other experts."""
        experts_NLK = experts.reshape(-1, *experts.shape[-2:]).long()
        num_layers = experts_NLK.shape[1]
        if num_layers != len(self.routers):
            if None in self.layer_ids or num_layers <= max(i for i in self.layer_ids if i is not None):
                raise ValueError(
                    f"replay has {num_layers} layers, the model has {len(self.routers)} routers in decoder "
                    f"layers {self.layer_ids}: give one column per router or one per decoder layer"
                )
            experts_NLK = experts_NLK[:, self.layer_ids]
        taps = [_Tap(experts_NLK[:, layer]) for layer in range(len(self.routers))]
        try:
            with self._tapped(taps):
                yield self
        finally:
            self.mismatch = (sum(tap.differed for tap in taps), sum(tap.compared for tap in taps))

    @contextmanager
    def _tapped(self, taps: list[_Tap]) -> Iterator[None]:
        with ExitStack() as undo:  # on the way out, every router as it was
            for router, tap in zip(self.routers, taps, strict=True):
                if _router_kind(router) == "automodel":
                    undo.callback(setattr, router, "router_replay", router.router_replay)
                    router.router_replay = tap
                else:
                    hook = router.register_forward_hook(lambda m, _a, out, tap=tap: _swap(m, out, tap))
                    undo.callback(hook.remove)
            yield


def _swap(router: torch.nn.Module, output: tuple, tap: _Tap) -> tuple | None:
    """Forward hook of a transformers router: its output with the tap's indices (None: unchanged)."""
    logits_NE, scores_NK, indices_NK = output
    chosen_NK = tap.apply(indices_NK)
    if chosen_NK is indices_NK:
        return None
    # Same arithmetic as the router's forward, on the chosen experts (weights keep their gradient).
    top_NK = torch.softmax(logits_NE, dim=-1, dtype=torch.float).gather(-1, chosen_NK)
    if getattr(router, "norm_topk_prob", True):  # a router without the flag always renormalises (Mixtral)
        top_NK = top_NK / top_NK.sum(dim=-1, keepdim=True)
    return logits_NE, top_NK.to(scores_NK.dtype), chosen_NK
