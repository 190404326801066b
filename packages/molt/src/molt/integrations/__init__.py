"""Environments from other libraries, trained as they are: `--agent.module molt.integrations.LIB:ENV`.

- `reasoning_gym:TASK[,key=value...]`: a reasoning-gym task's seeded rows and its own `score_answer`.
- `textarena:GAME-ID`: a single-player textarena game as a multi-turn Env.
- `verifiers:TASKSET-MODULE`: a verifiers 0.4 taskset, its model calls sent through tito.

Each library is optional (`uv sync --group envs`); a missing one is named with the command that installs it.
`ENV` is the library's own name for the environment, then optional `key=value` settings, comma-separated
(values read as Python literals, else as text; a tuple or quoted text may hold commas).
"""

from __future__ import annotations

import ast
import importlib
import warnings

__all__ = ["parse_env", "require"]


def parse_env(env: str) -> tuple[str, dict]:
    """`NAME,key=value,...` -> (NAME, {key: value}); a value is a Python literal where it parses as one."""
    name, *pairs = [part.strip() for part in _split(env)]
    settings = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"environment {env!r}: {pair!r} is not key=value (settings follow NAME, comma-separated)"
            )
        try:
            settings[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            settings[key.strip()] = text.strip()
    if not name:
        raise ValueError(f"environment {env!r}: the name comes first, e.g. basic_arithmetic,min_terms=2")
    return name, settings


def _split(env: str) -> list[str]:
    """Split at the commas outside brackets and quotes (a value may be a tuple or quoted text)."""
    parts, depth, quote, start = [], 0, "", 0
    for index, char in enumerate(env):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(env[start:index])
            start = index + 1
    return [*parts, env[start:]]


def require(module: str, package: str):
    """Import an optional library, or say how to install it."""
    try:
        with warnings.catch_warnings():  # cellpylib (a reasoning-gym dependency) warns when first compiled
            warnings.simplefilter("ignore", SyntaxWarning)
            return importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"this environment needs the {package} package ({error}): install it with `uv sync --group envs` "
            f"(or `pip install {package}`)"
        ) from error
