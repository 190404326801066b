"""Running `molt` as a user does (its console script, in a subprocess) and reading a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MOLT = str(Path(sys.executable).parent / "molt")
LETTERS_AGENT = str(Path(__file__).with_name("letters_agent.py"))


def molt(*args: str) -> subprocess.CompletedProcess:
    """`molt ARGS`, which must succeed; its output is in the assertion message when it does not."""
    result = subprocess.run([MOLT, *args], capture_output=True, text=True, timeout=900, env={**os.environ})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def steps_of(run_dir: Path) -> dict[int, dict]:
    """Each step's last record (a resumed run logs the steps after its checkpoint again)."""
    return {s["step"]: s for s in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def reproducible_run_args(model_dir: Path, engine_url: str) -> list[str]:
    """Flags under which two runs on the shared engine sample the same rollouts while their weights are
    equal: seeded requests, strict on-policy steps (a step takes exactly the groups it started), the
    dense-reward agent with replies of up to 6 tokens, a checkpoint every 2 steps."""
    return [
        "--model.path", str(model_dir), "--vllm.urls", engine_url, "--ray.num_cpus", "2",
        "--agent.module", LETTERS_AGENT, "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
        "--rollout.max_new_tokens", "6",
        "--train.force_on_policy", "--rollout.seed_requests", "--ckpt.every", "2",
        "--logger.tensorboard", "false",
    ]  # fmt: skip
