"""The engines' KV cache sized to what a run can fill (`--vllm.kv_cache_tokens`): a cache far larger than
the sequences in flight makes every refit's cache reset walk blocks nobody uses."""

from __future__ import annotations

import json

import pytest

import molt._validate
from molt._engines import engine_extra_args
from molt._flags import resolve
from molt._placement import (
    actor_free_bytes,
    engine_max_num_seqs,
    engine_starts_first,
    kv_bytes_per_token,
    kv_cache_bytes,
)
from molt.config import Config, Rollout

QWEN3_1_7B = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "hidden_size": 2048, "layer_types": ["full_attention"] * 28}  # fmt: skip
H200 = 150_000_000_000  # bytes of GPU memory


def test_a_token_holds_k_and_v_of_every_layer_for_this_gpus_share_of_the_kv_heads():
    assert kv_bytes_per_token(QWEN3_1_7B, tp_size=1, dtype_bytes=2) == 2 * 28 * 8 * 128 * 2  # 112 KiB
    assert kv_bytes_per_token(QWEN3_1_7B, tp_size=2, dtype_bytes=2) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(QWEN3_1_7B, tp_size=16, dtype_bytes=2) == 2 * 28 * 1 * 128 * 2  # replicated
    no_head_dim = {k: v for k, v in QWEN3_1_7B.items() if k != "head_dim"}
    assert kv_bytes_per_token(no_head_dim, tp_size=1, dtype_bytes=4) == 2 * 28 * 8 * (2048 // 16) * 4
    assert kv_bytes_per_token({"text_config": QWEN3_1_7B}, 1, 2) == 2 * 28 * 8 * 128 * 2  # a VL model's LLM


OTHER_LAYOUTS = [
    {"kv_lora_rank": 512},  # MLA
    {"layer_types": ["linear_attention", "full_attention"]},
    {"layer_types": ["sliding_attention", "full_attention"]},
]


@pytest.mark.parametrize("other", OTHER_LAYOUTS)
def test_layouts_that_cache_otherwise_are_left_to_vllm(other):
    assert kv_bytes_per_token(QWEN3_1_7B | other, tp_size=1, dtype_bytes=2) is None


def _model(tmp_path, weights_bytes: int = 0):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_7B))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * weights_bytes)
    return tmp_path


@pytest.fixture(autouse=True)
def with_cuda(monkeypatch):
    """The flags resolve as on a GPU machine (--vllm.kv_cache_tokens is refused on a CPU)."""
    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: True)
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 2)  # an engine's GPU and the actor's


def _config(*flags: str) -> Config:
    return resolve(["--model.dtype", "bfloat16", *flags])


def test_the_default_holds_every_sequence_in_flight_at_the_longest_length(tmp_path):
    model = _model(tmp_path)
    per_token = 2 * 28 * 8 * 128 * 2
    # 16 prompts a step: 32 groups of 8 in flight, each sequence up to 2048 tokens plus a partial block
    assert kv_cache_bytes(_config(), model, H200) == 32 * 8 * (2048 + 16) * per_token
    wider = _config(
        "--rollout.group_size", "4", "--rollout.queue_depth", "20", "--vllm.max_model_len", "1024"
    )
    assert kv_cache_bytes(wider, model, H200) == 20 * 4 * (1024 + 16) * per_token
    with_eval = _config("--eval.every", "5", "--eval.num_prompts", "8", "--eval.n", "2")
    assert kv_cache_bytes(with_eval, model, H200) == (32 * 8 + 8 * 2) * (2048 + 16) * per_token
    assert kv_cache_bytes(_config("--vllm.kv_cache_tokens", "50000"), model, H200) == 50000 * per_token


def test_a_default_that_would_not_fit_the_engines_memory_share_is_left_to_vllm(tmp_path):
    model = _model(tmp_path)  # 32 x 8 x 4112 tokens x 112 KiB = 113 GiB > 0.8 x 150 GB - 4 GiB
    assert kv_cache_bytes(_config("--vllm.max_model_len", "4096"), model, H200) is None
    shared = _config("--vllm.placement", "shared")  # 56 GiB > 0.4 x 150 GB - 4 GiB: the actor needs the rest
    # a shared GPU's engine gets what fits in its share (about what vLLM would size), so the actor starts
    # beside it (`engine_starts_first`)
    assert kv_cache_bytes(shared, model, H200) == int(0.4 * H200 - 4 * 2**30)
    one_sequence = (2048 + 16) * 2 * 28 * 8 * 128 * 2  # ... unless not even one sequence fits
    assert kv_cache_bytes(shared, model, int((one_sequence + 4 * 2**30) / 0.4) - 1000) is None
    fits = kv_cache_bytes(_config("--vllm.max_model_len", "1024"), model, H200)  # 29 GiB
    assert fits is not None
    heavy = _model(tmp_path, weights_bytes=1000)  # weights count against the share
    assert kv_cache_bytes(_config("--vllm.max_model_len", "1024"), heavy, fits + 4 * 2**30 + 999) is None


