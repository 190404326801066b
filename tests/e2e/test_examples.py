"""Every example in `examples/` trains for a few steps with `molt train` on the tiny model.

The tiny model answers arithmetic with noise, so rewards stay near 0: what is checked is that each agent
form runs the whole loop (Ray-placed agent hosts, tito over HTTP for the ChatAgents, token identity,
refit) and logs what it should. The runs share one engine (`--vllm.urls`) and one Ray cluster
(`--ray.address`), as runs of a sweep may: each pushes its own initial weights first, which the mismatch
check below would catch if it did not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import molt

pytestmark = pytest.mark.slow

MOLT = str(Path(sys.executable).parent / "molt")
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    ("example", "extra"),
    [
        pytest.param(
            "math_env.py",
            ["--eval.every", "2", "--eval.num_prompts", "2", "--eval.n", "2", "--eval.k", "2"],
            id="math-env",
        ),  # fmt: skip
        pytest.param("calculator_env.py", ["--agent.max_turns", "3"], id="calculator-env"),
        pytest.param("openai_agent.py", [], id="openai-agent"),
        pytest.param("anthropic_agent.py", [], id="anthropic-agent"),
        pytest.param("agents_sdk_agent.py", [], id="agents-sdk-agent"),
        pytest.param("compacting_agent.py", [], id="compacting-agent"),
    ],
)
def test_example_trains(tmp_path, tiny_model_dir, molt_engine, ray_cluster, example, extra):
    run_dir = tmp_path / "run"
    args = [
        MOLT, "train", "--agent.module", str(EXAMPLES / example), "--logger.run_dir", str(run_dir),
        "--model.path", str(tiny_model_dir), "--vllm.urls", molt_engine.url,
        "--train.num_steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--rollout.max_new_tokens", "24", "--ray.address", ray_cluster.address,
        "--logger.tensorboard", "false",
        "--train.rollout_dump_dir", str(run_dir / "rollouts"), *extra,
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=ray_cluster.env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "reference policy" not in result.stderr  # no --algo.kl.coef: no reference group at all
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["train/mismatch_kl"] < 1e-3  # the trainer scored the tokens the engine sampled
        assert step["pool/failed"] == 0 and step["agent/raised"] == 0
        if example == "compacting_agent.py":
            assert step["rollout/segments_mean"] == 3.0  # three turns, each after a compaction
        else:
            assert step["rollout/segments_mean"] == 1.0
    if "--eval.every" in extra:  # evaluated after step 2 only
        assert "eval/pass@k" not in steps[0] and 0.0 <= steps[1]["eval/pass@k"] <= 1.0
        assert steps[1]["eval/failed"] == 0.0
    records = list(molt.read_rollouts(run_dir / "rollouts"))  # 2 steps x 2 groups x 2 samples
    assert [r.step for r in records] == [1] * 4 + [2] * 4
    for step in steps:
        rewards = [r.reward for r in records if r.step == step["step"]]
        assert sum(rewards) / len(rewards) == pytest.approx(step["rollout/reward_mean"])


def test_visual_question_example_trains(tmp_path, tiny_vl_model_dir, vl_vllm_server, ray_cluster):
    """The multimodal loop on the tiny Qwen2-VL: two-turn image episodes (the second image arrives in a
    step's observation) through tito and the engine, pixel inputs rebuilt by the trainer, refit. Two
    actor ranks, one row per micro-batch, three rows: the second rank's padding row runs the vision tower
    on a blank image (`ModelRank._blank_image_column`), or the ranks' collectives would desynchronise."""
    run_dir = tmp_path / "run"
    args = [
        MOLT, "train", "--agent.module", str(EXAMPLES / "visual_question.py"),
        "--logger.run_dir", str(run_dir), "--model.path", str(tiny_vl_model_dir),
        "--vllm.urls", vl_vllm_server.url, "--agent.max_turns", "2", "--train.num_steps", "2",
        "--rollout.prompts_per_step", "1", "--rollout.group_size", "3", "--rollout.max_new_tokens", "3",
        "--actor.num_ranks", "2", "--actor.micro_batch_tokens", "2048",
        "--ray.address", ray_cluster.address, "--logger.tensorboard", "false",
        "--train.rollout_dump_dir", str(run_dir / "rollouts"),
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=ray_cluster.env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["train/mismatch_kl"] < 1e-3  # the trainer saw the pixels and layout the engine saw
        assert step["rollout/turns"] == 2.0
    records = list(molt.read_rollouts(run_dir / "rollouts"))
    assert len(records) == 6
    for record in records:
        (segment,) = record.segments  # the second turn extended the first
        assert [image.length for image in segment.images] == [4, 4]  # two 56 x 56 pictures
