"""Refit from an FSDP2-sharded trainer (2 ranks, gloo) into a real vLLM CPU server, through a retry."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp
from refit_helpers import fsdp_refit_rank, max_logprob_error, weight_set

import refit

pytestmark = pytest.mark.slow


def test_two_rank_fsdp2_trainer_refits_the_engine(refit_servers, tiny_model_dir, tmp_path):
    from molt.vllm_server import free_port

    server = refit_servers.serve(tiny_model_dir)
    model = weight_set(tmp_path, 61)
    model_dir = tmp_path / "seed61"
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(fsdp_refit_rank, args=(2, free_port(), str(model_dir), server.url, out), nprocs=2, join=True)
        results = dict(out)
    assert results[1] is None  # rank 1 only gathered (twice: the retry is a collective too)
    num_buckets, verify_failed = results[0]
    assert num_buckets > 1 and verify_failed == (server.url,)  # rank 0 sent, and sent again in full
    engine = refit.Engine(server.url)
    assert engine.weight_version() == "fsdp"
    engine.close()
    assert max_logprob_error(server.url, model) < 1e-4
