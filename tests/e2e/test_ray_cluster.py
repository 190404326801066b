"""`--ray.address` joins a Ray cluster someone else started, as a multi-node launch does (examples/slurm).

The test starts its own head (`ray start --head --block`, in a new process group) on a free port and stops
exactly that group at the end: `ray stop` would stop every Ray on the machine. The run attaches to the
session's engine (`--vllm.urls`), so the cluster hosts the actor and the agent hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt.vllm_server import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _wait_for_port(port: int, head: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited early"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the Ray head did not listen on port {port} within {timeout} s")


def _cluster_env(token: str) -> dict[str, str]:
    """The head's and the driver's environment: Ray workers run this interpreter (molt._cli), and the
    cluster's own token (Ray 2.60's `ray start` enables token auth; a joining driver must present it)."""
    return {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
    }


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head with 4 CPUs on a free port; yields its address and stops only its own processes."""
    port = free_port()
    env = _cluster_env(secrets.token_hex(32))
    log = (tmp_path / "ray-head.log").open("w")
    args = [str(BIN / "ray"), "start", "--head", "--port", str(port), "--num-cpus", "4", "--num-gpus", "0",
            "--include-dashboard", "false", "--disable-usage-stats", "--block"]  # fmt: skip
    head = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_port(port, head)
        yield f"127.0.0.1:{port}", head, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # anything of the group still left
        log.close()


def test_train_joins_an_existing_ray_cluster(tmp_path, tiny_model_dir, molt_engine, ray_head):
    address, head, env = ray_head
    run_dir = tmp_path / "run"
    args = [
        str(BIN / "molt"), "train", "--ray.address", address, "--model.path", str(tiny_model_dir),
        "--vllm.urls", molt_engine.url, "--logger.run_dir", str(run_dir), "--train.num_steps", "2",
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--logger.tensorboard", "false",
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]  # given an address, ray.init joins it or raises
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["train/token_identity"] == 1.0 for s in steps)
    assert head.poll() is None  # the run left the cluster it joined running
