"""The `molt` command: `molt train [--config FILE.toml] [--group.field VALUE ...]`, `--resume RUN_DIR`,
`molt export CHECKPOINT OUT_DIR`, `molt plot RUN_DIR`.

Typer parses only the command name. The dotted flags are one per config field, which click cannot know, so
`train` takes its arguments raw, `molt._flags.parse` turns them into a Config and `molt._validate.validate`
checks it and fills the derived values (every error before anything starts, exit code 2), and `--help` is
printed here from the fields' docstrings.

Importing this module imports no torch, vLLM or Ray, so `molt --help` is instant; the training loop is
imported only once a run starts.
"""

import itertools
import os
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from molt._flags import flag_help, parse, render_toml
from molt._log import allow_bytecode, quiet_console
from molt._validate import validate
from molt.config import Config, ConfigError, with_run_dir

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None)

_USAGE = (
    "Usage: molt train [--config FILE.toml] [--group.field VALUE ...] [--print-config]\n"
    "       molt train --resume RUN_DIR [--group.field VALUE ...]"
)
_SYNTAX = """\
Every option is a dotted flag on the typed config (molt/config.py): --group.field VALUE or
--group.field=VALUE. Precedence: defaults < --config FILE.toml < flags. Booleans take true/false/1/0/yes/no
(a bare boolean flag means true), optional values take none, pairs are comma separated (0.5,2.0).

  --config FILE.toml    settings from a TOML file, in the format --print-config writes
  --resume RUN_DIR      continue a run from its newest checkpoint (--ckpt.every), with its settings
                        (given.toml); flags given here override them (e.g. --train.num_steps to train
                        longer), and what derives from them (the queue depth, ...) is derived again
  --print-config        print the resolved config as TOML and exit without training
  --help                show this message and exit"""

# Click would reject the dotted flags and answer --help itself; `train` does both.
_RAW_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.callback()
def main() -> None:
    """Molt trains LLM agents with reinforcement learning: `molt train --help` lists every flag."""


def train_help() -> str:
    """`molt train --help`: every dotted flag with its type, default and help, grouped by flag group."""
    groups = {field.name: field.type.__doc__ for field in msgspec.structs.fields(Config)}
    lines = [_USAGE, "", _SYNTAX]
    for name, rows in itertools.groupby(flag_help(), key=lambda row: row[0][2:].split(".", 1)[0]):
        lines += ["", f"{name}: {groups[name]}"]
        for flag, type_name, default, help_text in rows:
            lines += [f"  {flag}  {type_name} = {default}", f"      {help_text}"]
    return "\n".join(lines)


@app.command(context_settings=_RAW_ARGS, short_help="Train a policy with RL (--help lists every flag).")
def train(ctx: typer.Context) -> None:
    """Train a policy: molt train [--config FILE.toml] [--group.field VALUE ...]; --help lists every flag."""
    args = list(ctx.args)
    if "--help" in args or "-h" in args:
        typer.echo(train_help())
        return
    print_config = "--print-config" in args
    args = [arg for arg in args if arg != "--print-config"]
    try:
        resume_dir, args = _resume_args(args)
        given = parse(args)
        config = validate(given)  # derived values (queue depth, on-policy settings, ...) follow `given`
        if print_config:
            typer.echo(render_toml(config), nl=False)
            return
        config = with_run_dir(config)
        run_dir = Path(config.logger.run_dir)
        if resume_dir is None and (run_dir / "metrics.jsonl").exists():
            raise ConfigError(
                f"--logger.run_dir {run_dir} already holds a run; choose another, or continue it with "
                f"molt train --resume {run_dir}"
            )
        if resume_dir is not None and not (Path(config.ckpt.dir) / "latest").is_file():
            raise ConfigError(f"--resume {resume_dir}: no checkpoint in {config.ckpt.dir}")
    except ConfigError as error:
        typer.echo(f"molt train: {error}", err=True)
        raise typer.Exit(2) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(render_toml(config, _RESOLVED))
    (run_dir / "given.toml").write_text(render_toml(given, _GIVEN))
    typer.echo(f"run dir: {run_dir}")
    # Ray's workers run in this process's environment (the project's venv). Without this, Ray notices
    # `uv run` and starts workers through `uv run` in a copy of the working directory, a fresh venv.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # From here on other libraries' output goes into the run directory (their import warnings too).
    with quiet_console(run_dir / "molt.log", verbose=config.logger.verbose):
        allow_bytecode()
        from molt._launch import launch  # torch, Ray and vLLM load from here on

        launch(config, resume=resume_dir is not None)  # validated above, once


