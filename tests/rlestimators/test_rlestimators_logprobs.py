"""token_logprobs and entropy_from_logits against the naive float32 computation, across dtypes,
temperatures and chunkings; and a check that neither pass creates a float32 tensor of the whole logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlestimators import _logprobs, entropy_from_logits, token_logprobs

NUM_SEQS, NUM_TOKENS, VOCAB = 3, 5, 37


def naive_logprobs(logits_BTV, tokens_BT, temperature=1.0):
    flat_NV = (logits_BTV.float() / temperature).flatten(0, 1)
    return -F.cross_entropy(flat_NV, tokens_BT.flatten(), reduction="none").view(tokens_BT.shape)


def naive_entropy(logits_BTV, temperature=1.0):
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(dim=-1)


def make_inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits_BTV = (4 * torch.randn(NUM_SEQS, NUM_TOKENS, VOCAB, generator=generator)).to(dtype)
    tokens_BT = torch.randint(0, VOCAB, (NUM_SEQS, NUM_TOKENS), generator=generator)
    weights_BT = torch.randn(NUM_SEQS, NUM_TOKENS, generator=generator)
    return logits_BTV, tokens_BT, weights_BT


def value_and_grad(fn, logits_BTV, weights_BT, *args, **kwargs):
    leaf_BTV = logits_BTV.detach().requires_grad_(True)
    out_BT = fn(leaf_BTV, *args, **kwargs)
    (out_BT * weights_BT).sum().backward()
    return out_BT.detach(), leaf_BTV.grad


def set_chunk_rows(monkeypatch, rows):
    monkeypatch.setattr(_logprobs, "_CHUNK_BYTES", rows * 4 * VOCAB)


def assert_grad_close(grad, reference, dtype):
    # Gradients are rounded to the logits' dtype; the reference once, token_logprobs' bf16/fp16 path up to
    # ~1.5 ulp (p and its coefficient are rounded separately). Elementwise within 3 eps, on the whole
    # within 1 eps.
    eps = torch.finfo(dtype).eps
    assert_close(grad.float(), reference.float(), rtol=3 * eps, atol=1e-6)
    assert ((grad.float() - reference.float()).norm() / reference.float().norm()).item() < max(eps, 1e-6)


DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]
TEMPERATURES = [pytest.param(1.0, id="T1"), pytest.param(0.7, id="T0.7")]
CHUNK_ROWS = [
    pytest.param(1, id="1-row-chunks"),
    pytest.param(4, id="4-row-chunks"),
    pytest.param(10_000, id="one-chunk"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_rows", CHUNK_ROWS)
def test_token_logprobs_matches_naive_value_and_gradient(monkeypatch, dtype, temperature, chunk_rows):
    set_chunk_rows(monkeypatch, chunk_rows)
    logits_BTV, tokens_BT, weights_BT = make_inputs(dtype)
    logp_BT, grad_BTV = value_and_grad(
        token_logprobs, logits_BTV, weights_BT, tokens_BT, temperature=temperature
    )
    ref_BT, ref_grad_BTV = value_and_grad(naive_logprobs, logits_BTV, weights_BT, tokens_BT, temperature)
    assert logp_BT.dtype == torch.float32 and logp_BT.shape == tokens_BT.shape
    assert_close(logp_BT, ref_BT, rtol=1e-6, atol=1e-6)
    assert grad_BTV.dtype == dtype
    assert_grad_close(grad_BTV, ref_grad_BTV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_rows", CHUNK_ROWS)
def test_entropy_matches_naive_value_and_gradient(monkeypatch, dtype, temperature, chunk_rows):
    set_chunk_rows(monkeypatch, chunk_rows)
    logits_BTV, _, weights_BT = make_inputs(dtype, seed=1)
    entropy_BT, grad_BTV = value_and_grad(
        entropy_from_logits, logits_BTV, weights_BT, temperature=temperature
    )
    ref_BT, ref_grad_BTV = value_and_grad(naive_entropy, logits_BTV, weights_BT, temperature)
    assert_close(entropy_BT, ref_BT, rtol=1e-5, atol=1e-5)
    assert_grad_close(grad_BTV, ref_grad_BTV, dtype)


def test_entropy_of_uniform_and_of_masked_vocabulary():
    uniform_BTV = torch.zeros(1, 1, 8)
    assert_close(entropy_from_logits(uniform_BTV), torch.log(torch.tensor([[8.0]])))
    # -inf logits (a masked vocabulary) have p = 0 and contribute 0, not NaN, forward and backward.
    masked_BTV = torch.tensor([[[0.0, 0.0, -torch.inf, -torch.inf]]], requires_grad=True)
    entropy_BT = entropy_from_logits(masked_BTV)
    entropy_BT.sum().backward()
    assert_close(entropy_BT, torch.log(torch.tensor([[2.0]])))
    assert torch.isfinite(masked_BTV.grad).all()


def test_non_contiguous_logits_and_no_grad():
    logits_BTV, tokens_BT, _ = make_inputs(torch.float32)
    shifted_BTV = logits_BTV[:, :-1]
    assert not shifted_BTV.is_contiguous()
    with torch.no_grad():
        logp_BT = token_logprobs(shifted_BTV, tokens_BT[:, 1:])
    assert_close(logp_BT, naive_logprobs(shifted_BTV, tokens_BT[:, 1:]))
    assert not logp_BT.requires_grad


class LargestFloat32Storage(TorchDispatchMode):
    """Largest float32 storage (in elements) among the outputs of every op run under this mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes() // 4)
        return out


