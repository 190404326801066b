"""The bounds of the config's numeric fields, read from their types: `check_bounds` refuses a value outside
its field's bound, or a float that is not finite, naming the flag and the bound; `help_bound` shows the
bound in `molt train --help`.

A field declares its bound on its type (`lr: Annotated[float, Meta(gt=0)]` in `molt.config`; a pair's
bound holds for each end; `None`, where a field allows it, is always allowed). msgspec checks the bound
when it decodes flags and TOML (`molt._flags.parse` words its error with `bound_error`), but not in a
Config built in Python (`molt.train(Config(...))`), and no bound refuses every non-finite float (inf > 0;
an unbounded field takes NaN): `check_bounds`, the first check of `validate`, refuses those. A bound never
makes 0 mean unbounded: a field that treats 0 specially says so in its docstring.

This module imports nothing heavy: `molt --help` loads it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from msgspec import inspect

from molt.config import Config, ConfigError

__all__ = ["bound_error", "check_bounds", "field_types", "field_value", "help_bound"]

Number = inspect.FloatType | inspect.IntType


@functools.cache
def field_types() -> dict[str, inspect.Type]:
    """Every settable field of `Config` by dotted path (`"actor.lr"`) -> its type as msgspec reads it,
    with the bounds of `Meta` as `gt`, `ge`, `lt`, `le` attributes."""
    types = {}

    def walk(struct: inspect.StructType, prefix: str) -> None:
        for field in struct.fields:
            if isinstance(field.type, inspect.StructType):
                walk(field.type, f"{prefix}{field.name}.")
            else:
                types[prefix + field.name] = field.type

    config = inspect.type_info(Config)
    assert isinstance(config, inspect.StructType)
    walk(config, "")
    return types


def _number(tp: inspect.Type) -> tuple[Number | None, str]:
    """The number type a field holds and how: as itself (""), or `None` ("optional"), or in each item of a
    tuple ("each"); `(None, "")` for a field that holds no number."""
    if isinstance(tp, Number):
        return tp, ""
    if isinstance(tp, inspect.UnionType):
        numbers = [member for member in tp.types if isinstance(member, Number)]
        if len(numbers) == 1 and any(isinstance(member, inspect.NoneType) for member in tp.types):
            return numbers[0], "optional"
    if isinstance(tp, inspect.TupleType) and all(isinstance(item, Number) for item in tp.item_types):
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
    if not isinstance(value, int | float) or isinstance(number, inspect.IntType) and isinstance(value, float):
        return False
    if not math.isfinite(value):
        return False
    return (
        (number.gt is None or value > number.gt)
        and (number.ge is None or value >= number.ge)
        and (number.lt is None or value < number.lt)
        and (number.le is None or value <= number.le)
    )


def bound_error(where: str, path: str, shown: Any) -> str:
    """`--actor.lr must be a finite number > 0, got 0`: the message of a value outside the bound of the
    field at `path`; `where` names where the value was set, `shown` is the value as given."""
    number, how = _number(field_types()[path])
    assert number is not None, f"{path} holds no number"
    kind = "finite number" if isinstance(number, inspect.FloatType) else "whole number"
    allowed = " ".join(filter(None, [f"{kind}s" if how == "each" else f"a {kind}", _bound(number)]))
    return f"{where} must be {allowed}{' or none' if how == 'optional' else ''}, got {shown}"


def help_bound(path: str) -> str:
    """The bound `molt train --help` shows beside the field's type: `> 0`, `each > 0`; empty for none."""
    number, how = _number(field_types()[path])
    bound = _bound(number) if number is not None else ""
    return f"each {bound}" if bound and how == "each" else bound


def field_value(config: Config, path: str) -> Any:
    """The value of the field at dotted `path` (`"actor.lr"`)."""
    return functools.reduce(getattr, path.split("."), config)


def check_bounds(config: Config) -> None:
    """Every numeric field of `config` within its bound, and finite."""
    for path, tp in field_types().items():
        number, how = _number(tp)
        value = field_value(config, path)
        if number is None or (how == "optional" and value is None):
            continue
        if not all(_holds(number, item) for item in (value if how == "each" else (value,))):
            raise ConfigError(bound_error(f"--{path}", path, value))
