"""molt's public names, and that importing molt stays light (no torch, Ray or vLLM)."""

import subprocess
import sys

import molt


def test_public_names_are_pinned():
    assert sorted(molt.__all__) == [
        "ChatAgent", "Context", "Env", "Result", "RolloutRecord", "read_rollouts", "train"
    ]  # fmt: skip
    assert all(hasattr(molt, name) for name in molt.__all__)


def test_importing_molt_loads_no_heavy_framework():
    code = "import sys, molt; print(sorted({'torch', 'ray', 'vllm'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_engine_actors_module_loads_no_torch():
    """A Ray worker imports `molt._engines` to build its `EngineActor`, before the vLLM server it starts can
    begin its own imports: torch there would be seconds on every engine's start-up."""
    code = "import sys, molt._engines; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
