"""`tito serve`: its help, and its refusal to listen beyond loopback without a key."""

from __future__ import annotations

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
