"""The RL path's footprint: the physical lines of every module reachable by imports from its entry points.

    uv run python scripts/footprint.py          # the total, by package
    uv run python scripts/footprint.py --list   # and every module counted

Entry points: `molt._cli` (the `molt` command), `refit.vllm_worker`, the worker extension that every
vLLM engine of a run loads by name (`--worker-extension-cls`), `refit.vllm_versions`, the middleware every
engine's API server loads by name (`--middleware`), and `refit.vllm_gpu`, the weight-transfer backends a
GPU engine loads by name (`refit_nccl`, `refit_ipc`): code a run executes either way. Reachable:
the entry points, then every workspace module (under `packages/*/src`) that a reached module names in an
import statement, wherever the statement is (heavy imports sit inside functions), with the packages whose
`__init__.py` an import runs; imports under `if TYPE_CHECKING:` never run and do not count. Modules the
user picks by name at run time (agent modules, recipes, the `molt.integrations` adapters) are not counted.
Physical lines: every line of the file, comments, docstrings and blank lines included (`wc -l`). Code
lines: the physical lines less the blank ones, the comment-only ones and those of docstrings (a string
that is the first statement of a module, class or function, or one right under an assignment in a module
or class body: PEP 257's attribute docstrings, such as the config fields' help text). The README quotes
both totals.
"""

from __future__ import annotations

import argparse
import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ("molt._cli", "refit.vllm_worker", "refit.vllm_versions", "refit.vllm_gpu")


def workspace_modules() -> dict[str, Path]:
    """Every module of the workspace's packages, by dotted name."""
    modules = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _runtime_nodes(tree: ast.AST):
    """The tree's nodes, leaving out the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imported_names(name: str, path: Path) -> set[str]:
    """The dotted names the module's import statements import: `a.b` for `import a.b`, and `a.b` and
    `a.b.c` for `from a.b import c` (c may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 packages
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_string(stmt: ast.stmt) -> bool:
    """A statement that is only a string literal."""
    return isinstance(stmt, ast.Expr) and isinstance(getattr(stmt.value, "value", None), str)


def code_lines(text: str) -> int:
    """The lines of `text` that are neither blank, nor only a comment, nor part of a docstring: a module's,
    class's or function's, or an attribute's (PEP 257: the string right under an assignment in a module or
    class body, such as a config field's, which `molt --help` prints)."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        documented = [stmt for stmt in node.body[:1] if _is_string(stmt)]  # an empty module has none
        if isinstance(node, (ast.Module, ast.ClassDef)):
            documented += [
                after
                for stmt, after in itertools.pairwise(node.body)
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _is_string(after)
            ]
        for stmt in documented:
            docstrings.update(range(stmt.lineno, stmt.end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def reachable(modules: dict[str, Path], entries: tuple[str, ...] = ENTRIES) -> list[str]:
    """The workspace modules `entries` reach by imports (themselves and the packages above each included)."""
    seen, todo = set(), list(entries)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for prefix in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):  # importing a.b runs a
            if prefix in modules and prefix not in seen:
                seen.add(prefix)
                todo.extend(imported_names(prefix, modules[prefix]))
    return sorted(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every module counted and its lines")
    args = parser.parse_args()
    modules = workspace_modules()
    names = reachable(modules)
    texts = {name: modules[name].read_text() for name in names}
    lines = {name: len(text.splitlines()) for name, text in texts.items()}
    code = {name: code_lines(text) for name, text in texts.items()}
    by_package: dict[str, list[str]] = {}
    for name in names:
        by_package.setdefault(name.split(".")[0], []).append(name)
    for package, members in sorted(by_package.items()):
        total, total_code = sum(lines[m] for m in members), sum(code[m] for m in members)
        print(f"{package:14} {len(members):3} modules {total:7,} lines {total_code:7,} code lines")
        if args.list:
            for member in members:
                print(f"    {lines[member]:6,} {code[member]:6,}  {modules[member].relative_to(ROOT)}")
    entries = " and ".join(ENTRIES)
    print(
        f"RL path from {entries}: {len(names)} modules, {sum(lines.values()):,} physical lines, "
        f"{sum(code.values()):,} code lines"
    )


if __name__ == "__main__":
    main()
