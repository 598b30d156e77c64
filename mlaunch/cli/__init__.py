"""The ``mlaunch`` command line: thin Typer commands that parse, call and render.

Command modules import nothing heavy at module top (no torch, no OTel SDK, no grpc), so
``mlaunch --help`` and ``mlaunch groups resolve`` stay fast. A test pins that.
"""

from __future__ import annotations

import typer

from mlaunch import __version__
from mlaunch.cli import doctor as _doctor
from mlaunch.cli import groups as _groups
from mlaunch.cli import trace as _trace
from mlaunch.cli import train as _train

app = typer.Typer(
    name="mlaunch",
    help="Launch distributed PyTorch training with cheap, correct OpenTelemetry tracing.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mlaunch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Launch distributed PyTorch training with cheap, correct OpenTelemetry tracing."""


app.add_typer(_groups.app, name="groups")
app.add_typer(_trace.app, name="trace")
_train.register(app)
_doctor.register(app)


def main() -> None:
    """Console-script entry point."""
    app()
