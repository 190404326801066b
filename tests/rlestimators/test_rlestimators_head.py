"""lm_head_logprobs: token logprobs and entropies from the LM head's input equal those of its logits (values
and gradients to the hidden states and the weight), across dtypes, temperatures and chunkings, and no
tensor of the whole [N, V] logits is created in either pass."""

import pytest
import torch
from host_reads import ValuesReadBack
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlestimators import _logprobs, entropy_from_logits, lm_head_logprobs, token_logprobs

NUM_SEQS, NUM_TOKENS, HIDDEN, VOCAB = 2, 150, 24, 301  # 300 rows: three chunks of 128 rows at the least


def make_inputs(dtype, seed=0, num_seqs=NUM_SEQS):
    generator = torch.Generator().manual_seed(seed)
    hidden_BTH = torch.randn(num_seqs, NUM_TOKENS, HIDDEN, generator=generator).to(dtype)
    weight_VH = (0.5 * torch.randn(VOCAB, HIDDEN, generator=generator)).to(dtype)
    tokens_BT = torch.randint(0, VOCAB, (num_seqs, NUM_TOKENS), generator=generator)
    g_logp_BT, g_entropy_BT = torch.randn(2, num_seqs, NUM_TOKENS, generator=generator)
    return hidden_BTH, weight_VH, tokens_BT, g_logp_BT, g_entropy_BT


def through_the_logits(hidden_BTH, weight_VH, tokens_BT, temperature):
    """The reference: the head's logits, then the logits' functions (themselves tested against naive)."""
    logits_BTV = hidden_BTH @ weight_VH.T
    logp_BT = token_logprobs(logits_BTV, tokens_BT, temperature=temperature)
    return logp_BT, entropy_from_logits(logits_BTV, temperature=temperature)


def values_and_grads(fn, hidden_BTH, weight_VH, tokens_BT, g_logp_BT, g_entropy_BT, temperature):
    hidden_BTH, weight_VH = (t.detach().requires_grad_(True) for t in (hidden_BTH, weight_VH))
    logp_BT, entropy_BT = fn(hidden_BTH, weight_VH, tokens_BT, temperature=temperature)
    loss = 0.0
    if g_logp_BT is not None:
        loss = loss + (logp_BT * g_logp_BT).sum()
    if g_entropy_BT is not None:
        loss = loss + (entropy_BT * g_entropy_BT).sum()
    loss.backward()
    return logp_BT.detach(), entropy_BT.detach(), hidden_BTH.grad, weight_VH.grad


def set_chunk_rows(monkeypatch, rows):
    monkeypatch.setattr(_logprobs, "_HEAD_CHUNK_BYTES", rows * 4 * VOCAB)


def relative_error(value, reference):
    return ((value.double() - reference.double()).norm() / reference.double().norm()).item()


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("chunk_rows", [128, 10_000], ids=["128-row-chunks", "one-chunk"])
@pytest.mark.parametrize("used", ["both", "logp", "entropy"])
def test_equals_the_logits_path_in_value_and_gradient(
    monkeypatch, dtype, tolerance, temperature, chunk_rows, used
):
    set_chunk_rows(monkeypatch, chunk_rows)
    hidden_BTH, weight_VH, tokens_BT, g_logp_BT, g_entropy_BT = make_inputs(dtype)
    g_logp_BT = None if used == "entropy" else g_logp_BT
    g_entropy_BT = None if used == "logp" else g_entropy_BT
    args = (hidden_BTH, weight_VH, tokens_BT, g_logp_BT, g_entropy_BT, temperature)
    logp_BT, entropy_BT, grad_hidden, grad_weight = values_and_grads(lm_head_logprobs, *args)
    ref_logp_BT, ref_entropy_BT, ref_grad_hidden, ref_grad_weight = values_and_grads(
        through_the_logits, *args
    )
    assert logp_BT.dtype == entropy_BT.dtype == torch.float32 and logp_BT.shape == tokens_BT.shape
    # Forward: the same rounded logits, the same float32 reductions.
    assert_close(logp_BT, ref_logp_BT, rtol=1e-5, atol=1e-5)
    assert_close(entropy_BT, ref_entropy_BT, rtol=1e-5, atol=1e-5)
    # Backward: both round each logit gradient to the dtype before the matmuls; the matmuls' sums differ.
    assert grad_hidden.dtype == grad_weight.dtype == dtype
    assert relative_error(grad_hidden, ref_grad_hidden) < tolerance
    assert relative_error(grad_weight, ref_grad_weight) < tolerance


def test_the_weight_gradient_is_summed_in_float32_over_chunks(monkeypatch):
    """bf16 inputs, 24 chunks: the weight's gradient is as close to the float64 gradient as the one-matmul
    logits path gets (a sum kept in bf16 over the chunks is not)."""
    set_chunk_rows(monkeypatch, 128)
    hidden_BTH, weight_VH, tokens_BT, g_logp_BT, g_entropy_BT = make_inputs(torch.bfloat16, 3, num_seqs=20)
    args = (tokens_BT, g_logp_BT.double(), g_entropy_BT.double(), 1.0)
    *_, exact_grad_weight = values_and_grads(
        through_the_logits, hidden_BTH.double(), weight_VH.double(), *args
    )
    *_, grad_weight = values_and_grads(lm_head_logprobs, hidden_BTH, weight_VH, *args)
    *_, ref_grad_weight = values_and_grads(through_the_logits, hidden_BTH, weight_VH, *args)
    assert relative_error(grad_weight, exact_grad_weight) <= 1.1 * relative_error(
        ref_grad_weight, exact_grad_weight
    )


