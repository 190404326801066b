"""The bounds declared on the config's numeric fields (`Annotated[float, msgspec.Meta(gt=0)]`): every int
and float field declares one, a value outside it is refused naming the flag and the bound whether it comes
from a flag, a TOML file or a Config built in Python, NaN and infinities are refused for every float field,
and `--help` shows each bound. The values just outside each bound are written out in
test_molt_validate's `_BAD_NUMBERS`."""

from __future__ import annotations

import re
from typing import Annotated, get_args, get_origin

import msgspec
import pytest

from molt._bounds import leaves
from molt._flags import flag_help, resolve
from molt._validate import validate
from molt.config import Config, ConfigError

# Numeric fields that take any finite number.
_UNBOUNDED = {"eval.pass_reward"}


def _base(tp):
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _numbers(tp) -> list:
    """The int and float types a field's type holds: itself, an optional's, a tuple's items."""
    tp = _base(tp)
    if tp in (int, float):
        return [tp]
    return [number for arg in get_args(tp) if arg is not type(None) for number in _numbers(arg)]


def _bounds(tp) -> list[msgspec.Meta]:
    if get_origin(tp) is Annotated:
        return [meta for meta in get_args(tp)[1:] if isinstance(meta, msgspec.Meta)]
    return [meta for arg in get_args(tp) for meta in _bounds(arg)]


NUMERIC = [path for path, leaf in leaves().items() if _numbers(leaf.type)]
FLOATS = [path for path, leaf in leaves().items() if float in _numbers(leaf.type)]


def _set(struct, path: str, value):
    """`struct` with the field at dotted `path` set to `value`, unchecked (as Python code may build it)."""
    name, _, rest = path.partition(".")
    return msgspec.structs.replace(
        struct, **{name: _set(getattr(struct, name), rest, value) if rest else value}
    )


def test_every_numeric_field_declares_its_bounds():
    bounded = {
        path
        for path in NUMERIC
        if any(
            bound is not None
            for meta in _bounds(leaves()[path].type)
            for bound in (meta.gt, meta.ge, meta.lt, meta.le)
        )
    }
    assert bounded == set(NUMERIC) - _UNBOUNDED
    assert {"actor.lr", "algo.correction.token_bounds", "ray.num_cpus", "eval.pass_reward"} <= set(NUMERIC)


@pytest.mark.parametrize("path", FLOATS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_field_refuses_nan_and_infinities(path, value):
    default = leaves()[path].default
    given = ",".join([value, *map(str, default[1:])]) if isinstance(default, tuple) else value
    with pytest.raises(ConfigError, match=f"^--{re.escape(path)} must be (a )?finite number"):
        resolve([f"--{path}", given])
    number = float(value)
    with pytest.raises(ConfigError, match=f"^--{re.escape(path)} must be (a )?finite number"):
        validate(_set(Config(), path, (number, *default[1:]) if isinstance(default, tuple) else number))


@pytest.mark.parametrize(
    ("path", "flag_value", "python_value", "says"),
    [
        pytest.param("actor.lr", "0", 0.0, "a finite number > 0", id="gt"),
        pytest.param("rollout.group_size", "0", 0, "a whole number >= 1", id="ge"),
        pytest.param("algo.loss.clip_low", "1", 1.0, "a finite number in [0, 1)", id="half-open"),
        pytest.param(
            "vllm.gpu_memory_utilization", "1.5", 1.5, "a finite number in (0, 1] or none", id="optional"
        ),
        pytest.param("ray.num_cpus", "0", 0, "a whole number >= 1 or none", id="optional-int"),
        pytest.param(
            "algo.correction.token_bounds", "0.5,-1", (0.5, -1.0), "finite numbers > 0", id="each-end"
        ),
    ],
)
def test_a_value_outside_its_bound_is_refused_naming_the_flag_and_the_bound(
    path, flag_value, python_value, says
):
    with pytest.raises(ConfigError) as error:
        resolve([f"--{path}", flag_value])
    assert str(error.value) == f"--{path} must be {says}, got {flag_value}"
    with pytest.raises(ConfigError) as error:
        validate(_set(Config(), path, python_value))  # msgspec checks bounds only when it decodes
    assert str(error.value) == f"--{path} must be {says}, got {python_value}"


def test_a_toml_value_outside_its_bound_is_refused_naming_the_file_and_the_flag(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text("[actor]\nlr = -0.5\n")
    with pytest.raises(ConfigError) as error:
        resolve(["--config", str(file)])
    assert str(error.value) == f"{file}: actor.lr (--actor.lr) must be a finite number > 0, got -0.5"


def test_an_optional_field_takes_none_and_a_bound_allows_its_edge():
    config = resolve(["--ray.num_cpus", "none", "--algo.loss.dual_clip", "none", "--algo.gae.gamma", "1"])
    assert (config.ray.num_cpus, config.algo.loss.dual_clip, config.algo.gae.gamma) == (None, None, 1.0)
    assert validate(_set(Config(), "vllm.max_num_batched_tokens", None)).vllm.max_num_batched_tokens is None


def test_help_shows_each_bound_beside_the_type():
    types = {flag: type_name for flag, type_name, _, _ in flag_help()}
    assert types["--actor.lr"] == "float (> 0)"
    assert types["--rollout.group_size"] == "int (>= 1)"
    assert types["--vllm.gpu_memory_utilization"] == "float|none (in (0, 1])"
    assert types["--algo.correction.token_bounds"] == "float,float (each > 0)"
    assert types["--eval.pass_reward"] == "float"
