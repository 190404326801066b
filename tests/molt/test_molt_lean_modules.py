"""`molt._lean.use_lean_modules`: the policy with its lean norms, MLPs and logprob head swapped in computes
what the model as loaded computes, forward and backward, with the same parameters under the same names.

The tiny Qwen3 through transformers in this process (float32), no distribution: the swap is the same
whether FSDP2 has sharded the model or not (it changes classes, never module objects).

Legend: B sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from host_reads import ValuesReadBack
from torch.testing import assert_close

from molt.config import Config

pytestmark = [  # importing AutoModel (its RMSNorm op) in this process
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

TEMPERATURE = 0.7


def _models(model_dir) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model as loaded, and a copy with the lean modules swapped in."""
    from transformers import AutoModelForCausalLM

    from molt._lean import use_lean_modules

    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lean = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(lean.named_parameters())
    config = Config()
    use_lean_modules(
        lean,
        msgspec.structs.replace(
            config, rollout=msgspec.structs.replace(config.rollout, temperature=TEMPERATURE)
        ),
    )
    assert dict(lean.named_parameters()).keys() == params.keys()
    assert all(p is params[name] for name, p in lean.named_parameters()), "the same parameter objects"
    return original, lean


def _tokens() -> torch.Tensor:
    return torch.randint(4, 100, (3, 9), generator=torch.Generator().manual_seed(0))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def test_every_lean_module_is_swapped_in_and_shows(tiny_model_dir):
    from molt._lean import LeanMLP, LeanRMSNorm, LogprobHead

    _, lean = _models(tiny_model_dir)
    layers = lean.config.num_hidden_layers
    kinds = [type(m) for m in lean.modules()]
    # per layer: input, post-attention, q and k norms; then the final norm
    assert sum(issubclass(kind, LeanRMSNorm) for kind in kinds) == 4 * layers + 1
    assert sum(issubclass(kind, LeanMLP) for kind in kinds) == layers
    assert isinstance(lean.get_output_embeddings(), LogprobHead)
    assert "LeanRMSNorm[Qwen3RMSNorm]" in repr(lean) and "LogprobHead[Linear]" in repr(lean)