def test_engines_sharing_a_gpu_each_hold_their_part_of_the_sequences_in_their_part_of_the_memory(
    tmp_path, monkeypatch
):
    model, per_token = _model(tmp_path), 2 * 28 * 8 * 128 * 2
    flags = ("--vllm.placement", "shared", "--vllm.max_model_len", "1024")
    one, two = _config(*flags), _config(*flags, "--vllm.num_engines", "2")
    assert kv_cache_bytes(one, model, H200) == 32 * 8 * (1024 + 16) * per_token  # 29 GiB of 0.4 x 150 GB
    assert kv_cache_bytes(two, model, H200) == 16 * 8 * (1024 + 16) * per_token  # each: half of them
    assert engine_max_num_seqs(one) is None and engine_max_num_seqs(two) == 16 * 8
    three = _config(*flags, "--vllm.num_engines", "3", "--rollout.prompts_per_step", "4")  # 64 sequences
    assert engine_max_num_seqs(three) == 22  # 64 / 3, rounded up
    # each engine's room is its part of the share: 2048-token sequences no longer all fit in 0.2 x 150 GB
    crowded = _config("--vllm.placement", "shared", "--vllm.num_engines", "2")
    assert kv_cache_bytes(crowded, model, H200) == int(0.2 * H200 - 4 * 2**30)
    # separate GPUs: each engine has a GPU of its own and keeps room for every sequence in flight
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 3)
    separate = _config("--vllm.num_engines", "2", "--vllm.max_model_len", "1024")
    assert separate.vllm.placement == "separate"
    assert kv_cache_bytes(separate, model, H200) == 32 * 8 * (1024 + 16) * per_token


def test_a_cuda_engine_is_started_with_the_size(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": H200})
    )
    args = engine_extra_args(_config(), _model(tmp_path))
    per_token = 2 * 28 * 8 * 128 * 2
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(32 * 8 * (2048 + 16) * per_token)
    # 256 sequences in flight: vLLM's own batch limit (256, 1024 on a large GPU) is kept
    assert "--max-num-seqs" not in args
    # fewer: the engine's batches, and the CUDA graphs it captures for them, stop at what is in flight
    small = engine_extra_args(_config("--rollout.prompts_per_step", "4"), tmp_path)
    assert small[small.index("--max-num-seqs") + 1] == str(8 * 8)
    with_eval = engine_extra_args(_config("--rollout.prompts_per_step", "4", "--eval.every", "5"), tmp_path)
    assert with_eval[with_eval.index("--max-num-seqs") + 1] == str(8 * 8 + 32 * 4)  # and the evaluation's
    unvalidated = Config(rollout=Rollout(prompts_per_step=4))  # --rollout.queue_depth 0: 2 x prompts
    assert engine_max_num_seqs(unvalidated) == 8 * 8
    assert "--kv-cache-memory-bytes" not in engine_extra_args(
        _config("--vllm.max_model_len", "4096"), tmp_path
    )


def test_a_size_the_model_cannot_be_given_or_below_one_sequence_is_refused(tmp_path):
    from molt.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_7B | {"kv_lora_rank": 512}))
    with pytest.raises(
        ConfigError, match="--vllm.kv_cache_tokens with --model.path .*do not all cache K and V.*MLA"
    ):
        _config("--model.path", str(tmp_path), "--vllm.kv_cache_tokens", "50000")
    with pytest.raises(ConfigError, match="--vllm.kv_cache_tokens 1000 cannot hold one sequence of"):
        _config("--vllm.kv_cache_tokens", "1000")


def test_a_shared_engine_starts_before_the_actor_only_where_vllm_sizes_its_cache_from_free_memory(
    tmp_path, monkeypatch
):
    """With the cache's size given, vLLM reads nothing from the memory it finds free but the check that its
    share is free, so the actor starts beside it; without, memory the actor took would be counted as the
    engine's."""
    import torch

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": H200})
    )
    model = _model(tmp_path)
    shared = ("--vllm.placement", "shared")
    assert not engine_starts_first(_config(*shared, "--vllm.max_model_len", "1024"), model)  # 29 GiB fits
    assert not engine_starts_first(_config(*shared), model)  # 56 GiB does not: the engine gets what fits
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_7B | {"kv_lora_rank": 512}))
    assert engine_starts_first(_config(*shared, "--vllm.max_model_len", "1024"), model)  # MLA: vLLM sizes it
    assert not engine_starts_first(_config("--vllm.placement", "separate"), model)  # GPUs of their own


def test_an_actor_beside_a_starting_engine_sizes_its_budget_from_its_own_share():
    """The engine may not have taken its memory yet when the actor sizes its token budget (the two start
    side by side): free memory alone would hand the actor the engine's share too (on an 80 GB GPU the
    actor grew to 48.5 GiB, the engine's refit ran out of memory and its restart found too little)."""
    gib = 2**30

    def left(config: Config, free_gib: int) -> float:  # an 80 GiB GPU; the actor holds 5 GiB
        return actor_free_bytes(config, free=free_gib * gib, total=80 * gib, held=5 * gib) / gib

    shared = _config("--vllm.placement", "shared")  # the engine's share: 0.4, the actor's 0.6 x 80 = 48 GiB
    assert left(shared, 75) == 48 - 5  # the engine not started: 75 GiB free
    assert left(shared, 30) == 30  # the engine up: what is free is the bound
    # a reference model on the same GPU: the actor groups split their part
    assert left(_config("--vllm.placement", "shared", "--algo.kl.coef", "0.01"), 75) == 24 - 5
    assert left(_config("--vllm.placement", "separate"), 75) == 75  # a GPU of its own: all that is free
