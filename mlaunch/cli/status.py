"""``mlaunch status RUN_DIR|JOB_ID [--json]``: parse, call :mod:`mlaunch.launcher.status`,
render."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mlaunch.cli.errors import PlainErrorsCommand, fail


def register(app: typer.Typer) -> None:
    """Add the ``status`` command to the root app."""

    @app.command(
        "status", cls=PlainErrorsCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )
    def status(
        target: str = typer.Argument(
            ..., metavar="RUN_DIR|JOB_ID", help="A run directory or a SLURM job id."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    ) -> None:
        """Queued / running / completed / failed / preempted, from SLURM and the run
        directory: how far training got, what each node last logged, which rank failed and
        why."""
        from mlaunch.launcher.status import StatusInputError, job_status, status_text

        try:
            st = job_status(target, Path.cwd())
        except StatusInputError as exc:
            raise fail([("RUN_DIR|JOB_ID", str(exc))]) from None
        if as_json:
            typer.echo(json.dumps(st.as_json(), indent=2))
        else:
            typer.echo(status_text(st))
