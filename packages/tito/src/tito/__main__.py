"""`python -m tito serve ...`: the `tito` command, for an environment without its console script."""

from ._cli import app

app(prog_name="tito")
