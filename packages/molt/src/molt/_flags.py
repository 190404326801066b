"""Flags and TOML onto the config Structs: defaults < `--config FILE.toml` < `--group.field VALUE`.

A field's path in `molt.config.Config` is its flag (`--algo.kl.coef 0.1` or `--algo.kl.coef=0.1`) and its
TOML key (`[algo.kl]` table, `coef = 0.1`). Flag values are strings that msgspec converts (`strict=False`)
to the field's type, so msgspec checks every type and the bound a numeric field declares (`molt._bounds`);
before that, booleans accept true/false/1/0/yes/no (a bare boolean flag means true), optional fields
accept `none`, and tuples are comma separated (`0.5,2.0`). An unknown flag or key fails naming it and the
closest known flag (a renamed one, its new name); an ill-typed or out-of-bound one fails naming the flag
as the user wrote it. Help text is each field's docstring (`molt._bounds.leaves`).

This module imports nothing heavy: `molt train --help` runs it.
"""

import difflib
import functools
import json
import re
import tomllib
import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from molt._bounds import bound_error, field_value, help_bound, leaves
from molt._validate import validate
from molt.config import Config, ConfigError

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def type_name(tp: Any) -> str:
    """How a field's type reads in help and errors: `int`, `int|none`, `float,float`, `tis|mis|...` (its
    bound apart: `molt._bounds.help_bound`)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (Union, types.UnionType, tuple):
        return ("," if origin is tuple else "|").join(map(type_name, args))
    if origin is list:
        return f"{type_name(args[0])},..."
    return "none" if tp is type(None) else tp.__name__


def _flag_value(value: Any) -> str:
    """A value as it is written on the command line (the inverse of `_coerce`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return ",".join(_flag_value(item) for item in value) or '""'
    return str(value) or '""'


def flag_help() -> list[tuple[str, str, str, str]]:
    """`(flag, type, default, help)` for every dotted flag, in definition order; the type with its bound,
    if any (`float (> 0)`)."""
    return [
        (f"--{path}", type_name(leaf.type) + help_bound(path), _flag_value(leaf.default), leaf.doc)
        for path, leaf in leaves().items()
    ]


# Flags that were renamed: the old name fails, saying what to pass instead.
_RENAMED = {
    "algo.dynamic_filter": "--algo.filters all_equal_rewards",
    "algo.dynamic_filter_max_batches": "--algo.filter_max_batches",
}


def _unknown(name: str, where: str) -> ConfigError:
    """An error for an unknown flag or key, naming its new name (`_RENAMED`) or the closest known flag."""
    if name in _RENAMED:
        return ConfigError(f"{where} was renamed: pass {_RENAMED[name]}")
    close = difflib.get_close_matches(name, leaves(), n=1, cutoff=0.6)
    if not close:  # a right field name in the wrong group: compare last segments
        by_field = {path.rsplit(".", 1)[-1]: path for path in leaves()}
        close = [by_field[m] for m in difflib.get_close_matches(name.rsplit(".", 1)[-1], by_field, n=1)]
    hint = f"; did you mean --{close[0]}?" if close else ""
    return ConfigError(f"unknown {where}{hint} (molt train --help lists every flag)")


def _coerce(raw: Any, tp: Any) -> Any:
    """The flag-syntax conveniences msgspec does not know, in a flag's or a TOML string; msgspec converts
    and checks the rest (and TOML's typed values)."""
    if not isinstance(raw, str):
        return raw
    if type(None) in get_args(tp) and raw.lower() == "none":
        return None
    if tp is bool:
        return _BOOLS.get(raw.lower(), raw)
    if get_origin(tp) in (tuple, list):  # comma-separated; a list drops empty items ("" is the empty list)
        parts = [part.strip() for part in raw.split(",")]
        return parts if get_origin(tp) is tuple else [part for part in parts if part]
    return raw


def _split_args(args: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """`--config FILE` and `{dotted path: raw value}` from the command line; a repeated flag's last wins."""
    raw_flags, rest = {}, list(args)
    while rest:
        token = rest.pop(0)
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: options are --group.field VALUE")
        name, has_value, value = token[2:].partition("=")
        if name != "config" and name not in leaves():
            raise _unknown(name, f"flag --{name}")
        if not has_value:
            if name != "config" and leaves()[name].type is bool and (not rest or rest[0].startswith("--")):
                value = "true"
            elif not rest:
                raise ConfigError(f"--{name} needs a value")
            else:
                value = rest.pop(0)
        raw_flags[name] = value
    return raw_flags.pop("config", None), raw_flags


def _flatten_toml(table: dict[str, Any], file: str, prefix: str = "") -> dict[str, Any]:
    """`{dotted path: value}` from a parsed TOML file; an unknown key or a misplaced table fails."""
    flat = {}
    for key, value in table.items():
        path = prefix + key
        if path in leaves():
            flat[path] = value
        elif not any(leaf.startswith(f"{path}.") for leaf in leaves()):  # not a group's table either
            raise _unknown(path, f"key {path} in {file}")
        elif not isinstance(value, dict):
            raise ConfigError(f"{file}: {path} is a table ([{path}]), got {value!r}")
        else:
            flat.update(_flatten_toml(value, file, path + "."))
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """`{"a.b.c": v}` -> `{"a": {"b": {"c": v}}}`."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, last = path.split(".")
        functools.reduce(lambda node, part: node.setdefault(part, {}), parents, nested)[last] = value
    return nested


def _explain(error: msgspec.ValidationError, sources: dict[str, tuple[str, Any]]) -> str:
    """msgspec's `... - at $.rollout.group_size[0]` as `--rollout.group_size: expected int, got 'eight'`,
    or, for a number outside its field's bound (msgspec's `Expected `int` >= 1`), as
    `--rollout.group_size must be a whole number >= 1, got 0`."""
    match = re.search(r"at `\$\.([\w.]+)", str(error))
    path = match.group(1) if match else ""
    if path not in sources:
        return str(error)
    where, raw = sources[path]
    if re.match(r"Expected `(int|float)` [<>]", str(error)):
        return bound_error(where, path, raw)
    return f"{where}: expected {type_name(leaves()[path].type)}, got {raw!r}"


def _read_toml(file: str) -> dict[str, Any]:
    try:
        with open(file, "rb") as f:
            return tomllib.load(f)
    except OSError as error:
        raise ConfigError(f"--config {file}: cannot read it ({error.strerror})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {file}: not valid TOML ({error})") from None


def resolve(args: Sequence[str]) -> Config:
    """The validated `Config` of `molt train` arguments: defaults < `--config FILE.toml` < dotted flags,
    with the derived values filled (`molt._validate.validate`)."""
    return validate(parse(args))


def parse(args: Sequence[str]) -> Config:
    """The `Config` the arguments give, typed but not yet validated: no derived value is filled in, so a
    file `render_toml` writes of it, read back with other flags, derives again from those."""
    config_file, raw_flags = _split_args(args)
    toml = _flatten_toml(_read_toml(config_file), config_file) if config_file is not None else {}
    # path -> (where it was set, the value as written); a flag wins over the file
    sources = {path: (f"{config_file}: {path} (--{path})", value) for path, value in toml.items()}
    sources |= {path: (f"--{path}", raw) for path, raw in raw_flags.items()}
    values = {path: _coerce(raw, leaves()[path].type) for path, (_, raw) in sources.items()}
    try:
        return msgspec.convert(_nest(values), Config, strict=False)
    except msgspec.ValidationError as error:
        raise ConfigError(_explain(error, sources)) from None


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'  # TOML has no null; `none` is how optional fields are written (see `_coerce`)
    # JSON's booleans, numbers (finite: `validate` refuses others), arrays and strings are TOML's, once DEL
    # (which TOML wants escaped in a string) is escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def render_toml(config: Config, heading: str = "") -> str:
    """`config` as a TOML file that `--config` reads back to an equal Config, each key under its help;
    `heading`: comment lines first."""
    tables: dict[str, list[str]] = {}  # one [table] per Struct, in definition order
    for path in leaves():
        tables.setdefault(path.rsplit(".", 1)[0], []).append(path)
    lines = [f"# {line}" for line in heading.splitlines()]
    lines += ["# molt run configuration: defaults < --config FILE.toml < --group.field flags"]
    for table, paths in tables.items():
        lines += ["", f"[{table}]"]
        for path in paths:
            value = _toml_value(field_value(config, path))
            lines += [f"# {leaves()[path].doc}", f"{path.rsplit('.', 1)[1]} = {value}"]
    return "\n".join(lines) + "\n"
