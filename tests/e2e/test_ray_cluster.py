"""`--ray.address` joins a Ray cluster someone else started, as a multi-node launch does (examples/slurm).

The session's head (`ray start --head --block`, see `molt_runs.ray_head`) is joined by most end-to-end
runs; this test checks the joining itself: the run trains, and the cluster it joined is still up after.
"""

from __future__ import annotations

import json

import pytest
from molt_runs import molt

pytestmark = pytest.mark.slow


def test_train_joins_an_existing_ray_cluster(tmp_path, tiny_model_dir, molt_engine, ray_cluster):
    run_dir = tmp_path / "run"
    result = molt(
        "train", "--ray.address", ray_cluster.address, "--model.path", str(tiny_model_dir),
        "--vllm.urls", molt_engine.url, "--logger.run_dir", str(run_dir), "--train.num_steps", "2",
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--logger.tensorboard", "false",
        "--train.force_on_policy", env=ray_cluster.env,
    )  # fmt: skip  # given an address, ray.init joins it or raises
    assert "Started a local Ray instance" not in result.stderr
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # On policy, the trainer scores each token with the weights that sampled it (a stale step would add the
    # policy's own change to the mismatch)
    assert all(s["train/mismatch_kl"] < 1e-3 for s in steps)
    assert ray_cluster.process.poll() is None  # the run left the cluster it joined running