_RESOLVED = "The run's resolved config, derived values filled in (molt train --resume reads given.toml)."
_GIVEN = (
    "The run's settings as given, before derived values are filled in: molt train --resume reads this\n"
    "file, then its own flags, and derives again what derives from them (the queue depth from\n"
    "--rollout.prompts_per_step, --train.force_on_policy's settings, the GPU placement). The run's\n"
    "resolved config is config.toml."
)


def _resume_args(args: list[str]) -> tuple[Path | None, list[str]]:
    """`--resume RUN_DIR` taken out of `args`: the run directory (it must hold a run), and the arguments
    that continue it, the run's settings as given, then the flags given now. The settings are given.toml,
    or, in a run written before it was kept, config.toml, whose derived values no flag given now may
    change, so none is taken. Without --resume: None and `args`."""
    for index, arg in enumerate(args):
        if arg == "--resume" or arg.startswith("--resume="):
            value = arg.partition("=")[2] or (args[index + 1] if index + 1 < len(args) else "")
            run_dir, flags = Path(value), args[:index] + args[index + (1 if "=" in arg else 2) :]
            if not (run_dir / "config.toml").is_file():
                raise ConfigError(f"--resume {value!r}: not a run directory (no config.toml)")
            for taken in ("--config", "--logger.run_dir"):  # the two the run's own replace (below)
                if any(flag == taken or flag.startswith(f"{taken}=") for flag in flags):
                    raise ConfigError(
                        f"--resume {run_dir} continues with its own settings (given.toml) in its own "
                        f"directory: drop {taken}"
                    )
            given = (run_dir / "given.toml").is_file()
            if flags and not given:
                raise ConfigError(
                    f"--resume {run_dir} has no given.toml (the settings as given, before derived values), "
                    f"only config.toml, whose derived values (the queue depth, the on-policy settings, the "
                    f"placement) {flags[0]} and the other flags could not change: resume it without flags"
                )
            settings = run_dir / ("given.toml" if given else "config.toml")
            return run_dir, ["--config", str(settings), *flags, "--logger.run_dir", str(run_dir)]
    return None, args


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint (step_NNNNNN) or a checkpoints dir.")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the Hugging Face model directory.")],
    merged: Annotated[
        bool, typer.Option(help="A LoRA policy: write the model with the adapters merged.")
    ] = False,
) -> None:
    """Write a checkpoint's policy as a Hugging Face safetensors directory (transformers and vLLM load it);
    a LoRA policy's as a PEFT adapter directory for its base model, or merged with --merged."""
    from molt._checkpoint import export as export_checkpoint

    try:
        typer.echo(f"wrote {export_checkpoint(checkpoint, out_dir, merged=merged)}")
    except ValueError as error:
        typer.echo(f"molt export: {error}", err=True)
        raise typer.Exit(2) from None


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds metrics.jsonl).")],
    out: Annotated[Path | None, typer.Option(help="PNG to write; default RUN_DIR/plot.png.")] = None,
) -> None:
    """Plot a run's reward, response length and stage timings over steps into a PNG."""
    from molt._plot import plot_run

    try:
        typer.echo(f"wrote {plot_run(run_dir, out)}")
    except ValueError as error:
        typer.echo(f"molt plot: {error}", err=True)
        raise typer.Exit(2) from None
