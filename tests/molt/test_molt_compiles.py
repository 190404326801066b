"""`actor/compiles`: the graphs torch.compile built during the passes a rank reports, so a step that is slow
because it still compiles says so (the CPU actor runs eager; a compiled function stands in for its layers)."""

from __future__ import annotations

import os
import subprocess
import sys

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


# A later run of one model, in a process of its own as each run is: torch.compile's profile of which sizes
# varied comes from the cache directory the runs share (`molt._sharding.remember_dynamic_shapes`).
_LATER_RUN = """
import sys
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig
from molt._sharding import remember_dynamic_shapes

remember_dynamic_shapes(AutoConfig.from_pretrained(sys.argv[1], **eval(sys.argv[2])))
layer = torch.compile(lambda x: (2 * x).sum(), backend="eager")
for rows in (3, 5, 7):
    layer(torch.ones(rows))
print(counters["stats"]["unique_graphs"])
"""


def test_a_later_run_of_the_same_model_compiles_dynamic_shapes_at_once(tiny_model_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_LATER_RUN)
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}

    def graphs(**config_changes) -> int:
        run = [sys.executable, str(script), str(tiny_model_dir), repr(config_changes)]
        return int(subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout)

    assert graphs() == 2  # the first run: a static graph, then a dynamic one at the second size
    assert graphs() == 1  # the next: dynamic from the first call
    assert graphs(intermediate_size=96) == 2  # another model's sizes: a profile of its own
