"""`tito serve`: the capture server on its own, in front of running vLLM engines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Token-exact capture server over vLLM.")

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@app.callback()
def main() -> None:
    """Token-exact capture server over vLLM."""


@app.command()
def serve(
    engine: Annotated[list[str], typer.Option(help="vLLM engine base URL (repeat for several engines).")],
    model: Annotated[Path, typer.Option(help="Model directory: its tokenizer and chat template are used.")],
    host: Annotated[
        str, typer.Option(help="Address to bind; other than loopback needs --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8100,
    api_key: Annotated[str | None, typer.Option(help="Key every request but /health must carry.")] = None,
    dump: Annotated[Path | None, typer.Option(help="JSONL file for ended sessions' trajectories.")] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients use (default: --model).")
    ] = None,
) -> None:
    """Serve OpenAI chat completions and Anthropic messages, capturing token-exact trajectories."""
    if host not in LOOPBACK and not api_key:
        raise typer.BadParameter(f"binding {host} exposes the server beyond this machine; pass --api-key too")
    import uvicorn

    from ._loopback import KEEP_ALIVE_S, freeze_startup_objects
    from ._server import create_app
    from ._service import Tito

    tito = Tito(engine, model, served_model_name=served_model_name, dump=dump)
    app = create_app(tito, api_key=api_key)
    freeze_startup_objects()
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
