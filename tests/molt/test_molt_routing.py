"""`--train.routing_replay` in the trainer: the segments' MoE routes become the batch's `experts_BTLK`,
and the policy actor's forward (and backward) sends each token to the experts the engine used.

The engine here is a transformers copy of the checkpoint recording its own routes: vLLM captures routes
only in its GPU model runner (tito's side is tested in tests/tito/test_tito_routes.py). The actor is
one rank of the real `PolicyWorker`, in this process: on CPU a transformers Qwen3-MoE sharded by
AutoModel over gloo; with CUDA (`gpu` marker) AutoModel's own Qwen3-MoE class, whose routers are
AutoModel `Gate`s, over NCCL (no Ray or vLLM needed there).

Legend: B sequences, T tokens, L decoder layers, K experts per token.
"""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np
import pytest
import torch

from molt._batch import collate, with_routes
from molt.config import Config
from molt.vllm_server import free_port
from refit import RoutingReplay

pytestmark = [  # importing AutoModel in this process (the actor runs here)
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

ROWS = [  # (tokens, loss mask): two rows of different lengths, so the second is right padded
    ([1, 5, 9, 11, 12, 7, 30, 41], [0, 0, 0, 1, 1, 1, 1, 1]),
    ([1, 6, 7, 13, 8], [0, 0, 1, 1, 1]),
]
LAYERS, TOP_K = 3, 2  # layer 1 is dense: vLLM still gives it a column


def _encoded(routes: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, routes)
    return base64.b64encode(buffer.getvalue()).decode()


def test_segment_routes_become_the_batch_routes_padded_with_minus_one():
    from tito import Segment

    routes = [
        np.full((len(tokens) - 1, LAYERS, TOP_K), row + 1, dtype=np.uint8)
        for row, (tokens, _) in enumerate(ROWS)
    ]
    segments = [
        Segment(tokens, mask, [-0.5 * m for m in mask], [m - 1 for m in mask], routed_experts=_encoded(r))
        for (tokens, mask), r in zip(ROWS, routes, strict=True)
    ]
    segments = [msgspec.json.decode(msgspec.json.encode(s), type=Segment) for s in segments]  # as dumped
    batch = collate([(s.token_ids, s.loss_mask, s.logprobs, 1.0) for s in segments], pad_id=0)
    batch = with_routes(batch, [s.routes() for s in segments])
    assert batch.experts_BTLK.shape == (2, 8, LAYERS, TOP_K) and batch.experts_BTLK.dtype == torch.int16
    assert (batch.experts_BTLK[0, :7] == 1).all() and (batch.experts_BTLK[0, 7] == -1).all()
    assert (batch.experts_BTLK[1, :4] == 2).all() and (batch.experts_BTLK[1, 4:] == -1).all()

    empty = batch.select([])  # a rank's empty turn: a row without routes
    assert empty.experts_BTLK.shape == (1, 1, LAYERS, TOP_K) and (empty.experts_BTLK == -1).all()
    assert torch.equal(batch.select([1]).experts_BTLK, batch.experts_BTLK[1:, :5])  # its 5 tokens
    from molt._packing import packed_rows

    packed = packed_rows(batch.row_lengths, cuda=False).pack(batch.experts_BTLK, fill=-1)
    assert torch.equal(packed[0], torch.cat([batch.experts_BTLK[0, :8], batch.experts_BTLK[1, :5]]))

    with pytest.raises(RuntimeError, match=r"rows \[1\] have no MoE routes.*--enable-return-routed-experts"):
        with_routes(batch, [segments[0].routes(), None])


def _tiny_moe_dir(path, dense_layers: list[int], router_drift: float = 0.0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=8, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=dense_layers, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in RoutingReplay(model).routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * router_drift)
    model.save_pretrained(path)
    return model.eval()


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()


def _experts_seen(model, run) -> list[list[torch.Tensor]]:
    """The expert indices each MoE block used during `run()`, per router, call by call: [N, K] each (a
    forward of a micro-batch of N packed tokens is one call per block, and so is its recomputation under
    activation checkpointing). transformers' Qwen3-MoE: what its experts module is handed; AutoModel: what its
    `Gate` returns (it applies the replay inside its forward)."""
    seen, hooks = {}, []
    for module in model.modules():
        if type(module).__name__ == "Qwen3MoeExperts":
            seen[module] = []
            hooks.append(module.register_forward_pre_hook(lambda m, a: seen[m].append(a[1].detach().cpu())))
        elif type(module).__name__ == "Gate":
            seen[module] = []
            hooks.append(
                module.register_forward_hook(lambda m, _a, out: seen[m].append(out[1].detach().cpu()))
            )
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return list(seen.values())


def _rows_routes(seen: list[list[torch.Tensor]], calls: list[int], lengths: list[int]) -> torch.Tensor:
    """[routers, N, K]: the given calls' routes end to end, each cut to its row's `lengths` (on CUDA a
    packed micro-batch ends in a padding row)."""
    return torch.stack(
        [torch.cat([per_call[c][:n] for c, n in zip(calls, lengths, strict=True)]) for per_call in seen]
    )


def _replays_the_engines_experts(tmp_path, dense_layers: list[int]) -> None:
    from molt._actor import PolicyWorker

    # The engine: the checkpoint before the step; it records the route of every forwarded token.
    engine = _tiny_moe_dir(tmp_path / "engine", dense_layers)
    replay = RoutingReplay(engine)
    routes = []
    for tokens, _ in ROWS:
        with torch.no_grad(), replay.record():
            engine(torch.tensor([tokens]))
        engine_TLK = torch.full((len(tokens), LAYERS, TOP_K), 7, dtype=torch.long)  # a dense layer's: unread
        engine_TLK[:, replay.layer_ids] = replay.recorded
        routes.append(engine_TLK[:-1].numpy().astype(np.uint8))  # the last token was never forwarded
    batch = collate([(tokens, mask, [-2.0] * len(tokens), 1.0) for tokens, mask in ROWS], pad_id=0)
    routed = with_routes(batch, routes)

    # The trainer: its routers have moved since (a later version), so left alone they route differently.
    _tiny_moe_dir(tmp_path / "trainer", dense_layers, router_drift=2.0)
    config = Config()
    config = msgspec.structs.replace(
        config,
        train=msgspec.structs.replace(config.train, routing_replay=True),
        actor=msgspec.structs.replace(config.actor, micro_batch_tokens=8, activation_checkpointing=True),
    )
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tmp_path / "trainer"), config)
    try:
        assert worker.replay.layer_ids == replay.layer_ids
        known_BT = (routed.experts_BTLK >= 0).all(-1).all(-1)  # tokens with a route
        want_RBTK = routed.experts_BTLK[:, :, replay.layer_ids].long().permute(2, 0, 1, 3)

        # Micro-batches of one row (8 tokens each at most), packed: one call per row and block.
        lengths = batch.row_lengths
        known_N = torch.cat([known_BT[row, :n] for row, n in enumerate(lengths)])
        want_RNK = torch.cat([want_RBTK[:, row, :n] for row, n in enumerate(lengths)], dim=1)
        free_RNK = _rows_routes(_experts_seen(worker.model, lambda: worker.logprobs(batch)), [0, 1], lengths)
        assert not torch.equal(free_RNK[:, known_N], want_RNK[:, known_N]), "the drift changes routes"
        replayed_RNK = _rows_routes(
            _experts_seen(worker.model, lambda: worker.logprobs(routed)), [0, 1], lengths
        )
        assert torch.equal(replayed_RNK[:, known_N], want_RNK[:, known_N])

        router_before = [_full(router.weight).clone() for router in worker.replay.routers]
        metrics = {}
        stepped = _experts_seen(worker.model, lambda: metrics.update(worker.train_step(routed)))
        # With activation checkpointing, each row's forward and its recomputation in the backward (the
        # two calls of a row are consecutive): every one routes as the engine did.
        num_calls = len(stepped[0])
        assert num_calls == 4 or (num_calls == 2 and worker.device.type == "cuda")
        for call in range(num_calls):
            row = call // (num_calls // 2)
            known_T, n = known_BT[row, : lengths[row]], lengths[row]
            stepped_RTK = _rows_routes(stepped, [call], [n])
            assert torch.equal(stepped_RTK[:, known_T], want_RBTK[:, row, :n][:, known_T])
        assert 0 < metrics["train/routing_mismatch_frac"] <= 1
        for before, router in zip(router_before, worker.replay.routers, strict=True):
            assert not torch.equal(_full(router.weight), before), "the routers still train"
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_the_actor_trains_on_the_engines_experts_after_its_routers_drifted(tmp_path):
    _replays_the_engines_experts(tmp_path, dense_layers=[1])  # vLLM gives dense layer 1 a column too


@pytest.mark.gpu  # torch.compile of AutoModel's RMSNorm op, recompiled under checkpointing, warns:
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_automodels_moe_on_cuda_trains_on_the_engines_experts(tmp_path):
    _replays_the_engines_experts(tmp_path, dense_layers=[])  # AutoModel's Qwen3-MoE: every layer MoE
