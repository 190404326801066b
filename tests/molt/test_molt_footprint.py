"""scripts/footprint.py, which counts the RL path's lines for the README: what it follows and what not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _footprint():
    spec = importlib.util.spec_from_file_location("footprint", ROOT / "scripts" / "footprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rl_path_is_what_a_run_imports_and_not_what_a_user_picks_by_name():
    footprint = _footprint()
    names = set(footprint.reachable(footprint.workspace_modules()))
    assert {
        "molt._cli", "molt.loop", "molt._actor", "molt._objective", "molt._lean", "rlestimators._losses",
        "asyncpool._pool", "tito._server", "refit._refit", "refit._names",  # the last: the engines' side
        "refit.vllm_versions", "refit.vllm_compact",  # the middleware every engine's API server loads
    } <= names  # fmt: skip
    assert not {"molt.integrations", "molt.recipes", "tito._cli"} & names


def test_imports_are_followed_inside_functions_and_relatively_but_not_under_type_checking(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/entry.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.hint\n"
        "def f():\n    from . import lazy\n",
        "pkg/lazy.py": "from pkg.sub import deep\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "import os\n",
        "pkg/hint.py": "",
        "pkg/unused.py": "",
    }
    modules = {}
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = Path(relative).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    reached = _footprint().reachable(modules, ("pkg.entry",))
    assert reached == ["pkg", "pkg.entry", "pkg.lazy", "pkg.sub", "pkg.sub.deep"]


SAMPLE = '''"""Module doc,
over two lines."""

import os  # a trailing comment is code
# a comment line

def f():
    """f's doc."""
    x = "not a docstring"
    return """a
    b"""


class C:
    """One line."""
    y = 1
    z: int = 2
    """z's doc (an attribute docstring),
    over two lines."""
    print("a call")
    "not an attribute's doc"


def g():
    w = 1
    "not an attribute's doc either: in a function"
'''


def test_code_lines_leave_out_blank_lines_comments_and_docstrings_but_not_other_strings():
    # import, def f, x =, the returned string's two lines, class, y =, z: int =, print, its string after,
    # def g, w =, the string after it
    assert _footprint().code_lines(SAMPLE) == 13
