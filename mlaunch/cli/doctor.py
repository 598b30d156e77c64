"""PLACEHOLDER: `mlaunch doctor`."""

import typer


def register(app: typer.Typer) -> None:
    """Add the `doctor` command to the root app."""

    @app.command("doctor")
    def _cmd() -> None:
        """Not implemented yet."""
        raise typer.Exit(1)
