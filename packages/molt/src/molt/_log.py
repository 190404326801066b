"""Where a run's numbers go: `metrics.jsonl` (one object per step), TensorBoard, one console line a step."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

__all__ = ["RunLog", "progress"]


def progress(message: str) -> None:
    """A start-up or shutdown line on stderr, so long waits (engines loading) are visible."""
    print(f"[molt {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class RunLog:
    def __init__(self, run_dir: Path, *, num_steps: int, tensorboard: bool) -> None:
        self.num_steps = num_steps
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        print(self._line(step, metrics), flush=True)

    def _line(self, step: int, m: dict[str, float]) -> str:
        return (
            f"step {step}/{self.num_steps} | reward {m['rollout/reward_mean']:.3f}"
            f" | len {m['rollout/response_len_mean']:.1f} | loss {m['train/policy_loss']:+.4f}"
            f" | mismatch_kl {m['train/mismatch_kl']:.1e} | stale {m['train/staleness_mean']:.2f}"
            f" | gen {m['timing/generation']:.1f}s train {m['timing/policy_train']:.1f}s"
            f" refit {m['timing/broadcast']:.1f}s | {m['timing/step_total']:.1f}s/step"
        )

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
