"""`molt plot RUN_DIR`: a PNG of reward, response length and timings, from metrics.jsonl alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from molt._plot import read_metrics, smoothed

MOLT = str(Path(sys.executable).parent / "molt")


def test_plot_writes_a_png_of_the_run(tmp_path):
    steps = [
        {"step": s, "rollout/reward_mean": s / 30, "rollout/response_len_mean": 2.0, "timing/generation": 1.0,
         "timing/policy_train": 0.5, "timing/broadcast": 0.1, "timing/step_total": 1.7}
        for s in range(1, 31)
    ]  # fmt: skip
    resumed = steps[20:]  # a run resumed from step 20 logs steps 21.. again
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps + resumed))
    result = subprocess.run([MOLT, "plot", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    png = (tmp_path / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert [s["step"] for s in read_metrics(tmp_path)] == list(range(1, 31))


def test_plot_of_a_directory_without_a_run_says_so(tmp_path):
    result = subprocess.run([MOLT, "plot", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "has no metrics.jsonl" in result.stderr


def test_a_smoothed_timing_curve_starts_after_the_warm_up_step():
    x, y = tuple(range(1, 21)), (37.0, *[2.0] * 19)  # step 1 holds the warm-up
    steps, curve = smoothed("timing/step_total", x, y)
    assert steps[0] == 2 and curve == [2.0] * 19
    steps, curve = smoothed("rollout/reward_mean", x, y)  # other metrics keep their first step
    assert steps[0] == 1 and curve[0] == 37.0 and curve[1] > 2.0