def test_the_swapped_model_gives_the_same_logits_and_gradients(tiny_model_dir):
    original, lean = _models(tiny_model_dir)
    tokens_BT = _tokens()
    for model in (original, lean):
        logits_BTV = model(tokens_BT).logits
        (logits_BTV.square().mean() + torch.log_softmax(logits_BTV, -1)[..., 5].sum()).backward()
    assert_close(lean(tokens_BT).logits, original(tokens_BT).logits, atol=1e-5, rtol=1e-5)
    lean_grads = _grads(lean)
    for name, grad in _grads(original).items():
        assert_close(lean_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_head_gives_the_logprobs_and_entropies_of_the_logits_with_their_gradients(tiny_model_dir):
    original, lean = _models(tiny_model_dir)
    tokens_BT = _tokens()
    next_tokens_BT = tokens_BT.roll(-1, dims=1)
    logp_BTV = torch.log_softmax(original(tokens_BT).logits / TEMPERATURE, dim=-1)
    expected_logp_BT = logp_BTV.gather(-1, next_tokens_BT[..., None])[..., 0]
    expected_entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    (expected_logp_BT.sum() + 0.1 * expected_entropy_BT.sum()).backward()

    head = lean.get_output_embeddings()
    with head.logprobs_of(next_tokens_BT):
        out_BT1 = lean(tokens_BT).logits
        entropy_BT = head.entropy_BT
    assert head.next_tokens_BT is None and head.entropy_BT is None  # nothing kept past the block
    assert out_BT1.shape == (*tokens_BT.shape, 1)
    assert_close(out_BT1[..., 0], expected_logp_BT, atol=1e-5, rtol=1e-5)
    assert_close(entropy_BT, expected_entropy_BT, atol=1e-5, rtol=1e-5)
    (out_BT1[..., 0].sum() + 0.1 * entropy_BT.sum()).backward()
    lean_grads = _grads(lean)
    for name, grad in _grads(original).items():
        assert_close(lean_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_head_at_given_positions_gives_theirs_alone_and_their_gradients(tiny_model_dir):
    """The positions a loss reads (`LogprobHead.logprobs_of(..., positions_N)`): theirs are the logits'
    logprobs and entropies, every other is 0, and the gradients are those of a loss that reads theirs
    alone through the logits."""
    original, lean = _models(tiny_model_dir)
    tokens_BT = _tokens()
    next_tokens_BT = tokens_BT.roll(-1, dims=1)
    read_BT = torch.zeros(tokens_BT.shape, dtype=torch.bool)
    read_BT[0, 2:6] = read_BT[2, [0, 4, 8]] = True  # row 1 reads none
    logp_BTV = torch.log_softmax(original(tokens_BT).logits / TEMPERATURE, dim=-1)
    expected_logp_BT = logp_BTV.gather(-1, next_tokens_BT[..., None])[..., 0] * read_BT
    expected_entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1) * read_BT
    (expected_logp_BT.sum() + 0.1 * expected_entropy_BT.sum()).backward()

    head = lean.get_output_embeddings()
    with head.logprobs_of(next_tokens_BT, read_BT.reshape(-1).nonzero()[:, 0]):
        out_BT1 = lean(tokens_BT).logits
        entropy_BT = head.entropy_BT
    assert head.positions_N is None  # nothing kept past the block
    assert_close(out_BT1[..., 0], expected_logp_BT, atol=1e-5, rtol=1e-5)
    assert_close(entropy_BT, expected_entropy_BT, atol=1e-5, rtol=1e-5)
    assert out_BT1[~read_BT].eq(0).all() and entropy_BT[~read_BT].eq(0).all()
    (out_BT1[..., 0].sum() + 0.1 * entropy_BT.sum()).backward()
    lean_grads = _grads(lean)
    for name, grad in _grads(original).items():
        assert_close(lean_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_compiled_norm_is_the_formula_inductor_fuses_and_keeps_its_input_alone():
    """Inside torch.compile the lean norm is the float32 formula (AutoModel's op, opaque to Inductor,
    would run unfused), equal to the op, and its compiled backward keeps the bf16 input and each row's
    reciprocal RMS, no float32 copy of the input."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from molt._lean import use_lean_rms_norms

    model = torch.nn.Sequential(Qwen3RMSNorm(64, eps=1e-6)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    assert use_lean_rms_norms(model) == 1
    x_TH = torch.randn(16, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    eager_TH = model(x_TH)
    ops: list = []

    def graph_ops(gm, inputs):  # the graph Dynamo hands a backend
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch.compile(model, backend=graph_ops)(x_TH)
    assert not any("nemo_automodel" in op for op in ops) and any("rms_norm" in op for op in ops)
    torch._dynamo.reset()
    saved: list = []
    x_TH.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        compiled_TH = torch.compile(model)(x_TH)
    assert_close(compiled_TH, eager_TH, atol=1e-2, rtol=1e-2)  # a bf16 rounding apart at most
    assert all(t.dtype == torch.bfloat16 or t.numel() <= x_TH.shape[0] for t in saved), [
        (t.dtype, tuple(t.shape)) for t in saved
    ]


def test_automodels_rotary_embedding_gives_the_same_tables_without_reading_a_position_back(tiny_model_dir):
    """AutoModel's own model classes (the GPU's) build their RoPE tables here; transformers' (the CPU's)
    have their own, which are left as they are."""
    from nemo_automodel.components.models.llama.rope_utils import LlamaRotaryEmbedding
    from transformers import AutoConfig

    from molt._lean import LeanRotaryEmbedding, use_lean_rotary_embeddings

    config = AutoConfig.from_pretrained(tiny_model_dir)
    original = torch.nn.ModuleList([LlamaRotaryEmbedding(config)])
    lean = torch.nn.ModuleList([LlamaRotaryEmbedding(config)])
    assert use_lean_rotary_embeddings(lean) == 1 and isinstance(lean[0], LeanRotaryEmbedding)
    _, transformers_model = _models(tiny_model_dir)
    assert use_lean_rotary_embeddings(transformers_model) == 0
    x = torch.zeros(1, 12, config.hidden_size)
    for position_ids in (
        torch.arange(12)[None],  # one row
        torch.cat([torch.arange(5), torch.arange(4), torch.arange(3)])[None],  # three packed rows
        torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 3, 4, 0, 1]]),  # a prefix, two continuations, padding
    ):
        with ValuesReadBack() as reads:
            cos, sin = lean[0](x, position_ids)
        assert reads.reads == 0
        with ValuesReadBack() as reads:
            expected_cos, expected_sin = original[0](x, position_ids)
        assert reads.reads == 1  # AutoModel's: `position_ids.max().item()`
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
