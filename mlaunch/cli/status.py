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
        if target.startswith("trainjob/"):
            if watch:
                raise fail([("--watch", "not for a TrainJob: use mlaunch status trainjob/NAME")])
            raise typer.Exit(_trainjob_status(target, namespace, as_json))
        if namespace is not None:
            raise fail([("--namespace", "only with trainjob/NAME (a Kubernetes TrainJob)")])
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


def _trainjob_status(target: str, namespace: str | None, as_json: bool) -> int:
    """``status trainjob/NAME``: the TrainJob and its pods through the API."""
    from mlaunch.cli.errors import RUN_FAILED, USAGE_ERROR
    from mlaunch.kube import client as kube
    from mlaunch.kube.jobs import TrainJobInputError, trainjob_status, trainjob_target
    from mlaunch.slurm.status import status_text

    try:
        name = trainjob_target(target)
        st = trainjob_status(kube.connect(namespace), name)
    except (TrainJobInputError, kube.KubeSetupError) as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    except kube.KubeApiError as exc:
        typer.echo(f"error: {exc}", err=True)
        return RUN_FAILED
    if as_json:
        typer.echo(json.dumps(st.as_json(), indent=2))
    else:
        typer.echo(status_text(st))
    return 0
