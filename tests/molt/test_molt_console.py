"""What a newcomer sees: molt's own lines and every error on the console, other libraries' output in the
run directory (`molt._log.quiet_console`), and the start-up clock. The console is a real subprocess's
stderr, since the redirection works on file descriptors."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest

from molt._log import StartupClock, _process_started

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, warnings
    from pathlib import Path
    from molt._log import progress, quiet_console

    with quiet_console(Path(sys.argv[1]), verbose=sys.argv[2] == "verbose"):
        warnings.warn("a third-party warning")
        print("a progress bar 100%|#####|", file=sys.stderr)
        os.write(2, b"a C++ log line\\n")
        logging.getLogger("transformers").warning("a third-party log line")
        progress("molt's own line")
        logging.getLogger("asyncpool").warning("an agent failed: its first traceback")
        raise RuntimeError("the run failed")
    """
)
THIRD_PARTY = ("a third-party warning", "a progress bar", "a C++ log line", "a third-party log line")


def _run(tmp_path, mode: str) -> tuple[str, str]:
    log = tmp_path / "molt.log"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(log), mode], capture_output=True, text=True)
    assert result.returncode == 1
    return result.stderr, log.read_text() if log.exists() else ""


def test_other_libraries_output_goes_to_the_run_directory_and_errors_to_the_console(tmp_path):
    console, log = _run(tmp_path, "quiet")
    for text in ("molt's own line", "an agent failed: its first traceback", "RuntimeError: the run failed"):
        assert text in console
    assert f"other libraries' output goes to {tmp_path}/*.log" in console
    for text in THIRD_PARTY:
        assert text not in console and text in log


def test_verbose_shows_everything_on_the_console(tmp_path):
    console, log = _run(tmp_path, "verbose")
    for text in (*THIRD_PARTY, "molt's own line", "RuntimeError: the run failed"):
        assert text in console
    assert log == ""


def test_the_startup_clock_counts_from_the_process_start_and_times_each_stage():
    assert 0 < time.monotonic() - _process_started() < 3600  # this test process started before it
    clock = StartupClock()
    clock.end("driver")  # from the process's start: this test process's age
    clock.begin("ray")
    time.sleep(0.05)
    clock.end("ray")
    metrics = clock.metrics()
    assert metrics["timing/startup_driver"] == pytest.approx(time.monotonic() - _process_started(), abs=0.5)
    assert metrics["timing/startup_ray"] == pytest.approx(0.05, abs=0.04)
    assert metrics["timing/startup_total"] >= metrics["timing/startup_driver"] + metrics["timing/startup_ray"]
    assert clock.line().index("driver ") < clock.line().index("ray 0.")
    clock.split("ray", {"load": 0.02, "warm_up": 0.01})  # as an actor group reports its ranks' parts
    assert clock.metrics()["timing/startup_ray_load"] == 0.02
    assert re.search(r"ray 0\.\d s \(load 0\.0 s, warm_up 0\.0 s\)", clock.line()), clock.line()


def test_bytecode_is_allowed_for_the_run_and_what_it_starts(tmp_path):
    script = "import os, sys; from molt._log import allow_bytecode; allow_bytecode(); " \
             "print(os.environ.get('PYTHONDONTWRITEBYTECODE'), sys.dont_write_bytecode)"  # fmt: skip
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.stdout.split() == ["None", "False"]
    assert "PYTHONDONTWRITEBYTECODE is set" in result.stderr and "twice as long" in result.stderr
