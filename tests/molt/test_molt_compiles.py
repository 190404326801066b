"""`actor/compiles`: the graphs torch.compile built during the passes a rank reports, so a step that is slow
because it still compiles says so (the CPU actor runs eager; a compiled function stands in for its layers)."""

from __future__ import annotations

import pytest
import torch

from molt._actor import PolicyWorker
from molt._batch import collate
from molt.config import Config
from molt.vllm_server import free_port


# What AutoModel's imports warn about in this process (a Ray worker's would not reach the test).
@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_rank_reports_the_graphs_compiled_since_its_last_report(tiny_model_dir):
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), Config())
    try:
        batch = collate([([1, 5, 9, 11], [0, 0, 1, 1], [-4.0] * 4, 1.0)], pad_id=0)
        worker.logprobs(batch)
        assert worker.take_pass_counts()["compiles"] == 0  # eager layers
        double = torch.compile(lambda x: 2 * x, backend="eager", dynamic=False)
        double(torch.ones(3))
        double(torch.ones(5))  # a new shape: a second graph
        worker.logprobs(batch)
        assert worker.take_pass_counts()["compiles"] == 2
        worker.logprobs(batch)
        assert worker.take_pass_counts()["compiles"] == 0  # counted once
    finally:
        torch.distributed.destroy_process_group()
