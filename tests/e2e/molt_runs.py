"""Running `molt` as a user does (its console script, in a subprocess), on the session's shared Ray
cluster, and reading a run's metrics."""

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
from types import SimpleNamespace

BIN = Path(sys.executable).parent
MOLT = str(BIN / "molt")
LETTERS_AGENT = str(Path(__file__).with_name("letters_agent.py"))


def molt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`molt ARGS`, which must succeed; its output is in the assertion message when it does not."""
    result = subprocess.run(
        [MOLT, *args], capture_output=True, text=True, timeout=900, env=env or {**os.environ}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def steps_of(run_dir: Path) -> dict[int, dict]:
    """Each step's last record (a resumed run logs the steps after its checkpoint again)."""
    return {s["step"]: s for s in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def reproducible_run_args(model_dir: Path, engine_url: str, ray_address: str) -> list[str]:
    """Flags under which two runs on the shared engine sample the same rollouts while their weights are
    equal: seeded requests, strict on-policy steps (a step takes exactly the groups it started), the
    dense-reward agent with replies of up to 6 tokens, a checkpoint every 2 steps."""
    return [
        "--model.path", str(model_dir), "--vllm.urls", engine_url, "--ray.address", ray_address,
        "--agent.module", LETTERS_AGENT, "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
        "--rollout.max_new_tokens", "6",
        "--train.force_on_policy", "--rollout.seed_requests", "--ckpt.every", "2",
        "--logger.tensorboard", "false",
    ]  # fmt: skip


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


@contextlib.contextmanager
def ray_head(log_path: Path):
    """A Ray head (`ray start --head --block`, 4 CPUs, in its own process group) on a free port, as a
    multi-node launch starts one. Yields `.address`, `.process` and `.env`: the environment a joining
    driver needs (this interpreter for the workers, and the cluster's token: Ray 2.60's `ray start`
    enables token auth). Stops exactly its own processes (`ray stop` would stop every Ray here)."""
    from molt.vllm_server import free_port

    port = free_port()
    env = {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    args = [str(BIN / "ray"), "start", "--head", "--port", str(port), "--num-cpus", "4", "--num-gpus", "0",
            "--include-dashboard", "false", "--disable-usage-stats", "--block"]  # fmt: skip
    with log_path.open("w") as log:
        head = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for_port(port, head)
            yield SimpleNamespace(address=f"127.0.0.1:{port}", process=head, env=env)
        finally:
            os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:  # once drivers have used the cluster it does not finish within 30 s: kill it after 5
                head.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)  # anything of the group still left
