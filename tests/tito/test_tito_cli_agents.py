"""The two CLI agents people train, stock, against tito: Claude Code (`claude -p`) and Codex CLI (`codex
exec` with a Responses-API provider), installed from npm into a cache and run offline.

The engine is the fake one (fake_engine.py), served on loopback with a context of a million tokens: each
CLI's first request is tens of thousands of tokens (its system prompt and tool schemas), past the tiny
test model's context, so no real engine here can take it. What is tested is tito's side: every request
the CLI sends is accepted (no 4xx), rendered, captured, and the CLI prints the scripted reply.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import msgspec
import pytest
from test_tito_app import encode
from tito_helpers import LiveServer

from tito import Tito, Trajectory, create_app

pytestmark = pytest.mark.slow
CACHE = Path(os.environ.get("MOLT_NPM_CACHE", Path.home() / ".cache" / "molt-tests" / "cli-agents"))
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1",
}  # fmt: skip


def cli(name: str) -> Path:
    """The CLI's binary, installed from npm into CACHE once; skips saying why when it cannot be."""
    binary = CACHE / "node_modules" / ".bin" / name
    if binary.exists():
        return binary
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed, so {PACKAGES[name]} cannot be installed")
    CACHE.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(CACHE), *PACKAGES.values()],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm install {PACKAGES[name]} failed: {done.stderr[-500:]}")
    return binary


@pytest.fixture
def served(tiny_model_dir, fake_engine, tokenizer):
    """(tito, its URL), over the fake engine on loopback, every reply the text "hi"."""
    fake_engine.max_model_len = 1_000_000
    reply = encode(tokenizer, "hi") + [tokenizer.eos_token_id]
    fake_engine.reply_for = lambda prompt, max_tokens: (list(reply), "stop")
    with LiveServer(fake_engine.app) as engine:
        tito = Tito([engine.url], tiny_model_dir, served_model_name="tiny")
        with LiveServer(create_app(tito)) as server:
            yield tito, server.url


def run_cli(command: list[str], env: dict, home: Path) -> subprocess.CompletedProcess:
    environment = {"PATH": os.environ["PATH"], "HOME": str(home), **QUIET, **env}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, cwd=home)


def trajectory_of(url: str, session: dict) -> Trajectory:
    return msgspec.json.decode(
        httpx.get(f"{url}/sessions/{session['id']}/trajectory").content, type=Trajectory
    )


def test_claude_code_stock(served, tmp_path):
    claude = cli("claude")
    tito, url = served
    session = httpx.post(f"{url}/sessions").json()
    env = {
        "ANTHROPIC_BASE_URL": session["session_url"], "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_SMALL_FAST_MODEL": "tiny", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
    }  # fmt: skip
    done = run_cli(
        [str(claude), "-p", "say hi", "--model", "tiny", "--dangerously-skip-permissions"], env, tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "hi" in done.stdout
    captured = trajectory_of(url, session)
    assert captured.turns and {turn.route for turn in captured.turns} == {"messages"}
    sent = {name for turn in captured.turns for name in turn.fields}
    assert "query" in sent  # ?beta=true
    assert {"context_management", "output_config"} <= sent  # recorded, as they change no token here
    assert any(note.startswith("thinking") for turn in captured.turns for note in turn.notes)


def test_codex_exec_over_the_responses_api(served, tmp_path):
    codex = cli("codex")
    tito, url = served
    session = httpx.post(f"{url}/sessions").json()
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "local"\n[model_providers.local]\nname = "local"\n'
        f'base_url = "{session["base_url"]}"\nwire_api = "responses"\nenv_key = "LOCAL_API_KEY"\n'
    )
    command = [
        str(codex), "exec", "--skip-git-repo-check", "-s", "read-only", "--disable", "plugins",
        "--disable", "multi_agent", "--disable", "goals", "-c", "analytics.enabled=false",
        "-c", 'web_search="disabled"', "say hi",
    ]  # fmt: skip
    done = run_cli(command, {"CODEX_HOME": str(home), "LOCAL_API_KEY": "unused"}, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "hi" in done.stdout
    captured = trajectory_of(url, session)
    assert captured.turns and {turn.route for turn in captured.turns} == {"responses"}
    assert "reasoning" in {name for turn in captured.turns for name in turn.fields}
