"""PLACEHOLDER: `mlaunch train`."""

import typer


def register(app: typer.Typer) -> None:
    """Add the `train` command to the root app."""

    @app.command("train")
    def _cmd() -> None:
        """Not implemented yet."""
        raise typer.Exit(1)
