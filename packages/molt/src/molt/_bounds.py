"""The config's settable fields and the bounds of its numeric fields: `leaves` lists every field by its
dotted path (its flag) with its type, default and help; `check_bounds` refuses a value outside its field's
bound, or a float that is not finite, naming the flag and the bound; `help_bound` shows the bound in
`molt train --help`.

A field declares its bound on its type (`lr: Annotated[float, Meta(gt=0)]` in `molt.config`; a pair's
bound holds for each end; `None`, where a field allows it, is always allowed). msgspec checks the bound
when it decodes flags and TOML (`molt._flags.parse` words its error with `bound_error`), but not in a
Config built in Python (`molt.train(Config(...))`), and no bound refuses every non-finite float (inf > 0;
an unbounded field takes NaN): `check_bounds`, the first check of `validate`, refuses those. A bound never
makes 0 mean unbounded: a field that treats 0 specially says so in its docstring. A field's help is its
docstring, read from the source of `molt/config.py` (and `molt/_config_algo.py`).

This module imports nothing heavy: `molt --help` loads it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import math
from typing import Any, NamedTuple

import msgspec
from msgspec.inspect import FloatType, IntType, NoneType, TupleType, UnionType, type_info

from molt import _config_algo
from molt import config as config_module
from molt.config import Config, ConfigError

Number = FloatType | IntType


class Leaf(NamedTuple):
    type: Any
    default: Any
    doc: str


@functools.cache
def _field_docs() -> dict[tuple[str, str], str]:
    """`(class name, field name) -> docstring`: the string literal right under each annotated field."""
    trees = [ast.parse(inspect.getsource(module)) for module in (config_module, _config_algo)]
    docs = {}
    for node in (node for tree in trees for node in tree.body if isinstance(node, ast.ClassDef)):
        for stmt, after in itertools.pairwise(node.body):
            match stmt, after:
                case ast.AnnAssign(target=ast.Name(id=name)), ast.Expr(value=ast.Constant(value=str(doc))):
                    docs[node.name, name] = " ".join(doc.split())  # one line
    return docs


@functools.cache
def leaves() -> dict[str, Leaf]:
    """Every settable field by dotted path (`"algo.kl.coef"`), in definition order."""
    docs, found = _field_docs(), {}

    def walk(cls: type[msgspec.Struct], prefix: str) -> None:
        for field in msgspec.structs.fields(cls):
            if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
                walk(field.type, f"{prefix}{field.name}.")
            else:
                has_factory = field.default_factory is not msgspec.NODEFAULT  # a mutable default: []
                default = field.default_factory() if has_factory else field.default
                doc = docs.get((cls.__name__, field.name), "")
                found[prefix + field.name] = Leaf(field.type, default, doc)

    walk(Config, "")
    return found


def _number(field_type: Any) -> tuple[Number | None, str]:
    """The number type a field holds (with its bounds, as msgspec reads them) and how: as itself (""), or
    `None` ("optional"), or in each item of a tuple ("each"); `(None, "")` for a field that holds none."""
    tp = type_info(field_type)
    if isinstance(tp, Number):
        return tp, ""
    if isinstance(tp, UnionType):
        numbers = [member for member in tp.types if isinstance(member, Number)]
        if len(numbers) == 1 and any(isinstance(member, NoneType) for member in tp.types):
            return numbers[0], "optional"
    if isinstance(tp, TupleType) and all(isinstance(item, Number) for item in tp.item_types):
        first = tp.item_types[0]
        assert isinstance(first, Number) and all(item == first for item in tp.item_types), "one bound each"
        return first, "each"
    return None, ""


def _bound(number: Number) -> str:
    """`> 0`, `>= 1`, `in [0, 1)`; empty for a number without a bound."""
    low = (">", "(", number.gt) if number.gt is not None else (">=", "[", number.ge)
    high = ("<", ")", number.lt) if number.lt is not None else ("<=", "]", number.le)
    if low[2] is not None and high[2] is not None:
        return f"in {low[1]}{low[2]:g}, {high[2]:g}{high[1]}"
    if low[2] is not None:
        return f"{low[0]} {low[2]:g}"
    return f"{high[0]} {high[2]:g}" if high[2] is not None else ""


def _holds(number: Number, value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(number, IntType) and isinstance(value, float):
        return False
    return math.isfinite(value) and (
        (number.gt is None or value > number.gt)
        and (number.ge is None or value >= number.ge)
        and (number.lt is None or value < number.lt)
        and (number.le is None or value <= number.le)
    )


def bound_error(where: str, path: str, shown: Any) -> str:
    """`--actor.lr must be a finite number > 0, got 0`: the message of a value outside the bound of the
    field at `path`; `where` names where the value was set, `shown` is the value as given."""
    number, how = _number(leaves()[path].type)
    assert number is not None, f"{path} holds no number"
    kind = "finite number" if isinstance(number, FloatType) else "whole number"
    allowed = " ".join(filter(None, [f"{kind}s" if how == "each" else f"a {kind}", _bound(number)]))
    return f"{where} must be {allowed}{' or none' if how == 'optional' else ''}, got {shown}"


def help_bound(path: str) -> str:
    """The bound `molt train --help` shows after the field's type: ` (> 0)`, ` (each > 0)`; empty for none."""
    number, how = _number(leaves()[path].type)
    bound = _bound(number) if number is not None else ""
    return f" ({'each ' if how == 'each' else ''}{bound})" if bound else ""


def field_value(config: Config, path: str) -> Any:
    """The value of the field at dotted `path` (`"actor.lr"`)."""
    return functools.reduce(getattr, path.split("."), config)


def check_bounds(config: Config) -> None:
    """Every numeric field of `config` within its bound, and finite."""
    for path, leaf in leaves().items():
        number, how = _number(leaf.type)
        value = field_value(config, path)
        if number is None or (how == "optional" and value is None):
            continue
        if not all(_holds(number, item) for item in (value if how == "each" else (value,))):
            raise ConfigError(bound_error(f"--{path}", path, value))
