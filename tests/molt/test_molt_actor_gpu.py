"""The policy actor's GPU path: NeMo AutoModel's own loader (`NeMoAutoModelForCausalLM`) over NCCL.

Runs only with CUDA (the `gpu` marker). One rank, driven without Ray (`PolicyWorker` is a plain class),
so it runs on a GPU machine that has AutoModel but neither Ray nor vLLM.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from molt._batch import StepInputs, collate
from molt.config import Actor, Config, Rollout
from molt.vllm_server import free_port

# torch's own warnings while torch.compile traces and compiles (inductor's TF32 notice; Dynamo's
# instantiating autograd Functions and reading `.grad` of non-leaf tensors): under warnings-as-errors
# Dynamo turns each into a failed compile.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings(r"ignore::UserWarning:torch\."),
    pytest.mark.filterwarnings(r"ignore::DeprecationWarning:torch\."),
]


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A worker opens the default process group: a test that fails before closing it must not make the
    next test's worker fail to open its own."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_automodel_worker_on_cuda_matches_transformers_and_trains(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from molt._actor import PolicyWorker

    config = msgspec.structs.replace(
        Config(), actor=Actor(lr=1e-2, micro_batch_tokens=2048), rollout=Rollout(temperature=0.7)
    )
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
    assert (
        type(worker.model).__module__.startswith("nemo_automodel") or next(worker.model.parameters()).is_cuda
    )

    rows = [([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [0.0, 0.0, 0.0, -4.0, -4.0], 1.0),
            ([1, 6, 7, 13], [0, 0, 1, 1], [0.0, 0.0, -4.0, -4.0], -1.0),
            ([1, 8, 14], [0, 0, 1], [0.0, 0.0, -4.0], 0.5)]  # fmt: skip
    batch = collate(rows, pad_id=0)
    logp_BT = worker.logprobs(batch)

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(batch.tokens_BT).logits[:, :-1] / 0.7
    expected_BT = torch.log_softmax(logits.float(), -1).gather(-1, batch.tokens_BT[:, 1:, None])[..., 0]
    mask_BT = batch.loss_mask_BT[:, 1:] > 0
    torch.testing.assert_close(logp_BT[:, 1:][mask_BT], expected_BT[mask_BT], atol=2e-4, rtol=2e-4)

    metrics = worker.train_step(batch, StepInputs(old_logp_BT=logp_BT))
    assert metrics["train/grad_norm"] > 0 and metrics["train/lr"] == pytest.approx(1e-2)
    after_BT = worker.logprobs(batch)
    advantages_BT = batch.advantages_BT
    moved_BT = (after_BT - logp_BT)[batch.loss_mask_BT > 0]
    assert (moved_BT * advantages_BT[batch.loss_mask_BT > 0] > 0).float().mean() > 0.5
    torch.distributed.destroy_process_group()


def test_critic_and_frozen_workers_on_cuda(tiny_model_dir):
    """The critic (transformers' value-head model, sharded by AutoModel) and a frozen policy on a GPU."""
    from molt._actor import PolicyWorker
    from molt._critic import CriticWorker, data_parallel_only

    rows = [([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [0.0] * 5, 0.0),
            ([1, 6, 7, 13], [0, 0, 1, 1], [0.0] * 4, 0.0)]  # fmt: skip
    batch = collate(rows, pad_id=0)
    returns_BT = batch.loss_mask_BT * 2.0
    critic = CriticWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), data_parallel_only(Config()))
    assert next(critic.model.parameters()).is_cuda
    values_BT = critic.values(batch)
    assert torch.equal(values_BT, torch.zeros_like(values_BT))

    def step() -> float:
        inputs = StepInputs(old_values_BT=critic.values(batch), returns_BT=returns_BT)
        return critic.train_step(batch, inputs)["critic/value_loss"]

    losses = [step() for _ in range(5)]
    assert losses[0] == pytest.approx(2.0) and losses[-1] < losses[0]
    torch.distributed.destroy_process_group()

    frozen = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), Config(), trainable=False)
    assert frozen.optimizer is None and not any(p.requires_grad for p in frozen.model.parameters())
    assert frozen.logprobs(batch).shape == batch.tokens_BT.shape
    torch.distributed.destroy_process_group()


