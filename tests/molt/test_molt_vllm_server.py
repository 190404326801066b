"""`molt.vllm_server`: a failed engine start names its root cause (`first_error`), not only the API
server's closing traceback; the server imports vLLM without starting CUDA; a server started ahead
(`prestart`) serves with the flags and environment it is handed, and is stopped however its start ends.
The logs below are real vLLM 0.26 logs, cut short: an engine core that died at start on an H200 (LoRA
kernels given float32 weights), and an API server that refused its arguments."""

import errno
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import molt._engines
from molt._engines import prestart_engines, stop_prestarted
from molt.config import VLLM, Config
from molt.vllm_server import VLLMServer, engine_args, first_error, handoff_path, prestart, stop_process

_ENGINE_CORE_DIED = """\
(APIServer pid=1903) WARNING 12-02 13:56:10 [system_utils.py:299] Found ulimit of 20000 and failed to \
automatically increase with error current limit exceeds maximum limit.
(EngineCore pid=1936) ERROR 12-02 13:57:12 [core.py:1330] EngineCore failed to start.
(EngineCore pid=1936) ERROR 12-02 13:57:12 [core.py:1330] Traceback (most recent call last):
(EngineCore pid=1936) ERROR 12-02 13:57:12 [core.py:1330]   File "lora_expand_op.py", line 183, in _expand
(EngineCore pid=1936) ERROR 12-02 13:57:12 [core.py:1330]     assert weight.dtype in [torch.float16, ...]
(EngineCore pid=1936) ERROR 12-02 13:57:12 [core.py:1330]            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore pid=1936) ERROR 12-02 13:57:12 [core.py:1330] AssertionError
(EngineCore pid=1936) Process EngineCore:
(APIServer pid=1903) Traceback (most recent call last):
(APIServer pid=1903)   File "vllm/v1/engine/utils.py", line 1272, in wait_for_engine_startup
(APIServer pid=1903)     raise RuntimeError(
(APIServer pid=1903) RuntimeError: Engine core initialization failed. See root cause above.
"""

_ARGUMENTS_REFUSED = """\
INFO 12-02 14:10:01 [utils.py:253] non-default args: {'model': '/tmp/model'}
Traceback (most recent call last):
  File "vllm/engine/arg_utils.py", line 1500, in create_model_config
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
"""


def test_the_first_error_is_the_engine_cores_root_cause_with_the_frame_that_raised():
    found = first_error(_ENGINE_CORE_DIED).splitlines()
    assert found[-1].endswith("] AssertionError")
    assert any("assert weight.dtype" in line for line in found)
    assert not any("Engine core initialization failed" in line for line in found)


def test_a_dotted_exception_name_without_a_process_prefix_is_found():
    assert first_error(_ARGUMENTS_REFUSED).endswith("ValidationError: 1 validation error for ModelConfig")


def test_the_engine_command_names_its_context_once():
    """vLLM warns of a flag given twice ("Found duplicate keys"): the run's own context replaces the
    default one instead of following it."""
    default = engine_args("m", port=1, extra=[], on_cpu=True)
    given = engine_args("m", port=1, extra=["--max-model-len", "512"], on_cpu=True)
    assert default[default.index("--max-model-len") + 1] == "2048"
    assert given.count("--max-model-len") == 1 and given[given.index("--max-model-len") + 1] == "512"


def test_a_log_without_an_exception_gives_nothing():
    assert first_error("INFO 12-02 14:10:01 [api_server.py:1] Starting vLLM API server\n") == ""


def test_a_server_that_exits_at_start_takes_what_it_started_with_it(tmp_path):
    """A stand-in for `vllm serve` (no vLLM here): it starts a child, as the API server starts its engine
    core, then exits; the failed start must not leave the child holding the engine's GPU memory."""
    server = VLLMServer("model", log_path=tmp_path / "server.log", on_cpu=True)
    child = "import time; time.sleep(60)"
    spawn = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}])"
    server.args = [sys.executable, "-c", f"{spawn}; time.sleep(0.5); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3"):
        server.start()
    assert _group_ends(server.process.pid)


def _group_ends(group: int, timeout: float = 10.0) -> bool:
    """Whether every process of the group is gone (or a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive_in_group(group):
        time.sleep(0.1)
    return not _alive_in_group(group)


def _alive_in_group(group: int) -> bool:
    """Whether a live (not zombie) process is in this process group."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


# A fresh interpreter runs IMPORT (vLLM's server, as `molt.vllm_server` imports it or not), counting torch's
# probes of a device for Triton (a CUDA context on a GPU), then prints the count, whether CUDA started and
# whether torchao was imported, as JSON.
_PROBES = """
import json, sys
import torch._dynamo.device_interface as devices
from torch.utils._triton import has_triton
assert has_triton.cache_info().currsize == 0, "asked before the import"
probes, interface = [], devices.get_interface_for_device
def counting(device):
    probes.append(str(device))
    return interface(device)
devices.get_interface_for_device = counting
{IMPORT}
import torch
print(json.dumps(dict(probes=len(probes), cached=has_triton.cache_info().currsize,
    cuda=torch.cuda.is_initialized(), torchao="torchao" in sys.modules)))
"""


