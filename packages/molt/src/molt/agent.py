"""The agent contract: what a user writes, in plain Python.

An agent module (`--agent.module FILE_OR_MODULE`) exports `AgentRunner`, a subclass of one of:

- `Env`: the framework owns the LLM loop. `reset(sample)` returns the first observation (chat messages,
  or one user message as a string); the framework renders it, samples a reply and calls `step(reply)`,
  which returns a `Result`. A `Result` with an `observation` continues the episode (multi-turn): the
  framework appends the new messages to the token trace and samples again.
- `ChatAgent`: the user owns the loop. `run(ctx, sample)` talks to `ctx.base_url` with an OpenAI SDK (or
  to `ctx.session_url` with an Anthropic SDK) as to any server, and returns a `Result`.

Images (a vision-language policy, e.g. a Qwen-VL model): a user message's content may be a list of
OpenAI parts, text (`{"type": "text", "text": ...}`) and images (`{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}`, or a local file path as the URL), in the first observation, in
an observation a step returns, in a dataset row's messages, and in a ChatAgent's SDK calls (Anthropic
`image` blocks too). A text-only policy refuses an image instead of ignoring it.

A fresh `AgentRunner()` serves each rollout, so it may keep per-episode state. Methods may be plain or
`async`. A module may also export `dataset(seed) -> Iterable[dict]`, the rows used when no `--data.path`
is given (each row: chat `messages` plus task fields, e.g. the expected answer).

`--agent.module MODULE:ENV` names one environment of a module that serves many (`molt.integrations`):
the module exports `load(env)`, which returns the namespace (`AgentRunner`, `dataset`, ...) for that one.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChatAgent", "Context", "Env", "Result", "load_agent"]

Observation = list[dict] | str


@dataclass
class Result:
    """What a step (Env) or an episode (ChatAgent) returns.

    `reward`: any finite number; an Env's rollout reward is the sum over its steps. `observation`: the
    next messages (or one user message; its content may hold images, see the module docstring) to
    continue an Env episode; None ends it. `info`: numbers to log
    as `rollout/<key>` means.
    """

    reward: float = 0.0
    observation: Observation | None = None
    info: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    """Where a ChatAgent's SDK client points: one tito session, captured token by token.

    The run's `--rollout.temperature` and `--rollout.top_p` apply to every request whatever the agent
    asks (the trainer's logprobs assume them), and `--rollout.max_new_tokens` caps each reply.
    """

    base_url: str  # OpenAI SDK: OpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    session_url: str  # Anthropic SDK: Anthropic(base_url=ctx.session_url, api_key=ctx.api_key)
    model: str
    api_key: str = "molt"


class Env:
    """Subclass and implement `reset` and `step` (see the module docstring)."""

    def reset(self, sample: dict[str, Any]) -> Observation:
        """The first observation; by default the row's chat messages."""
        return sample["messages"]

    def step(self, action: str) -> Result:
        """Score the model's reply (its text, special tokens removed); return the next observation or None."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(action) -> Result")


class ChatAgent:
    """Subclass and implement `run` (see the module docstring)."""

    def run(self, ctx: Context, sample: dict[str, Any]) -> Result | Awaitable[Result]:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx, sample) -> Result")


def load_agent(spec: str):
    """The agent module named by `--agent.module`: a Python file path or an importable module name,
    optionally `:ENV` for a module that exports `load(env)` (module docstring)."""
    module, _, env = (spec, "", "") if Path(spec).is_file() else spec.partition(":")
    loaded = _import_agent(module)
    if env:
        if not callable(getattr(loaded, "load", None)):
            raise ValueError(f"--agent.module {spec!r}: {module} exports no load(env); drop ':{env}'")
        loaded = loaded.load(env)
    runner = getattr(loaded, "AgentRunner", None)
    if not (isinstance(runner, type) and issubclass(runner, Env | ChatAgent)):
        raise ValueError(
            f"--agent.module {spec!r} must export AgentRunner, a subclass of molt.Env or molt.ChatAgent"
        )
    return loaded


def _import_agent(module: str):
    if module.endswith(".py") or Path(module).is_file():
        path = Path(module)
        if not path.is_file():
            raise ValueError(f"--agent.module {module!r}: no such file")
        if str(path.resolve().parent) not in sys.path:  # its sibling modules import, as for a script
            sys.path.insert(0, str(path.resolve().parent))
        spec = importlib.util.spec_from_file_location(f"molt_agent_{path.stem}", path)
        assert spec is not None and spec.loader is not None  # a file's spec, with its source loader
        loaded = sys.modules.get(spec.name)
        if loaded is None or getattr(loaded, "__file__", None) != spec.origin:  # once per file and process
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = loaded
            spec.loader.exec_module(loaded)
    else:
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as error:
            raise ValueError(f"--agent.module {module!r}: cannot import it ({error})") from error
    return loaded