class LargestVocabularyTensor(TorchDispatchMode):
    """Largest number of rows, and of bytes, of any op output whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.rows = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[-1] == VOCAB:
                self.rows = max(self.rows, tensor.numel() // VOCAB)
                self.bytes = max(self.bytes, tensor.numel() * tensor.element_size())
        return out


@pytest.mark.parametrize(("used", "backward_rows"), [("both", 128), ("logp", 256)])
def test_no_tensor_of_the_whole_logits_forward_or_backward(monkeypatch, used, backward_rows):
    """Chunks of 128 rows; the bf16 backward of the logprobs alone holds the logits and their softmax in
    bf16 where the forward's chunks hold float32: twice the rows a chunk in the same bytes, so half the
    float32 accumulations of the weight's gradient."""
    set_chunk_rows(monkeypatch, 128)
    hidden_BTH, weight_VH, tokens_BT, g_logp_BT, g_entropy_BT = make_inputs(torch.bfloat16)
    hidden_BTH.requires_grad_(True)
    with LargestVocabularyTensor() as forward:
        logp_BT, entropy_BT = lm_head_logprobs(hidden_BTH, weight_VH.requires_grad_(True), tokens_BT)
    loss = (logp_BT * g_logp_BT).sum() + ((entropy_BT * g_entropy_BT).sum() if used == "both" else 0.0)
    with LargestVocabularyTensor() as backward:
        loss.backward()
    # The weight and its gradient ([V, H]) have V as their first dimension, not their last.
    assert (forward.rows, backward.rows) == (128, backward_rows)
    assert backward.bytes <= forward.bytes
    with LargestVocabularyTensor() as logits_path:  # the instrument sees the logits path's [N, V] tensors
        through_the_logits(hidden_BTH, weight_VH, tokens_BT, 1.0)
    assert logits_path.rows == NUM_SEQS * NUM_TOKENS


@pytest.mark.parametrize(
    ("hidden", "weight", "tokens", "temperature", "message"),
    [
        pytest.param(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.int64), 1.0,
                     r"\[B, T, H\]", id="2d-hidden"),
        pytest.param(torch.zeros(1, 2, 3), torch.zeros(5, 4), torch.zeros(1, 2, dtype=torch.int64), 1.0,
                     r"\[V, H\] with H = 3", id="weight-width"),
        pytest.param(torch.zeros(1, 2, 3), torch.zeros(5, 3, dtype=torch.float64),
                     torch.zeros(1, 2, dtype=torch.int64), 1.0, "share a dtype", id="dtypes"),
        pytest.param(torch.zeros(1, 2, 3), torch.zeros(5, 3), torch.zeros(1, 3, dtype=torch.int64), 1.0,
                     "tokens must be", id="tokens-shape"),
        pytest.param(torch.zeros(1, 2, 3), torch.zeros(5, 3), torch.tensor([[0, 5]]), 1.0, r"\[0, 5\)",
                     id="id-too-large"),
        pytest.param(torch.zeros(1, 2, 3), torch.zeros(5, 3), torch.zeros(1, 2), 1.0, "integer",
                     id="float-ids"),
        pytest.param(torch.zeros(1, 2, 3), torch.zeros(5, 3), torch.zeros(1, 2, dtype=torch.int64), 0.0,
                     "temperature", id="zero-temperature"),
    ],
)  # fmt: skip
def test_refuses_bad_input(hidden, weight, tokens, temperature, message):
    with pytest.raises(ValueError, match=message):
        lm_head_logprobs(hidden, weight, tokens, temperature=temperature)


def test_ids_checked_by_the_caller_are_not_read_back_but_shapes_are_still_checked():
    hidden_BTH, weight_VH, tokens_BT, *_ = make_inputs(torch.float32)
    with ValuesReadBack() as checked:
        lm_head_logprobs(hidden_BTH, weight_VH, tokens_BT)
    with ValuesReadBack() as unchecked:
        lm_head_logprobs(hidden_BTH, weight_VH, tokens_BT, check_token_values=False)
    assert (checked.reads, unchecked.reads) == (1, 0)
    with pytest.raises(ValueError, match="tokens must be"):
        lm_head_logprobs(hidden_BTH, weight_VH, tokens_BT[:, 1:], check_token_values=False)
    with pytest.raises(ValueError, match=r"\[0, 301\)"):
        lm_head_logprobs(hidden_BTH, weight_VH, tokens_BT + VOCAB)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
def test_on_cuda_bf16_equals_the_logits_path(monkeypatch, temperature):
    """On CUDA the weight's gradient is accumulated by float32-output matmuls (`torch.addmm(out_dtype=)`)."""
    set_chunk_rows(monkeypatch, 128)
    inputs = [t.cuda() for t in make_inputs(torch.bfloat16)]
    args = (*inputs, temperature)
    logp_BT, entropy_BT, grad_hidden, grad_weight = values_and_grads(lm_head_logprobs, *args)
    ref_logp_BT, ref_entropy_BT, ref_grad_hidden, ref_grad_weight = values_and_grads(
        through_the_logits, *args
    )
    assert_close(logp_BT, ref_logp_BT, rtol=1e-5, atol=1e-5)
    assert_close(entropy_BT, ref_entropy_BT, rtol=1e-5, atol=1e-5)
    assert relative_error(grad_hidden, ref_grad_hidden) < 1e-2
    assert relative_error(grad_weight, ref_grad_weight) < 1e-2