def largest_float32(fn, logits_BTV, *args, **kwargs):
    """Largest float32 storage created in the forward pass and, separately, in the backward pass."""
    leaf_BTV = logits_BTV.detach().requires_grad_(True)
    with LargestFloat32Storage() as forward:
        out_BT = fn(leaf_BTV, *args, **kwargs)
    loss = (out_BT * torch.ones_like(out_BT)).sum()
    with LargestFloat32Storage() as backward:
        loss.backward()
    return forward.largest, backward.largest


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_no_float32_copy_of_the_logits_forward_or_backward(monkeypatch, temperature):
    chunk_rows = 2
    set_chunk_rows(monkeypatch, chunk_rows)
    logits_BTV, tokens_BT, _ = make_inputs(torch.bfloat16)
    whole = NUM_SEQS * NUM_TOKENS * VOCAB
    # The instrument sees the naive version's float32 [B, T, V] tensors in both passes.
    assert largest_float32(naive_logprobs, logits_BTV, tokens_BT, temperature) == (whole, whole)
    for fn, args in ((token_logprobs, (tokens_BT,)), (entropy_from_logits, ())):
        forward, backward = largest_float32(fn, logits_BTV, *args, temperature=temperature)
        assert forward <= chunk_rows * VOCAB and backward <= chunk_rows * VOCAB, fn.__name__


@pytest.mark.parametrize(
    ("logits", "tokens", "temperature", "message"),
    [
        pytest.param(
            torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.int64), 1.0, "tokens must be", id="shape"
        ),
        pytest.param(
            torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64), 1.0, r"\[B, T, V\]", id="2d-logits"
        ),
        pytest.param(
            torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.int64), 1.0, "non-empty", id="empty"
        ),
        pytest.param(torch.zeros(1, 2, 5), torch.tensor([[0, 5]]), 1.0, r"\[0, 5\)", id="id-too-large"),
        pytest.param(torch.zeros(1, 2, 5), torch.tensor([[-1, 0]]), 1.0, r"\[0, 5\)", id="negative-id"),
        pytest.param(torch.zeros(1, 2, 5), torch.zeros(1, 2), 1.0, "integer", id="float-ids"),
        pytest.param(
            torch.zeros(1, 2, 5, dtype=torch.int64),
            torch.zeros(1, 2, dtype=torch.int64),
            1.0,
            "floating",
            id="int-logits",
        ),
        pytest.param(
            torch.zeros(1, 2, 5),
            torch.zeros(1, 2, dtype=torch.int64),
            0.0,
            "temperature",
            id="zero-temperature",
        ),
        pytest.param(
            torch.zeros(1, 2, 5),
            torch.zeros(1, 2, dtype=torch.int64),
            float("inf"),
            "temperature",
            id="inf-temperature",
        ),
    ],
)
def test_token_logprobs_refuses_bad_input(logits, tokens, temperature, message):
    with pytest.raises(ValueError, match=message):
        token_logprobs(logits, tokens, temperature=temperature)


def test_entropy_refuses_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        entropy_from_logits(torch.zeros(2, 0, 5))


@pytest.mark.gpu
def test_token_logprobs_on_cuda_bf16_matches_naive():
    logits_BTV, tokens_BT, weights_BT = (t.cuda() for t in make_inputs(torch.bfloat16))
    logp_BT, grad_BTV = value_and_grad(token_logprobs, logits_BTV, weights_BT, tokens_BT)
    ref_BT, ref_grad_BTV = value_and_grad(naive_logprobs, logits_BTV, weights_BT, tokens_BT)
    assert_close(logp_BT, ref_BT, rtol=1e-6, atol=1e-6)
    assert_grad_close(grad_BTV, ref_grad_BTV, torch.bfloat16)
