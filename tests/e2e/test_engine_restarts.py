"""An engine molt started comes back after it dies: a run whose only engine is killed twice, once while it
generates and once while it takes a refit, finishes every step, restarted twice (`engines/restarts`), and
the restarted engine samples with weights the trainer pushed, never with the initial ones it starts with.

The run starts its own engine (an engine attached with --vllm.urls cannot be restarted by molt) on the
session's Ray cluster. The kills are SIGKILL to the engine's server process, found by the run's own model
directory on its command line (as `molt.vllm_server.VLLMServer` starts it).
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from molt_runs import LETTERS_AGENT, molt, steps_of

from molt import read_rollouts

pytestmark = pytest.mark.slow


def engine_pids(marker: str) -> dict[int, str]:
    """The vLLM servers whose command line mentions `marker`: pid -> their URL (from `--port`)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if marker in args and "molt.vllm_server" in args:
            found[int(entry.name)] = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    return found


class Killer(threading.Thread):
    """SIGKILLs the run's engine once step `first` is logged (it is generating then), and again once the
    restarted engine has served until step `second` is logged, as soon as it is paused for a refit."""

    def __init__(self, run_dir: Path, marker: str, first: int, second: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.marker, self.first, self.second = run_dir, marker, first, second
        self.done, self.killed = threading.Event(), []

    def wait_for_step(self, step: int) -> bool:
        while not self.done.is_set():
            metrics = self.run_dir / "metrics.jsonl"
            if metrics.is_file() and max(steps_of(self.run_dir), default=0) >= step:
                return True
            time.sleep(0.1)
        return False

    def kill(self, pid: int, when: str) -> None:
        import os

        os.kill(pid, signal.SIGKILL)
        self.killed.append((pid, when))

    def run(self) -> None:
        if not self.wait_for_step(self.first):
            return
        (pid,) = engine_pids(self.marker)
        self.kill(pid, "generating")
        if not self.wait_for_step(self.second):
            return
        ((pid, url),) = engine_pids(self.marker).items()
        with httpx.Client(timeout=2) as http:
            while not self.done.is_set():
                try:
                    if http.get(f"{url}/is_paused").json()["is_paused"]:
                        self.kill(pid, "paused for a refit")
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)


def test_an_engine_killed_while_generating_and_while_refitting_comes_back(
    tmp_path, tiny_model_dir, ray_cluster
):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")  # marks this run's engine processes
    run_dir = tmp_path / "run"
    killer = Killer(run_dir, str(model_dir), first=2, second=4)
    killer.start()
    try:
        molt(
            "train", "--model.path", str(model_dir), "--logger.run_dir", str(run_dir),
            "--ray.address", ray_cluster.address, "--agent.module", LETTERS_AGENT,
            "--train.num_steps", "9", "--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
            "--rollout.max_new_tokens", "8", "--vllm.max_restarts", "2", "--logger.tensorboard", "false",
            "--train.rollout_dump_dir", str(tmp_path / "rollouts"),
            env=ray_cluster.env,
        )  # fmt: skip
    finally:
        killer.done.set()
        killer.join()
    assert [when for _, when in killer.killed] == ["generating", "paused for a refit"]
    steps = steps_of(run_dir)
    assert sorted(steps) == list(range(1, 10))
    assert steps[9]["engines/restarts"] == 2.0
    assert steps[9]["engines/alive"] == 1.0
    # Token identity: a step whose trainable tokens differ from what the engines sampled raises before it
    # trains (`molt.loop.check_token_identity`), so nine logged steps held it.
    # A restarted engine gets the trainer's current weights before it serves. One that served the weights
    # it starts with would label its tokens version 0 (vLLM's "default"); from step 4 on, with the kill
    # after step 2 and --rollout.max_lag 1, every trained token comes from a version the trainer pushed.
    late = [record for record in read_rollouts(tmp_path / "rollouts") if record.step >= 4]
    assert {record.step for record in late} == set(range(4, 10))
    for record in late:
        versions = [v for s in record.segments for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
        assert min(versions) >= 1, (record.step, versions)
    assert not engine_pids(str(model_dir)), "the run left an engine behind"
