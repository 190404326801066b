"""A run's own MPS server (`molt._mps`, `--vllm.mps`): when a run starts one, what it refuses, and that
every process started while it is open is its client. The control daemon is NVIDIA's and needs its driver:
on a CPU machine a stand-in (`molt_probes.fake_mps_control`) records what it is asked; the `gpu` test
runs the real one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import molt_probes as probes
import pytest

import molt._mps
import molt._validate
from molt._flags import resolve
from molt._mps import CONTROL, mps_report, mps_server, uses_mps
from molt.config import ConfigError


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: True)
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 1)  # auto: the engine and actor share it


@pytest.fixture
def control(monkeypatch, tmp_path) -> Path:
    """The stand-in control daemon (`molt_probes.fake_mps_control`)."""
    return probes.fake_mps_control(monkeypatch, tmp_path / "bin")


def _calls(run_dir: Path) -> list[str]:
    return (run_dir / "mps" / "calls").read_text().splitlines()


def test_processes_started_while_it_is_open_are_its_clients_and_it_quits_after(
    control, tmp_path, monkeypatch
):
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/the/user/s/own")  # restored after, as it was
    with mps_server(tmp_path) as _:
        pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.is_dir() and _calls(tmp_path) == [f"-d {pipe}"]  # started before anything else
        seen = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout.splitlines()
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in seen
        assert f"CUDA_MPS_LOG_DIRECTORY={(tmp_path / 'mps').resolve()}" in seen
    assert _calls(tmp_path) == [f"-d {pipe}", f"quit {pipe}"]  # the same daemon, told to quit
    assert not pipe.exists()
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/the/user/s/own"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_the_report_counts_the_servers_clients_and_says_when_there_are_none(control, tmp_path, monkeypatch):
    with mps_server(tmp_path):
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        monkeypatch.setenv("FAKE_MPS_CLIENTS", "101 102 103")
        assert mps_report(tmp_path).startswith("3 processes share the GPU under MPS (server 4242)")
        monkeypatch.setenv("FAKE_MPS_CLIENTS", "")  # every process outside the server
        assert mps_report(tmp_path).startswith("note: no process is a client of the run's MPS server")
    asked = [f"get_server_list {pipe}", f"get_client_list 4242 {pipe}"]
    assert _calls(tmp_path) == [f"-d {pipe}", *asked, *asked, f"quit {pipe}"]


def test_a_daemon_that_does_not_start_stops_the_run_naming_its_log_and_the_way_out(
    control, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_MPS_EXIT", "3")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its pipe directory would stay
    before = dict(os.environ)
    with (
        pytest.raises(RuntimeError, match=r"-d failed \(3.*mps.*--vllm.mps off"),
        mps_server(tmp_path / "run"),
    ):
        pytest.fail("no run starts without its MPS server")
    assert dict(os.environ) == before
    assert not list(tmp_path.glob("molt-mps-*"))


def test_a_daemon_that_does_not_start_under_auto_is_noted_and_the_run_goes_on_without(
    control, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FAKE_MPS_EXIT", "3")
    before = dict(os.environ)
    with mps_server(tmp_path, required=False) as running:
        assert not running and dict(os.environ) == before  # no server: its clients' variables unset
    said = capsys.readouterr().err
    assert "note: " in said and f"{CONTROL} -d failed (3" in said and "take turns" in said
    assert str(tmp_path / "mps") in said  # where its log is
    assert [call.split()[0] for call in _calls(tmp_path)] == ["-d"]  # asked to start, never to quit


def test_auto_starts_one_where_the_engine_shares_the_actors_gpu_and_the_daemon_is_there(with_cuda, control):
    assert resolve([]).vllm.placement == "shared"
    assert uses_mps(resolve([]))  # auto by default
    assert not uses_mps(resolve(["--vllm.mps", "off"]))


def test_auto_starts_none_where_the_runs_processes_are_clients_of_a_server_already(
    with_cuda, control, monkeypatch, tmp_path
):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/the/user/s/own")
    assert not uses_mps(resolve([]))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    assert uses_mps(resolve([]))
    (tmp_path / "machine").mkdir()
    (tmp_path / "machine" / "control").touch()  # the machine's daemon, at CUDA's default pipe directory
    monkeypatch.setattr(molt._mps, "DEFAULT_PIPE", str(tmp_path / "machine"))
    assert not uses_mps(resolve([]))
    assert uses_mps(resolve(["--vllm.mps", "on"]))  # asked for: a server of the run's own


def test_auto_starts_none_for_gpus_of_their_own_or_without_the_daemon(with_cuda, control, monkeypatch):
    assert not uses_mps(resolve(["--vllm.placement", "shared", "--ray.address", "head:6379"]))
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 2)  # auto places them apart
    assert resolve(["--vllm.mps", "auto"]).vllm.placement == "separate"
    assert not uses_mps(resolve(["--vllm.mps", "auto"]))
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 1)
    monkeypatch.setenv("PATH", "/nowhere")
    assert resolve(["--vllm.mps", "auto"]).vllm.placement == "shared"
    assert not uses_mps(resolve(["--vllm.mps", "auto"]))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        pytest.param(["--vllm.placement", "separate"], ["--vllm.placement separate"], id="gpus-of-their-own"),
        pytest.param(["--ray.address", "head:6379"], ["--ray.address"], id="joined-cluster"),
        pytest.param(["--vllm.urls", "http://127.0.0.1:1"], ["--vllm.mps", "--vllm.urls"], id="attached"),
    ],
)
def test_on_is_refused_where_it_cannot_act(args, named, with_cuda, control, monkeypatch):
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 2)  # enough for GPUs of their own
    with pytest.raises(ConfigError) as error:
        resolve([*args, "--vllm.mps", "on"])
    assert all(flag in str(error.value) for flag in ["--vllm.mps", *named])


def test_on_without_the_daemon_is_refused_naming_it(with_cuda, monkeypatch):
    monkeypatch.setenv("PATH", "/nowhere")
    with pytest.raises(ConfigError, match=f"--vllm.mps on needs NVIDIA's {CONTROL} on PATH"):
        resolve(["--vllm.mps", "on"])


SHARE = """
import sys, torch, torch.multiprocessing as mp

def receive(queue, done):
    tensor = queue.get()
    done.put(float(tensor.sum()))

if __name__ == "__main__":
    mp.set_start_method("spawn")
    queue, done = mp.Queue(), mp.Queue()
    child = mp.Process(target=receive, args=(queue, done))
    child.start()
    sent = torch.arange(1024, device="cuda", dtype=torch.float32)
    queue.put(sent)  # over CUDA IPC, as a refit on a shared GPU hands the engine its buckets
    print(done.get(timeout=60))
    child.join()
"""


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"needs NVIDIA's {CONTROL}")
@pytest.mark.parametrize("allocator", ["expandable_segments:True", ""], ids=["as-the-actor", "torch-default"])
def test_cuda_processes_started_inside_are_clients_of_the_real_server_and_share_memory(allocator, tmp_path):
    env = {"PYTORCH_CUDA_ALLOC_CONF": allocator}  # the actor's (`molt._group.worker_env`), and torch's own
    script = tmp_path / "share.py"  # a file: a spawned child imports its `receive` from it
    script.write_text(SHARE)
    with mps_server(tmp_path):
        shared = subprocess.run([sys.executable, str(script)], env=os.environ | env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert float(shared.stdout.split()[-1]) == sum(range(1024))
    log = (tmp_path / "mps" / "control.log").read_text()
    assert log.count("NEW CLIENT") >= 2, log  # the sender and the receiver
