"""The policy actor on two GPUs: data, expert, context and tensor parallelism give the one-GPU update (a
small Qwen3-MoE).

One global batch, one `train_step`, layouts of the same seeded MoE checkpoint: one GPU; data parallel 2
(FSDP2 over both GPUs); data parallel 2 with expert parallel 2 (each GPU holds half the experts, tokens
travel between them). And of a seeded dense Qwen3 (AutoModel 0.7 has no tensor-parallel plan for its
Qwen3-MoE): one GPU, and tensor parallel 2 (both GPUs take every row, each half of every layer's
heads). Context parallelism is not here: the actor refuses it (AutoModel 0.7 splits sequences over
context-parallel ranks only with Transformer Engine attention, which this machine lacks).
Each layout runs in its own processes, one per GPU, driven without
Ray: `PolicyWorker` is a plain class, and each process sees only its GPU (`CUDA_VISIBLE_DEVICES`, as Ray
sets it), so the worker's `cuda:0` is its own device.

What "the same update" means, per parameter dtype. The first AdamW step moves each weight by about
lr * sign(gradient), so rounding noise in a near-zero gradient flips a whole step: the update is compared
by direction (cosine and sign agreement), while scale bugs show up in the pre-clip gradient norm, the
loss metrics and the logprobs after the step, compared directly. fp32 must agree to rounding; bf16 to
bf16's precision (8 mantissa bits, relative spacing 2**-8). The router's auxiliary loss is off: it is a
per-batch statistic of routing, so it differs between one GPU's batch and each half (not an error).

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from molt._batch import StepInputs, collate
from molt.config import FSDP, Actor, Config, Model
from molt.vllm_server import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    # Importing AutoModel in this process: megatron_fsdp warns that neither Transformer Engine nor Apex
    # is installed, and some module of it still uses torch.jit.script_method.
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

LENGTHS = (9, 14, 7, 12, 10, 16)  # even: both data-parallel ranks get real rows only
PROMPT_LEN = 4
LR = 1e-2  # large against bf16's spacing, so a rounded update still moves every weight
LAYOUTS = {  # name -> (model, GPUs, ep_size, cp_size, tp_size)
    "one_gpu": ("moe", 1, 1, 1, 1), "dp2": ("moe", 2, 1, 1, 1), "dp2_ep2": ("moe", 2, 2, 1, 1),
    "dense_one_gpu": ("dense", 1, 1, 1, 1), "dense_tp2": ("dense", 2, 1, 1, 2),
}  # fmt: skip
# dtype -> (metric rtol, min update cosine, max sign disagreement, logprob drift / step change)
TOLERANCE = {"float32": (1e-4, 0.999, 1e-4, 1e-3), "bfloat16": (2e-2, 0.95, 0.03, 0.1)}


def build_tiny_moe(out_dir: Path, dtype: str) -> Path:
    """A seeded Qwen3-MoE (8 experts, top 2, 2 layers) next to molt.tiny's tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from molt.tiny import build_tiny_model

    build_tiny_model(out_dir)  # the tokenizer and generation config; the dense weights are replaced
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.0,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out_dir)
    return out_dir


