"""The ``mlaunch`` command line: Typer commands that parse, call and render (the views beside them:
``train_view``, ``status_watch``, ``render``; the logic below, in the packages they call).

Only the command being run is imported: ``mlaunch groups resolve`` never pays for the
launcher, doctor or trace modules (nor, through them, pydantic, torch or the OTel SDK).
``mlaunch.cli.app`` builds the full application (for ``--help`` and tests).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

from mlaunch import __version__
from mlaunch.cli.errors import PlainErrorsGroup

#: Command name -> module that provides it. A module exposes either ``app`` (a Typer
#: sub-application, added as a group) or ``register(app)`` (adds top-level commands).
COMMANDS: dict[str, str] = {
    "train": "mlaunch.cli.train",
    "groups": "mlaunch.cli.groups",
    "doctor": "mlaunch.cli.doctor",
    "trace": "mlaunch.cli.trace",
    "sbatch": "mlaunch.cli.sbatch",
    "status": "mlaunch.cli.status",
    "logs": "mlaunch.cli.logs",
    "runs": "mlaunch.cli.runs",
    "stop": "mlaunch.cli.stop",
    "trainjob": "mlaunch.cli.trainjob",
}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mlaunch {__version__}")
        raise typer.Exit()


def build_app(only: str | None = None) -> typer.Typer:
    """The Typer application with every command, or just ``only`` when it names one."""
    root = typer.Typer(
        name="mlaunch",
        help="Launch distributed PyTorch training with cheap, correct OpenTelemetry tracing.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        cls=PlainErrorsGroup,
    )

    @root.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """Launch distributed PyTorch training with cheap, correct OpenTelemetry tracing."""

    names = [only] if only in COMMANDS else list(COMMANDS)
    for name in names:
        module = importlib.import_module(COMMANDS[name])
        if hasattr(module, "register"):
            module.register(root)
        else:
            root.add_typer(module.app, name=name)
    return root


def __getattr__(name: str) -> Any:
    if name == "app":
        return build_app()
    raise AttributeError(name)


def main() -> None:
    """Console-script entry point."""
    first = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    build_app(first)()
