"""Per-token log-probabilities and entropies from [B, T, V] logits, chunked over rows in both directions.

Why: a float32 copy of full-vocabulary logits is the largest tensor of an RL step (8k tokens x 152k vocab
= 5 GB, plus as much again for log_softmax's output and for each gradient buffer) and a common cause of
OOM. Here each chunk of rows is upcast to float32, reduced, and dropped; the backward pass is a custom
autograd function that recomputes each chunk's softmax from the saved (low-precision) logits instead of
saving float32 probabilities. The only [B, T, V] tensor either pass creates is the gradient of the logits,
in their own dtype. Plain eager ops (no compiler, no custom kernel), so it runs on any device. Temperature
is applied in float32 before the softmax, as the engine does when it returns processed logprobs (DESIGN §1,
invariant 3).

Refuses: non-finite temperature, token ids outside the vocabulary (one device synchronisation checks
them, rather than a device-side assert that kills the CUDA context), and double backward.

Legend: B sequences, T tokens, V vocabulary, N = B * T rows, C rows in one chunk.
"""

import torch
from torch.autograd.function import once_differentiable

from rlestimators._checks import check_floating

# Bytes of one float32 [C, V] chunk buffer; at most 2 are alive at once, whatever B * T. 256 MiB is 441
# rows of a 152k vocabulary. On an H200 (8k x 152k bf16 logits) the forward then takes 1.04x the naive
# time; 1.06x at 128 MiB, 1.2x at 64 MiB (launch-bound). Measured with bench/token_logprobs.py.
_CHUNK_BYTES = 256 * 2**20


