"""The modules molt swaps into a loaded policy: the same function as transformers' modules, less memory.

- `LeanRMSNorm`: RMSNorm in float32 that keeps its input in its own dtype for the backward;
- `LeanMLP`: a SwiGLU MLP that recomputes silu in the backward instead of keeping its output;
- `LogprobHead`: the LM head, able to give token logprobs and entropies instead of [B, T, V] logits;
- `LeanRotaryEmbedding`: AutoModel's rotary embedding, without reading a position back from the GPU.

`use_lean_modules` swaps them in, once, in `molt._sharding.load_model`; `print(model)` shows them. A
swap changes the class of the module object (to a subclass of its own class with the lean `forward`
first), never the object: FSDP2 keeps the module objects that hold its parameters and puts the gathered
parameters back on those objects before each forward (`ParamModuleInfo` in torch's `_fsdp_param.py`),
so a new module object swapped in after sharding would compute with stale, sharded weights. It is how
`fully_shard` itself makes `FSDP<class>`. Parameter names, objects and the state dict stay as they were.

Legend: B sequences, T tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from molt._batch import to_device
from molt.config import Config


@functools.cache
def _lean_class(lean: type, original: type) -> type:
    """`original` with `lean`'s forward: a subclass whose method resolution order puts `lean` first."""
    return type(f"{lean.__name__}[{original.__name__}]", (lean, original), {})


def _swap(modules: list[torch.nn.Module], lean: type) -> int:
    """Swap `lean` into each of `modules`; returns how many."""
    for module in modules:
        if not isinstance(module, lean):
            module.__class__ = _lean_class(lean, type(module))  # type: ignore[arg-type]  # a class is hashable
    return len(modules)


class LeanRMSNorm(torch.nn.Module):
    """transformers' RMSNorm (`weight`, `variance_epsilon`) in float32, rounded once after the weight.

    Same function, less memory: transformers' RMSNorm keeps a float32 copy of its input for the
    backward pass (at 16k tokens on a Qwen3-1.7B, about 12 GiB of activations); this keeps the input in
    its own dtype and recomputes the rest. It rounds once, after the weight, as vLLM's fused RMSNorm does.
    Eager, it runs AutoModel's float32 RMSNorm op (which AutoModel's own model classes use), whose
    backward keeps the input alone. Inside a compiled layer (`--actor.compile`) it is the formula
    itself, which Inductor fuses with its neighbours, and whose compiled backward keeps the same (the
    input, and the reciprocal RMS of each row): the op, opaque to Inductor, would run as three kernels
    over float32 copies (its cast, the norm, the cast back; 0.14 s of a 2.6 s step at 16k on an H100).
    A tensor-parallel DTensor goes through the op, which carries its sharding rule.
    """

    weight: torch.nn.Parameter
    variance_epsilon: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if torch.compiler.is_compiling() and not isinstance(x, DTensor):
            weight = self.weight.float()
            return torch.nn.functional.rms_norm(x.float(), weight.shape, weight, self.variance_epsilon).to(
                x.dtype
            )
        return torch.ops.nemo_automodel.float32_rms_norm(x, self.weight, self.variance_epsilon)


class LeanRotaryEmbedding(torch.nn.Module):
    """AutoModel's rotary embedding (`LlamaRotaryEmbedding`: its Llama, Qwen2 and Qwen3 models) with its
    float32 cos/sin tables sized without reading a position back from the device.

    Unfused, AutoModel's sizes the tables to the largest position it is given,
    `position_ids.max().item()`: on a GPU a synchronisation at the start of every forward (the host waits
    for the previous micro-batch's backward to finish, then the GPU for the host to queue this forward).
    Molt's positions count from 0 within each row and every layout holds whole rows (packed, padded or
    as shared-prefix trees), so each position is below the number of positions given: the tables are
    sized to that number instead, and gathered at the same positions (the same values)."""

    rope_fusion: bool
    _cos_cache: torch.Tensor
    _sin_cache: torch.Tensor

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, *, qkv_format: str = "bshd", cp_size: int = 1
    ) -> tuple[torch.Tensor, ...]:
        if self.rope_fusion or qkv_format != "bshd":  # these read nothing back, or are not Molt's
            return super().forward(x, position_ids, qkv_format=qkv_format, cp_size=cp_size)
        self._ensure_cache(position_ids.shape[-1], x.device)  # type: ignore[operator]  # AutoModel's
        return self._cos_cache[position_ids], self._sin_cache[position_ids]


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up for the backward and recomputing silu(gate) there."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * torch.nn.functional.silu(gate)
        return torch.ops.aten.silu_backward(grad * up, gate), grad_up


class LeanMLP(torch.nn.Module):
    """A SwiGLU MLP, `down(silu(gate(x)) * up(x))` (transformers' Qwen/Llama MLP), through one autograd
    function that keeps only silu's input and recomputes silu in the backward.

    Same numbers (the same ops, rounded the same way), less memory: autograd would also keep silu's
    output for the product's backward, one [tokens, intermediate] tensor per layer (at 16k tokens on a
    Qwen3-1.7B, 192 MiB a layer, 5.3 GiB in all), for one more elementwise pass in the backward.
    """

    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