def _import_in_a_fresh_interpreter(import_line: str) -> dict:
    code = _PROBES.replace("{IMPORT}", import_line)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_vllms_server_imports_without_torchao_nor_probing_a_device():
    """Importing vLLM's server imports torchao (through transformers), which asks torch at import whether
    Triton runs on the device and for its compute capability; on a GPU either question starts CUDA, and
    vLLM then spawns its engine core (a fresh interpreter importing vLLM again) instead of forking it.
    `import_server` imports it with torchao blocked: no probe, no answer cached (the engine core probes
    when it compiles), and torchao importable again afterwards."""
    plain = _import_in_a_fresh_interpreter("from vllm.entrypoints.openai import api_server")
    assert plain["probes"] > 0 and plain["cached"] == 1 and plain["torchao"]  # what this guards against
    ours = _import_in_a_fresh_interpreter("from molt.vllm_server import import_server; import_server()")
    assert ours == dict(probes=0, cached=0, cuda=False, torchao=False)
    blocked_then_freed = _import_in_a_fresh_interpreter(
        "from molt.vllm_server import import_server; import_server(); import torchao"
    )
    assert blocked_then_freed["torchao"]  # the block lasts for the import only


@pytest.mark.gpu
def test_on_a_gpu_vllms_server_imports_without_starting_cuda():
    ours = _import_in_a_fresh_interpreter("from molt.vllm_server import import_server; import_server()")
    assert ours["probes"] == 0 and not ours["cuda"] and not ours["torchao"]


@pytest.mark.slow
def test_the_servers_log_says_when_it_started_and_what_vllms_import_took():
    """The engine log's first line: the process's start (to set beside the run's start-up line) and the
    seconds of vLLM's import, before vLLM logs anything."""
    done = subprocess.run(
        [sys.executable, "-m", "molt.vllm_server", "--help"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.search(
        r"molt.vllm_server: started (\d\d:\d\d:\d\d\.\d), vLLM's server imported in ([\d.]+) s", done.stdout
    )
    assert said is not None, done.stdout[:2000]
    assert 0.5 < float(said[2]) < 600  # vLLM's import is seconds, even on a fast machine
    assert done.stdout.index("molt.vllm_server:") < done.stdout.index("usage:")  # before vLLM's own output


@pytest.mark.slow
def test_a_server_started_ahead_serves_with_the_flags_and_environment_it_is_handed(tiny_model_dir, tmp_path):
    """`prestart`: the process imports vLLM, then waits; `VLLMServer(prestarted=pid)` hands it its flags
    and environment as a server it did not start (a run's engine actor, another process). The handed
    environment counts: started without vLLM's RL endpoints (`VLLM_SERVER_DEV_MODE=0`), it is handed the
    engine's (`1`), and serves them."""
    log = tmp_path / "engine.log"
    process = prestart(log, on_cpu=True, env={"VLLM_SERVER_DEV_MODE": "0"})
    try:
        server = VLLMServer(tiny_model_dir, log_path=log, on_cpu=True, prestarted=process.pid)
        assert server.env["VLLM_SERVER_DEV_MODE"] == "1"
        server.start()
        with urllib.request.urlopen(f"{server.url}/is_paused", timeout=10) as reply:  # an RL endpoint
            assert json.loads(reply.read()) == {"is_paused": False}
        first = next(line for line in log.read_text().splitlines() if line.startswith("molt.vllm_server:"))
        assert re.search(r"imported in [\d.]+ s, handed its flags [\d.]+ s later", first), first
        assert not handoff_path(log).exists()
        server.stop()
        assert _group_ends(process.pid)
    finally:
        stop_process(process)
    assert process.returncode is not None  # reaped by the process that started it


def test_a_server_started_ahead_that_died_fails_the_hand_off_with_its_log(tmp_path):
    """A server that exited before its flags came (here killed while it imports vLLM) is a failed start
    with its log, not a wait: its exit leaves a zombie until its parent reaps it, which counts as exited."""
    log = tmp_path / "engine.log"
    process = prestart(log, on_cpu=True)
    process.kill()
    server = VLLMServer("model", log_path=log, on_cpu=True, prestarted=process.pid)
    with pytest.raises(RuntimeError, match="exited before it was handed its flags .*engine.log"):
        server.start()
    stop_process(process)


def test_a_server_started_ahead_and_never_handed_its_flags_stops_with_the_run(tmp_path):
    """A run that fails before its engines' actors start: `stop_prestarted` stops the servers it started
    ahead, reaps them and removes their pipes."""
    logs = [tmp_path / "engine-0.log", tmp_path / "engine-1.log"]
    processes = [prestart(log, on_cpu=True) for log in logs]
    stop_prestarted(processes)
    assert all(process.returncode is not None for process in processes)
    assert all(_group_ends(process.pid) for process in processes)
    assert not any(handoff_path(log).exists() for log in logs)


def test_a_run_directory_without_named_pipes_leaves_the_engines_to_their_actors(tmp_path, monkeypatch):
    """Some network file systems hold no named pipes: no server starts ahead (the actors start theirs, as
    where Ray is remote), and the one started before the failing one is stopped, not left waiting."""
    pipes, started = [], []

    def second_fails(path, mode=0o666):
        if pipes:
            raise OSError(errno.EPERM, "named pipes are not supported here", str(path))
        pipes.append(Path(path))
        real_mkfifo(path, mode)

    def recording(*args, **kwargs):
        started.append(real_prestart(*args, **kwargs))
        return started[-1]

    real_mkfifo, real_prestart = os.mkfifo, molt._engines.prestart
    monkeypatch.setattr(os, "mkfifo", second_fails)
    monkeypatch.setattr(molt._engines, "prestart", recording)
    assert prestart_engines(Config(vllm=VLLM(num_engines=2)), tmp_path) == []
    assert len(started) == 1 and started[0].returncode is not None  # stopped and reaped
    assert _group_ends(started[0].pid) and not pipes[0].exists()