def build_tiny_dense(out_dir: Path, dtype: str) -> Path:
    """A seeded dense Qwen3 of the MoE's attention shape (4 heads, 2 KV heads: TP 2 splits both)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from molt.tiny import build_tiny_model

    build_tiny_model(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out_dir)
    return out_dir


def _batch():
    gen = torch.Generator().manual_seed(3)
    rows = []
    for length, advantage in zip(LENGTHS, (1.5, -1.0, 0.5, -0.25, 2.0, -1.5), strict=True):
        token_ids = torch.randint(8, 100, (length,), generator=gen).tolist()
        loss_mask = [0] * PROMPT_LEN + [1] * (length - PROMPT_LEN)
        # Random engine logprobs: the rollout correction's weights are uneven.
        rows.append((token_ids, loss_mask, (-3 * torch.rand(length, generator=gen)).tolist(), advantage))
    return collate(rows, pad_id=0)


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.to_local().shape if hasattr(param, "to_local") else param.shape)


def _rank(rank: int, world_size: int, port: int, model_dir: str, dtype: str, sizes: tuple, out: str) -> None:
    """One GPU's part of one layout: logprobs, one train step, logprobs again; saves what it saw."""
    import torch.distributed as dist

    from molt._actor import PolicyWorker

    config = msgspec.structs.replace(
        Config(),
        model=Model(dtype=dtype),
        actor=Actor(lr=LR, micro_batch_tokens=2048, num_ranks=world_size),
        fsdp=FSDP(ep_size=sizes[0], cp_size=sizes[1], tp_size=sizes[2]),
    )
    worker = PolicyWorker(rank, world_size, "127.0.0.1", port, model_dir, config)
    experts = {  # the mesh axes an expert weight is split over, its local and global shapes
        name: (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None), _local_shape(p), p.shape)
        for name, p in worker.model.named_parameters()
        if "experts" in name
    }
    replicas = sizes[1] * sizes[2]  # the CP and TP ranks of a data-parallel group share its rows
    batch, num_shards = _batch(), world_size // replicas
    per_shard = -(-batch.num_rows // num_shards)  # contiguous blocks of rows, one per data-parallel group
    shard = batch.select(range(batch.num_rows)[rank // replicas * per_shard :][:per_shard])
    before = worker.full_state()
    logp_BT = worker.logprobs(shard)  # on-policy: each layout's own logprobs, ratio 1
    metrics = worker.train_step(shard, StepInputs(old_logp_BT=logp_BT))
    num_cols = batch.tokens_BT.shape[1]  # every rank's result as wide as the batch, to rejoin them
    logp_BT, after_logp_BT = (
        torch.nn.functional.pad(t, (0, num_cols - t.shape[1])) for t in (logp_BT, worker.logprobs(shard))
    )
    after = worker.full_state()
    result = dict(logp_BT=logp_BT, after_logp_BT=after_logp_BT, metrics=metrics, experts=experts)
    result.update(model_class=type(worker.model).__module__, before=before, after=after)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _run_layout(model_dir: Path, dtype: str, num_gpus: int, sizes: tuple, out: Path) -> dict:
    """Start one process per GPU, each seeing only its own GPU; return rank 0's result with the
    logprobs of the whole batch (shards rejoined in row order)."""
    out.mkdir()
    port, context = free_port(), mp.get_context("spawn")
    processes, visible = [], os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for rank in range(num_gpus):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # inherited by the child at start
            args = (rank, num_gpus, port, str(model_dir), dtype, sizes, str(out))
            processes.append(context.Process(target=_rank, args=args))
            processes[-1].start()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    for process in processes:
        process.join(timeout=300)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert codes == [0] * num_gpus, f"{out.name}: rank exit codes {codes}"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(num_gpus)]
    num_rows, replicas = len(LENGTHS), sizes[1] * sizes[2]
    result = ranks[0]
    for key in ("logp_BT", "after_logp_BT"):  # one rank per data-parallel group
        result[key] = torch.cat([r[key] for r in ranks[::replicas]])[:num_rows]
    result["rank_experts"] = [r["experts"] for r in ranks]
    return result


class _Layouts(dict):
    """Each layout's results for one parameter dtype, run on first use (a failing layout fails only
    the tests that use it)."""

    def __init__(self, dtype: str, root: Path) -> None:
        super().__init__()
        self.dtype, self.root = dtype, root
        self.model_dirs = {
            "moe": build_tiny_moe(root / "moe", dtype),
            "dense": build_tiny_dense(root / "dense", dtype),
        }

    def __missing__(self, name: str) -> dict:
        model, num_gpus, *sizes = LAYOUTS[name]
        self[name] = _run_layout(self.model_dirs[model], self.dtype, num_gpus, tuple(sizes), self.root / name)
        return self[name]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def layouts(request, tmp_path_factory):
    dtype = request.param
    return dtype, _Layouts(dtype, tmp_path_factory.mktemp(f"moe-{dtype}"))


def test_the_moe_loads_through_automodel_and_expert_parallel_splits_the_experts(layouts):
    _, runs = layouts
    assert runs["one_gpu"]["model_class"].startswith("nemo_automodel")
    for rank_experts in runs["dp2_ep2"]["rank_experts"]:
        assert rank_experts, "no expert parameters found"
        for name, (axes, local, full) in rank_experts.items():
            print(f"\n{name}: mesh axes {axes}, local {local}, global {tuple(full)}")
            names = [getattr(axis, "value", axis) for axis in axes or ()]  # MeshAxisName or str
            assert "ep" in names and local[0] * 2 == full[0] == 8, f"{name}: {axes} {local} {full}"


def _update_agreement(one: dict, two: dict) -> tuple[float, float]:
    """Cosine of the two updates over all parameters, and the fraction of weights moved in opposite
    directions (among those either layout moved)."""

    def delta(run: dict) -> torch.Tensor:
        return torch.cat(
            [(run["after"][n].float() - run["before"][n].float()).flatten() for n in one["after"]]
        )

    delta_one, delta_two = delta(one), delta(two)
    cosine = torch.nn.functional.cosine_similarity(delta_one, delta_two, dim=0).item()
    moved = (delta_one != 0) | (delta_two != 0)
    flipped = (delta_one.sign() != delta_two.sign()) & moved
    return cosine, (flipped.sum() / moved.sum()).item()


@pytest.mark.parametrize(
    ("layout", "baseline"),
    [
        ("dp2", "one_gpu"),
        ("dp2_ep2", "one_gpu"),
        ("dense_tp2", "dense_one_gpu"),
    ],
)
def test_two_gpus_give_the_one_gpu_update(layouts, layout, baseline):
    dtype, runs = layouts
    one, two = runs[baseline], runs[layout]
    metric_rtol, min_cosine, max_flipped, max_drift = TOLERANCE[dtype]
    if layout == "dense_tp2":  # TP splits every matmul's sum over the GPUs, not only the gradient's: fp32
        max_drift *= 5  # rounding differs in each layer, and Adam turns a flipped tiny gradient into a step
    assert one["before"].keys() == two["before"].keys()
    for name, tensor in one["before"].items():
        assert torch.equal(two["before"][name], tensor), f"{name}: the layouts start from different weights"

    cosine, flipped = _update_agreement(one, two)
    mask_BT = _batch().loss_mask_BT > 0
    step_change = (one["after_logp_BT"] - one["logp_BT"])[mask_BT].norm().item()
    drift = (two["after_logp_BT"] - one["after_logp_BT"])[mask_BT].norm().item()
    print(
        f"\n{dtype} {layout} vs {baseline}: update cosine {cosine:.6f}, opposite moves {flipped:.2e}, "
        f"logprob drift {drift:.3e} / step change {step_change:.3e}, metrics "
        + ", ".join(f"{k} {one['metrics'][k]:.6g}|{two['metrics'][k]:.6g}" for k in one["metrics"])
    )
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=metric_rtol, abs=1e-6), key
    assert one["metrics"]["train/grad_norm"] > 0
    assert cosine >= min_cosine and flipped <= max_flipped
    assert drift <= max_drift * step_change