class LogprobHead(torch.nn.Module):
    """A bias-free linear LM head that, inside `logprobs_of(next_tokens_BT)`, maps the final hidden states
    [B, T, H] to [B, T, 1], log p(next token) at each position at the sampling temperature, and leaves
    the entropy there [B, T] in `entropy_BT` (apart, so that a detached entropy sends no gradient back),
    both through `rlestimators.lm_head_logprobs`: the [B, T, V] logits and their gradient never exist (at
    16k tokens and a 152k vocabulary, 2 x 4.6 GiB in bf16). Outside the block it gives logits, as before.
    It runs inside the head's own call, where FSDP2 has gathered its weight (tied embeddings included).

    Given the positions whose logprobs are read (`logprobs_of(..., positions_N)`: those whose next token
    is trained), the head projects those alone: the rest come back 0, entropy too, and cost no head
    matmul, no pass over their [V] logits and no gradient. Prompts, tool outputs and earlier turns are
    most of an agent's tokens; the head is a sixth of a Qwen3-1.7B's matmuls and all of its float32
    passes over the vocabulary.

    The token ids are checked against the vocabulary by `check_ids`, on the host's copy, before the
    forward (`molt._rank.ModelRank._model_outputs`): checked on the GPU, they would be read back from
    it, a synchronisation in the middle of every forward."""

    weight: torch.nn.Parameter
    temperature: float = 1.0  # the sampling temperature, set by `use_logprob_head`
    next_tokens_BT: torch.Tensor | None = None  # set within `logprobs_of`
    positions_N: torch.Tensor | None = None  # set within `logprobs_of`: the flattened positions read
    entropy_BT: torch.Tensor | None = None  # the last forward's within `logprobs_of`

    def check_ids(self, tokens: torch.Tensor) -> None:
        """Refuse token ids outside the head's vocabulary (read where `tokens` are: the host's copy)."""
        vocab = self.weight.shape[0]
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"token ids must lie in [0, {vocab}), the model's vocabulary; these run from {low} to "
                f"{high}: is the tokenizer the model's own (--model.path)?"
            )

    @contextlib.contextmanager
    def logprobs_of(
        self, next_tokens_BT: torch.Tensor, positions_N: torch.Tensor | None = None
    ) -> Iterator[LogprobHead]:
        """Within the block, forwards give the logprobs of `next_tokens_BT` [B, T] (class docstring):
        at every position, or with `positions_N` (int64 indices into the flattened [B * T], at least one)
        at those alone, 0 elsewhere."""
        self.next_tokens_BT, self.positions_N = next_tokens_BT, positions_N
        try:
            yield self
        finally:  # drop the entropy too: it holds the forward's graph
            self.next_tokens_BT = self.positions_N = self.entropy_BT = None

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        from rlestimators import lm_head_logprobs

        if self.next_tokens_BT is None:
            return torch.nn.functional.linear(hidden_BTH, self.weight)
        if self.positions_N is None:
            logp_BT, self.entropy_BT = lm_head_logprobs(
                hidden_BTH,
                self.weight,
                self.next_tokens_BT,
                temperature=self.temperature,
                check_token_values=False,  # `check_ids`
            )
            return logp_BT[..., None].clone()  # not a view: FSDP2 refuses a root output that is one
        at_n = to_device(self.positions_N, hidden_BTH.device)
        hidden_1nH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[at_n][None]
        logp_1n, entropy_1n = lm_head_logprobs(
            hidden_1nH,
            self.weight,
            self.next_tokens_BT.reshape(-1)[at_n][None],
            temperature=self.temperature,
            check_token_values=False,  # `check_ids`
        )
        zeros_N = hidden_BTH.new_zeros(self.next_tokens_BT.numel(), dtype=torch.float32)
        self.entropy_BT = zeros_N.index_copy(0, at_n, entropy_1n[0]).view(self.next_tokens_BT.shape)
        return zeros_N.index_copy(0, at_n, logp_1n[0]).view(*self.next_tokens_BT.shape, 1).clone()


def use_lean_rms_norms(model: torch.nn.Module) -> int:
    """Swap `LeanRMSNorm` into transformers' RMSNorm layers; returns how many."""
    import nemo_automodel.components.models.common.utils  # noqa: F401 (registers the op)

    norms = [
        m for m in model.modules() if hasattr(m, "variance_epsilon") and type(m).__name__.endswith("RMSNorm")
    ]
    return _swap(norms, LeanRMSNorm)


def use_lean_rotary_embeddings(model: torch.nn.Module) -> int:
    """Swap `LeanRotaryEmbedding` into AutoModel's rotary embeddings (transformers' own read no position
    back); returns how many."""
    from nemo_automodel.components.models.llama.rope_utils import LlamaRotaryEmbedding

    rotary = [m for m in model.modules() if isinstance(m, LlamaRotaryEmbedding)]
    return _swap(rotary, LeanRotaryEmbedding)


def use_lean_mlps(model: torch.nn.Module) -> int:
    """Swap `LeanMLP` into SwiGLU MLPs (transformers' Qwen/Llama MLP); returns how many."""
    mlps = [
        m
        for m in model.modules()
        if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj"))
        and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    ]
    return _swap(mlps, LeanMLP)


def use_logprob_head(model: torch.nn.Module, config: Config) -> LogprobHead | None:
    """Swap `LogprobHead` into the policy's LM head at the sampling temperature; returns it. None (not
    swapped) under tensor parallelism, whose plans shard the head over the vocabulary, or for a head that
    is not a bias-free linear layer."""
    causal_lm: Any = model  # transformers' or AutoModel's: each has `get_output_embeddings`
    head = causal_lm.get_output_embeddings()
    if config.fsdp.tp_size > 1 or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    _swap([head], LogprobHead)
    head.temperature = config.rollout.temperature
    return head


def use_lean_modules(model: torch.nn.Module, config: Config) -> None:
    """Every swap of this module, applied to a loaded policy (`molt._sharding.load_model`)."""
    use_lean_rms_norms(model)
    use_lean_rotary_embeddings(model)
    if config.fsdp.tp_size == 1:  # under TP the projections' outputs may be DTensors: left as they are
        use_lean_mlps(model)
    use_logprob_head(model, config)
