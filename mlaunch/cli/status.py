"""``mlaunch status RUN_DIR|JOB_ID [--json | --watch]``: parse, call
:mod:`mlaunch.slurm.status` (:mod:`mlaunch.slurm.watch` for the live view), render."""

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
            ...,
            metavar="RUN_DIR|JOB_ID",
            help="A run directory, a SLURM job id, or trainjob/NAME (a Kubernetes TrainJob).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
        namespace: str | None = typer.Option(
            None,
            "--namespace",
            "-n",
            metavar="NS",
            help="With trainjob/NAME: its namespace (default: the kubeconfig context's).",
        ),
        watch: bool = typer.Option(
            False,
            "--watch",
            help="A live view of the running job, refreshed every 2 s: per rank its iteration,"
            " step time, tokens/s and span; rolling goodput; the current straggler; time since"
            " the last progress against the hang timeout; captures and recorder dumps. Ends"
            " with the run.",
        ),
    ) -> None:
        """Queued / running / completed / failed / preempted, from SLURM and the run
        directory: how far training got, what each node last logged, which rank failed and
        why."""
        from mlaunch.slurm.status import StatusInputError, job_status, status_text

        if watch and as_json:
            raise fail([("--watch", "a live view cannot be JSON; use --json or --watch")])
        from mlaunch.cli.trainjob_ops import is_trainjob, trainjob_status_command

        if is_trainjob(target):  # trainjob/NAME, or the run directory of one
            if watch:
                raise fail([("--watch", "not for a TrainJob: use mlaunch status trainjob/NAME")])
            raise typer.Exit(trainjob_status_command(target, namespace, as_json))
        if namespace is not None:
            raise fail(
                [("--namespace", "only for a TrainJob (trainjob/NAME or its run directory)")]
            )
        if watch:
            from mlaunch.cli.status_watch import watch as watch_view

            try:
                code = watch_view(target, Path.cwd())
            except StatusInputError as exc:
                raise fail([("RUN_DIR|JOB_ID", str(exc))]) from None
            raise typer.Exit(code)
        try:
            st = job_status(target, Path.cwd())
        except StatusInputError as exc:
            raise fail([("RUN_DIR|JOB_ID", str(exc))]) from None
        if as_json:
            typer.echo(json.dumps(st.as_json(), indent=2))
        else:
            typer.echo(status_text(st))
