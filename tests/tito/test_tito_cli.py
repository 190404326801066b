"""`tito serve`: its help, and its refusal to listen beyond loopback without a key."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tito._cli import app


def test_help_lists_every_option():
    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--engine", "--model", "--host", "--port", "--api-key", "--dump", "--served-model-name"):
        assert option in result.output


def test_binding_beyond_loopback_needs_an_api_key(tiny_model_dir):
    args = ["serve", "--engine", "http://127.0.0.1:1", "--model", str(tiny_model_dir), "--host", "0.0.0.0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert "--api-key" in result.output


def test_the_default_address_is_loopback():
    import inspect

    from tito._cli import serve

    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        pytest.param("--idle-timeout", "-1", "more than 0 seconds", id="negative-idle-timeout"),
        pytest.param("--idle-timeout", "0", "more than 0 seconds", id="zero-idle-timeout"),
        pytest.param("--max-sessions", "0", "greater than or equal to 1", id="zero-max-sessions"),
    ],
)
def test_session_limits_out_of_range_are_refused_naming_the_flag(tiny_model_dir, flag, value, says):
    """A negative idle timeout used to make the expiry task spin (and expire every session at once), and
    a cap of 0 sessions to refuse every session: both are refused before anything starts."""
    args = ["serve", "--engine", "http://127.0.0.1:1", "--model", str(tiny_model_dir), flag, value]
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.replace("│", " ").split())  # the error box wraps long lines
    assert result.exit_code == 2
    assert f"Invalid value for '{flag}'" in output and says in output, output
