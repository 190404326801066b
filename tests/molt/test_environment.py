"""The project environment holds the whole stack: the CPU build of vLLM, NeMo AutoModel and Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_vllm_automodel_and_ray_import_together():
    code = "import nemo_automodel, ray, torch, vllm\nprint(vllm.__version__, ray.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    vllm_version, ray_version = result.stdout.split()
    assert vllm_version.startswith("0.26") and ray_version.startswith("2.60")