def test_compiled_layers_train_as_the_eager_ones(tiny_model_dir):
    """--actor.compile: the same logprobs and the same step, over two row lengths (a static compile, then a
    dynamic one)."""
    from molt._actor import PolicyWorker

    batches = [
        collate([([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [-4.0] * 5, 1.0),
                 ([1, 6, 7, 13], [0, 0, 1, 1], [-4.0] * 4, -1.0)], pad_id=0),
        collate([([1, 8, 14, 3, 5, 9, 2], [0, 0, 1, 1, 1, 1, 1], [-4.0] * 7, 0.5)], pad_id=0),
    ]  # fmt: skip
    results = []
    for compiled in (False, True):
        config = msgspec.structs.replace(
            Config(),
            actor=Actor(lr=1e-2, micro_batch_tokens=2048, compile="on" if compiled else "off"),
            rollout=Rollout(temperature=0.7),
        )
        worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
        layers = worker.model.model.layers
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        runs = []
        for batch in batches:
            logp_BT = worker.logprobs(batch)
            runs.append((logp_BT, worker.train_step(batch), worker.logprobs(batch)))
        results.append(runs)
        torch.distributed.destroy_process_group()
    for (eager_logp, eager_metrics, eager_after), (logp, metrics, after) in zip(*results, strict=True):
        torch.testing.assert_close(logp, eager_logp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(after, eager_after, atol=1e-4, rtol=1e-4)
        for name, value in eager_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-3, abs=1e-5), name


BF16_ACTOR = {"lr": 1e-3, "micro_batch_tokens": 2048, "compile": "on"}  # the layout tests' actor


def _run_batches(tiny_model_dir, actor: Actor, batches: list) -> tuple[list, list[int], dict]:
    """A one-rank bfloat16 policy worker with `actor` over `batches`: each batch's logprobs and then its
    train step's metrics, the graphs torch.compile had built after each (counted from the worker's start,
    its warm-up's included), and the worker's pass counts, whose `compiles` must be the graphs built after
    the warm-up (`actor/compiles`)."""
    from molt._actor import PolicyWorker
    from molt.config import Model

    config = msgspec.structs.replace(
        Config(), model=Model(dtype="bfloat16"), actor=actor, rollout=Rollout(temperature=0.7)
    )
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
    assert worker.packed == actor.pack
    warmed = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before  # `PolicyWorker._warm_up`
    assert warmed > 0
    runs, graphs = [], []
    for batch in batches:
        runs.append((worker.logprobs(batch), worker.train_step(batch)))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    counts = worker.take_pass_counts()
    assert counts["compiles"] == graphs[-1] - warmed
    torch.distributed.destroy_process_group()
    torch._dynamo.reset()
    return runs, graphs, counts


def _assert_same_logprobs_and_steps(batches: list, runs: list, expected: list) -> None:
    """Each batch's trained logprobs, policy loss and entropy as `expected`'s, to bfloat16's rounding."""
    for batch, (logp, metrics), (expected_logp, expected_metrics) in zip(
        batches, runs, expected, strict=True
    ):
        mask_BT = batch.loss_mask_BT > 0
        torch.testing.assert_close(logp[mask_BT], expected_logp[mask_BT], atol=3e-2, rtol=0)
        for name in ("train/policy_loss", "train/entropy"):
            assert metrics[name] == pytest.approx(expected_metrics[name], rel=3e-2, abs=3e-3), name


def _random_batch(seed: int, lengths: list[int]):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        tokens = torch.randint(4, 100, (length,), generator=gen).tolist()
        prompt = max(1, length // 3)
        rows.append((tokens, [0] * prompt + [1] * (length - prompt), [-4.0] * length, float(seed % 3 - 1)))
    return collate(rows, pad_id=0)


def test_packed_varlen_rows_train_as_padded_ones_in_bfloat16_and_compile_few_shapes(tiny_model_dir):
    """The packed layout's flash varlen attention (16-bit on CUDA) against padded rows: the same logprobs
    and step, to bfloat16's rounding; compiled layers see few shapes (packed lengths rounded to 256, the
    longest row to a power of two), so new batches stop compiling after the first few."""
    gen = torch.Generator().manual_seed(0)
    batches = [
        _random_batch(
            seed,
            torch.randint(5, 400, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist(),
        )
        for seed in range(8)
    ]
    padded, _, padded_counts = _run_batches(tiny_model_dir, Actor(pack=False, **BF16_ACTOR), batches)
    packed, graphs, packed_counts = _run_batches(
        tiny_model_dir, Actor(pack=True, shared_prefix="off", **BF16_ACTOR), batches
    )
    _assert_same_logprobs_and_steps(batches, packed, padded)
    assert graphs[-1] == graphs[3], f"compiled graphs kept growing: {graphs}"
    assert packed_counts["slots"] < padded_counts["slots"]  # packing saved slots
    assert packed_counts["tokens"] == padded_counts["tokens"]


def test_micro_batches_past_inductors_size_thresholds_compile_nothing_after_the_warm_up(tiny_model_dir):
    """The warm-up's rows are short (`molt._actor._warm_up_batches`); a step's micro-batch of ~97k tokens,
    past inductor's mix-order reduction thresholds for this model (rows x hidden >= 5 Mi elements), and a
    short one after it compile no new graph (`molt._sharding.compile_layers`)."""
    lengths = [1900 + 2 * i for i in range(50)]  # 97,450 tokens, rows of their own lengths: packed
    batches = [_random_batch(0, lengths), _random_batch(1, [300, 120, 41])]
    actor = Actor(lr=1e-3, micro_batch_tokens=131072, compile="on", shared_prefix="off")
    _, graphs, counts = _run_batches(tiny_model_dir, actor, batches)
    assert counts["compiles"] == 0, f"graphs after the warm-up: {graphs}"


def _shared_prompt_batch(seed: int):
    """Groups of 2-4 samples of one prompt (20-300 tokens, then replies of 5-100), and a row of its own."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    rows = []
    for _ in range(draw(1, 4)):
        prompt = torch.randint(4, 100, (draw(20, 300),), generator=gen).tolist()
        for _ in range(draw(2, 5)):
            reply = torch.randint(4, 100, (draw(5, 100),), generator=gen).tolist()
            rows.append(
                (prompt + reply, [0] * len(prompt) + [1] * len(reply), [-4.0] * (len(prompt) + len(reply)))
            )
    rows.append((torch.randint(4, 100, (40,), generator=gen).tolist(), [0] * 10 + [1] * 30, [-4.0] * 40))
    return collate([(*row, float(i % 3 - 1)) for i, row in enumerate(rows)], pad_id=0)


def test_shared_prefixes_without_compiled_layers_build_their_attention_at_start_up(tiny_model_dir):
    """--actor.compile off, --actor.shared_prefix on: FlexAttention and its block masks are compiled
    functions of their own, which the warm-up builds (`_run_batches` checks it built graphs); new
    lengths stop compiling after the first few, as with compiled layers."""
    batches = [_shared_prompt_batch(seed) for seed in range(8)]
    eager_layers = Actor(shared_prefix="on", **{**BF16_ACTOR, "compile": "off"})
    _, graphs, counts = _run_batches(tiny_model_dir, eager_layers, batches)
    assert graphs[-1] == graphs[3], f"compiled graphs kept growing: {graphs}"
    assert counts["saved"] > 0


def test_shared_prefix_rows_train_as_unshared_ones_on_cuda_and_compile_few_shapes(tiny_model_dir):
    """--actor.shared_prefix on CUDA (compiled FlexAttention over the tree's block masks, in compiled
    layers) against the packed rows: the same logprobs and step, to bfloat16's rounding; new packed
    lengths stop compiling after the first few."""
    batches = [_shared_prompt_batch(seed) for seed in range(8)]
    packed, _, packed_counts = _run_batches(tiny_model_dir, Actor(shared_prefix="off", **BF16_ACTOR), batches)
    shared, graphs, shared_counts = _run_batches(
        tiny_model_dir, Actor(shared_prefix="on", **BF16_ACTOR), batches
    )
    _assert_same_logprobs_and_steps(batches, shared, packed)
    assert graphs[-1] == graphs[3], f"compiled graphs kept growing: {graphs}"
    assert shared_counts["saved"] > 0 and shared_counts["tokens"] == packed_counts["tokens"]


def test_a_micro_batchs_inputs_reach_the_gpu_without_waiting_for_its_queue():
    """`molt._batch.to_device`: a CPU tensor is copied behind the queued work, not after it (a plain copy
    from pageable memory synchronises the stream), and the source may change at once."""
    from molt._batch import to_device

    device = torch.device("cuda")
    a_NN = torch.randn(8192, 8192, device=device)
    for _ in range(20):  # tens of milliseconds queued
        a_NN = a_NN @ a_NN / 8192**0.5
    values = torch.arange(1000.0)
    moved = to_device(values, device)
    assert not torch.cuda.current_stream().query(), "the host waited for the queued matmuls"
    values.zero_()
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), torch.arange(1000.0))
