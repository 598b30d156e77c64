"""PLACEHOLDER: ``mlaunch trace`` commands (issue 7)."""

import typer

app = typer.Typer(help="Read exported traces without a backend.", no_args_is_help=True)
