"""`molt plot RUN_DIR`: one PNG of a run's reward, response length and stage timings over steps.

It reads only `metrics.jsonl`, so it works on a finished run, a stopped one, or one still training.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

PANELS = {  # title -> its curves
    "reward": ["rollout/reward_mean", "eval/reward_mean"],
    "response length (tokens)": ["rollout/response_len_mean"],
    "seconds per step": ["timing/generation", "timing/policy_train", "timing/broadcast", "timing/step_total"],
}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: is it a molt run directory?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # A step's records merge, the later winning: a resumed run logs again the steps after its checkpoint,
    # and a run whose dataset ran out logs its last evaluation after its last step.
    by_step: dict[int, dict] = {}
    for record in records:
        by_step.setdefault(record["step"], {}).update(record)
    if not by_step:
        raise ValueError(f"{path} has no step yet")
    return [by_step[step] for step in sorted(by_step)]


def smoothed(name: str, x: tuple, y: tuple) -> tuple[tuple, list[float]]:
    """The curve of one metric smoothed by an exponential moving average of weight 0.8, as TensorBoard's
    smoothing slider. A timing curve starts after the run's first step, whose time includes the warm-up
    (the engines' first batches, the first compiled kernels): carried into the average, it would hold the
    curve up for tens of steps."""
    skip = 1 if name.startswith("timing/") and len(x) > 1 else 0
    return x[skip:], list(itertools.accumulate(y[skip:], lambda last, value: 0.8 * last + 0.2 * value))


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's PNG (default `RUN_DIR/plot.png`) and return its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = read_metrics(run_dir)
    figure, axes = plt.subplots(len(PANELS), 1, figsize=(8, 9), sharex=True)
    for axis, (title, names) in zip(axes, PANELS.items(), strict=True):
        for name in names:
            points = [(s["step"], s[name]) for s in steps if name in s]
            if not points:
                continue
            x, y = zip(*points, strict=True)
            line = axis.plot(x, y, alpha=0.35 if len(x) > 10 else 1.0, label=name)[0]
            if len(x) > 10:
                axis.plot(*smoothed(name, x, y), color=line.get_color(), label=f"{name} (smoothed)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("optimizer step")
    figure.suptitle(str(run_dir.name))
    figure.tight_layout()
    out = Path(out) if out else run_dir / "plot.png"
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
