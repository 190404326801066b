"""`tito serve`: the capture server on its own, in front of running vLLM engines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
        str | None, typer.Option(help="Model name clients use (default: the first engine's served name).")
    ] = None,
    idle_timeout: Annotated[
        float | None,
        typer.Option(
            help="End (and dump) a session this many seconds after its last request ended; more than 0 "
            "(default: never)."
        ),
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Live sessions at most (per worker), at least 1; POST /sessions past it answers 429 "
            "(default: no cap).",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Processes that share the sessions, each owning the sessions it creates; worker i also "
            "listens on port + 1 + i, which its sessions' URLs name.",
        ),
    ] = 1,
    stream_replies: Annotated[
        bool,
        typer.Option(
            "--stream-replies",
            help="Have the engines stream every reply, also those a client takes whole: vLLM builds a whole "
            "reply's logprobs when it finishes, so replies that finish together wait on one another; "
            "streamed, they are built while the engine decodes (start it with --stream-interval N to "
            "send N tokens at a time).",
        ),
    ] = False,
    compact_stream: Annotated[
        bool,
        typer.Option(
            "--compact-stream",
            help="The engines run refit's middleware (refit.engine_flags): stream replies from its "
            "compact route, POST /refit/generate, the same tokens with each logprob a bare float (vLLM's "
            "own endpoint builds two JSON objects per token's logprob).",
        ),
    ] = False,
) -> None:
    """Serve OpenAI chat completions and responses and Anthropic messages, capturing token-exact
    trajectories."""
    if idle_timeout is not None and not idle_timeout > 0:
        why = f"{idle_timeout:g} is not more than 0 seconds: leave the flag out to keep sessions until ended"
        raise typer.BadParameter(why, param_hint="'--idle-timeout'")
    if host not in LOOPBACK and not api_key:
        raise typer.BadParameter(f"binding {host} exposes the server beyond this machine; pass --api-key too")
    import uvicorn

    from ._loopback import KEEP_ALIVE_S, freeze_startup_objects
    from ._server import create_app
    from ._service import Tito

    name = served_model_name or engine_model_name(engine[0])
    tito_args: dict[str, Any] = {
        "engines": engine,
        "model": model,
        "served_model_name": name,
        "dump": dump,
        "idle_timeout": idle_timeout,
        "max_sessions": max_sessions,
        "stream_replies": stream_replies,
        "compact_stream": compact_stream,
    }
    if workers > 1:
        from ._launch import serve_workers

        serve_workers(workers, host, port, tito_args, api_key)
        return
    tito = Tito(**tito_args)
    app = create_app(tito, api_key=api_key)
    freeze_startup_objects()
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


def engine_model_name(url: str) -> str:
    """The name the engine serves its model under (its `GET /v1/models`), which clients already use."""
    import httpx

    try:
        reply = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise typer.BadParameter(
            f"could not read the served model name from {url}/v1/models ({error!r}): start the engine "
            "first, or pass --served-model-name"
        ) from error
