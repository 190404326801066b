"""`python -m molt ...`: the `molt` command, for an environment without its console script."""

from molt._cli import app

app()