def _chunks(num_rows: int, vocab: int, *, head: bool = False, entry_bytes: int = 4):
    """Row slices, each a [C, V] chunk (float32, or of `entry_bytes` an entry) of at most `_CHUNK_BYTES`;
    with `head`, of at most `_HEAD_CHUNK_BYTES` and C a multiple of 128 rows (`lm_head_logprobs`: whole
    matmul tiles)."""
    tile = 128 if head else 1
    limit = _HEAD_CHUNK_BYTES if head else _CHUNK_BYTES
    rows_per_chunk = max(tile, limit // (entry_bytes * vocab) // tile * tile)
    for start in range(0, num_rows, rows_per_chunk):
        yield slice(start, start + rows_per_chunk)


def _scaled_f32(logits_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32; at temperature 1, float32 logits come back as they are (no copy)."""
    if logits_CV.dtype == torch.float32:
        return logits_CV if temperature == 1.0 else logits_CV / temperature
    z_CV = logits_CV.float()
    return z_CV if temperature == 1.0 else z_CV.div_(temperature)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, tokens_N1, temperature):
        logp_N1 = logits_NV.new_empty(tokens_N1.shape, dtype=torch.float32)
        for rows in _chunks(*logits_NV.shape):
            z_CV = _scaled_f32(logits_NV[rows], temperature)
            torch.gather(torch.log_softmax(z_CV, dim=-1), 1, tokens_N1[rows], out=logp_N1[rows])
            del z_CV  # so that at most two [C, V] buffers are alive: z and log_softmax(z)
        ctx.save_for_backward(logits_NV, tokens_N1, logp_N1)
        ctx.temperature = temperature
        return logp_N1

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N1):
        logits_NV, tokens_N1, logp_N1 = ctx.saved_tensors
        temperature = ctx.temperature
        # d log p_y / d logits_v = (1[v == y] - p_v) / temperature
        coef_N1 = grad_N1.float() / temperature
        # At temperature 1, softmax reads the chunk in the logits' dtype, accumulates in float32 and rounds
        # p once, with no float32 chunk: on an H200 this halves the backward time. The gradient then differs
        # from the float32 reference by ~1.5 ulp of its dtype instead of 0.5. At another temperature
        # z = logits / T must be formed in float32: rounding z to bf16 would move p by up to |z| * 2^-8.
        low_precision = temperature == 1.0
        neg_coef_N1 = (-coef_N1).to(logits_NV.dtype if low_precision else torch.float32)
        # The sampled token's entry, coef * (1 - p_y), from the saved float32 logp: one rounding only.
        target_N1 = (coef_N1 * -torch.expm1(logp_N1)).to(logits_NV.dtype)
        grad_logits_NV = torch.empty_like(logits_NV)
        for rows in _chunks(*logits_NV.shape):
            z_CV = logits_NV[rows] if low_precision else _scaled_f32(logits_NV[rows], temperature)
            torch.mul(torch.softmax(z_CV, dim=-1), neg_coef_N1[rows], out=grad_logits_NV[rows])
            grad_logits_NV[rows].scatter_(1, tokens_N1[rows], target_N1[rows])
            del z_CV
        return grad_logits_NV, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, temperature):
        entropy_N = logits_NV.new_empty(logits_NV.shape[0], dtype=torch.float32)
        for rows in _chunks(*logits_NV.shape):
            probs_CV = torch.softmax(_scaled_f32(logits_NV[rows], temperature), dim=-1)
            # entr(p) = -p log p, and 0 where p == 0 (a -inf logit), where p * log_softmax would give NaN.
            entropy_N[rows] = torch.special.entr(probs_CV).sum(dim=-1)
        ctx.save_for_backward(logits_NV, entropy_N)
        ctx.temperature = temperature
        return entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N):
        logits_NV, entropy_N = ctx.saved_tensors
        temperature = ctx.temperature
        coef_N1 = grad_N.float()[:, None] / temperature
        grad_logits_NV = torch.empty_like(logits_NV)
        for rows in _chunks(*logits_NV.shape):
            probs_CV = torch.softmax(_scaled_f32(logits_NV[rows], temperature), dim=-1)
            # dH/dz_v = -p_v (log p_v + H) = entr(p_v) - p_v * H, in float32: the two terms nearly cancel
            # where log p_v is close to -H, so rounding p to bf16 first would lose the difference.
            dh_dz_CV = torch.special.entr(probs_CV).sub_(probs_CV.mul_(entropy_N[rows, None]))
            torch.mul(dh_dz_CV, coef_N1[rows], out=grad_logits_NV[rows])
        return grad_logits_NV, None


def _check_logits(logits: torch.Tensor, temperature: float, name: str = "logits", dims: str = "[B, T, V]"):
    """A non-empty floating [B, T, V] `logits` (or what `name` and `dims` say) and a sane temperature."""
    if logits.dim() != 3 or logits.numel() == 0:
        raise ValueError(f"{name} must be a non-empty {dims} tensor, got shape {tuple(logits.shape)}")
    check_floating(**{name: logits})
    if not (0.0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def _check_tokens(
    tokens: torch.Tensor, shape: torch.Size, vocab: int, source: str, *, values: bool = True
) -> None:
    """Integer ids [B, T] = `shape` in [0, `vocab`) (one device synchronisation; none without `values`,
    which checks the shape and dtype alone), from `source`'s shapes."""
    if tokens.shape != shape:
        raise ValueError(
            f"tokens must be [B, T] = {tuple(shape)} to match the {source}, got {tuple(tokens.shape)}"
        )
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids, got {tokens.dtype}")
    if values and bool(((tokens < 0) | (tokens >= vocab)).any()):
        raise ValueError(f"token ids must lie in [0, {vocab}) (the vocabulary of the {source}); some do not")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token] per position: [B, T, V] logits, [B, T] ids -> [B, T] float32.

    Equals `-cross_entropy(logits.float() / temperature, tokens, reduction="none")` without ever holding a
    float32 copy of the whole logits, forward or backward (module docstring). Any floating dtype works
    (bf16 is the intended one); gradients flow to `logits`, in their dtype (at temperature 1 within ~1.5 ulp
    of the float32 reference, see the backward pass). Pass contiguous logits: a non-contiguous tensor, such
    as `logits[:, :-1]`, is copied once in its own dtype; shift the tokens instead and mask the last
    position. Temperature must match the engine's sampling temperature (DESIGN §1). Checking the token ids
    costs one device synchronisation.
    """
    _check_logits(logits, temperature)
    vocab = logits.shape[-1]
    _check_tokens(tokens, logits.shape[:-1], vocab, "logits")
    logp_N1 = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), tokens.reshape(-1, 1).long(), float(temperature)
    )
    return logp_N1.view(tokens.shape)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: [B, T, V] -> [B, T] float32, in nats.

    H = -sum_v p_v log p_v, chunked over rows like `token_logprobs` (no float32 [B, T, V] copy, forward or
    backward); gradients flow to `logits` (dH/dz_v = -p_v (log p_v + H) / temperature), so it serves both
    as a logged metric and as an entropy bonus. Reduce it with `masked_sum`.
    """
    _check_logits(logits, temperature)
    entropy_N = _Entropy.apply(logits.reshape(-1, logits.shape[-1]), float(temperature))
    return entropy_N.view(logits.shape[:-1])


# --- from the LM head's input: the [B, T, V] logits never exist ---

# Bytes of one float32 [C, V] chunk of `lm_head_logprobs`. Each chunk is also one [C, H] x [H, V] matmul,
# so C is a multiple of 128 rows (whole matmul tiles, `_chunks`).
_HEAD_CHUNK_BYTES = 512 * 2**20


def _chunk_logp(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature) of one chunk, [C, V] float32. The logits are rounded to
    the weights' dtype first, as the linear layer itself gives them (and as the engine computes them)."""
    return torch.log_softmax(_scaled_f32(hidden_CH @ weight_VH.T, temperature), dim=-1)


def _add_matmul_f32(out_f32: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, accumulated in float32 whatever the dtype of a and b (one rounding at the end)."""
    if a.dtype == torch.float32:
        out_f32.addmm_(a, b)
    elif a.is_cuda:  # the matmul writes float32 itself: no low-precision partial sums
        torch.addmm(out_f32, a, b, out_dtype=torch.float32, out=out_f32)
    else:
        out_f32.add_((a @ b).float())


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, tokens_N1, temperature):
        num_rows, vocab = hidden_NH.shape[0], weight_VH.shape[0]
        logp_N1 = hidden_NH.new_empty((num_rows, 1), dtype=torch.float32)
        entropy_N1 = hidden_NH.new_empty((num_rows, 1), dtype=torch.float32)
        for rows in _chunks(num_rows, vocab, head=True):
            logp_CV = _chunk_logp(hidden_NH[rows], weight_VH, temperature)
            torch.gather(logp_CV, 1, tokens_N1[rows], out=logp_N1[rows])
            # H = -sum_v p_v log p_v: entr(p) is 0 where p is 0 (no 0 * -inf).
            torch.sum(torch.special.entr(logp_CV.exp_()), dim=-1, keepdim=True, out=entropy_N1[rows])
            del logp_CV
        ctx.save_for_backward(hidden_NH, weight_VH, tokens_N1, logp_N1, entropy_N1)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp_N1, entropy_N1

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp_N1, grad_entropy_N1):
        hidden_NH, weight_VH, tokens_N1, logp_N1, entropy_N1 = ctx.saved_tensors
        temperature = ctx.temperature
        num_rows, vocab = hidden_NH.shape[0], weight_VH.shape[0]
        g_logp_N1 = torch.zeros_like(logp_N1) if grad_logp_N1 is None else grad_logp_N1.float()
        # The usual case, the logprobs' gradient alone at temperature 1, as `token_logprobs`: softmax reads
        # the logits in their dtype (accumulating in float32) and its product with the coefficient is the
        # logit gradient, two passes over a low-precision chunk. Otherwise all of it in float32.
        low_precision = grad_entropy_N1 is None and temperature == 1.0
        if low_precision:
            neg_coef_N1 = (-g_logp_N1).to(hidden_NH.dtype)
            # The sampled token's entry, g_logp * (1 - p_y), from the saved float32 log p_y: one rounding.
            target_N1 = (g_logp_N1 * -torch.expm1(logp_N1)).to(hidden_NH.dtype)
        grad_hidden_NH = torch.empty_like(hidden_NH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        # The forward holds two float32 [C, V] at once (the logits, their log-softmax), the low-precision
        # backward two in the logits' dtype (the logits, their softmax): in bf16, chunks of twice the
        # rows for the same bytes, and half the weight gradient's accumulations, each a read and write of
        # the float32 [V, H] (at 768-row chunks, 78 ms of a 2.6 s step of 16k-token rows on one H100).
        entry_bytes = hidden_NH.element_size() if low_precision else 4
        for rows in _chunks(num_rows, vocab, head=True, entry_bytes=entry_bytes):
            if low_precision:
                grad_z_CV = torch.softmax(hidden_NH[rows] @ weight_VH.T, dim=-1).mul_(neg_coef_N1[rows])
                grad_z_CV.scatter_(1, tokens_N1[rows], target_N1[rows])
            else:
                logp_CV = _chunk_logp(hidden_NH[rows], weight_VH, temperature)
                p_CV = torch.exp(logp_CV)
                # dz_v = [g_logp (1[v == y] - p_v) - g_H p_v (log p_v + H)] / temperature
                if grad_entropy_N1 is None:
                    grad_z_CV = p_CV.mul_(-g_logp_N1[rows])
                else:
                    grad_z_CV = logp_CV.add_(entropy_N1[rows]).mul_(grad_entropy_N1[rows].float())
                    grad_z_CV = grad_z_CV.add_(g_logp_N1[rows]).mul_(p_CV).neg_()
                del logp_CV, p_CV
                grad_z_CV.scatter_add_(1, tokens_N1[rows], g_logp_N1[rows])
                grad_z_CV = grad_z_CV.div_(temperature).to(hidden_NH.dtype)
            if grad_hidden_NH is not None:
                torch.mm(grad_z_CV, weight_VH, out=grad_hidden_NH[rows])
            if grad_weight_VH is not None:
                _add_matmul_f32(grad_weight_VH, grad_z_CV.T, hidden_NH[rows])
            del grad_z_CV
        grad_weight_VH = None if grad_weight_VH is None else grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_NH, grad_weight_VH, None, None


def lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    check_token_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs and entropies straight from the LM head's input: [B, T, H] hidden states, the head's
    [V, H] weight and [B, T] token ids -> (log p(token), entropy), both [B, T] float32.

    The same numbers as `token_logprobs` and `entropy_from_logits` of `hidden @ weight.T` (logits rounded
    to the weight's dtype, then float32), but the [B, T, V] logits are never held, forward or backward:
    each chunk of rows is projected, reduced and dropped, and the backward projects it again (one more
    head matmul) to form that chunk's logit gradient. At 16k tokens and a 152k vocabulary that is the
    logits and their gradient, 2 x 4.6 GiB in bf16. Gradients flow to `hidden` and `weight` (the weight's
    accumulated in float32 over the chunks, rounded once) from either output; an unused output costs none.

    Checking that the token ids lie in the vocabulary reads a value back from the device, a
    synchronisation: the GPU runs dry while the host waits, and again while it queues the head's work.
    `check_token_values=False` skips that check (shapes and dtypes are still checked), for a caller that
    has checked the ids already, on the host.
    """
    _check_logits(hidden, temperature, "hidden", "[B, T, H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = {hidden.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:  # so the weight is floating too
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    _check_tokens(tokens, hidden.shape[:-1], weight.shape[0], "LM head", values=check_token_values)
    logp_N1, entropy_N1 = _HeadLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, tokens.reshape(-1, 1).long(), float(temperature)
    )
    return logp_N1.view(tokens.shape), entropy_N1.view(tokens.shape)
