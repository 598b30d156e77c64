"""``mlaunch stop RUN_DIR|JOB_ID [--now] [--timeout S]``: parse, call :mod:`mlaunch.slurm.stop`,
render (what it does and waits for as it goes, then the run's state as ``status`` says it)."""

from __future__ import annotations

from pathlib import Path

import typer

from mlaunch.cli.errors import RUN_FAILED, PlainErrorsCommand, fail
from mlaunch.launcher.stop import DEFAULT_TIMEOUT_S


def register(app: typer.Typer) -> None:
    """Add the ``stop`` command to the root app."""

    @app.command(
        "stop", cls=PlainErrorsCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )
    def stop(
        target: str = typer.Argument(
            ...,
            metavar="RUN_DIR|JOB_ID",
            help="A run directory, a SLURM job id, or trainjob/NAME (a Kubernetes TrainJob).",
        ),
        now: bool = typer.Option(
            False,
            "--now",
            help="Kill the workers at once, without a save: the run resumes only from a"
            " checkpoint saved before (status says which).",
        ),
        timeout: float = typer.Option(
            DEFAULT_TIMEOUT_S,
            "--timeout",
            metavar="S",
            help="Wait at most S seconds for the run to end (exit 1 if it has not).",
        ),
        namespace: str | None = typer.Option(
            None,
            "--namespace",
            "-n",
            metavar="NS",
            help="With trainjob/NAME: its namespace (default: the kubeconfig context's). A"
            " TrainJob is suspended (its pods get SIGTERM and save; resumable); --now deletes it.",
        ),
    ) -> None:
        """Stop a live run as a preemption would: the workers finish the current iteration,
        save a checkpoint and exit (a SLURM job gets its time-limit warning, USR1, and is not
        requeued). Waits until the run has ended; then `mlaunch status` says stopped. Only the
        user who started the run can stop it."""
        from mlaunch.launcher.stop import StopRefused
        from mlaunch.slurm.status import StatusInputError, status_text
        from mlaunch.slurm.stop import StopFailed
        from mlaunch.slurm.stop import stop as stop_run

        if timeout <= 0:
            raise fail([("--timeout", f"{timeout:g} s: give a number of seconds above 0")])
        from mlaunch.cli.trainjob_ops import is_trainjob, trainjob_stop_command

        if is_trainjob(target):  # trainjob/NAME, or the run directory of one
            raise typer.Exit(
                trainjob_stop_command(target, namespace=namespace, now=now, timeout_s=timeout)
            )
        if namespace is not None:
            raise fail(
                [("--namespace", "only for a TrainJob (trainjob/NAME or its run directory)")]
            )
        try:
            outcome = stop_run(
                target, Path.cwd(), now=now, timeout_s=timeout, say=lambda s: typer.echo(s)
            )
        except (StatusInputError, StopRefused) as exc:
            raise fail([("RUN_DIR|JOB_ID", str(exc))]) from None
        except StopFailed as exc:
            raise fail([("error", str(exc))], RUN_FAILED) from None
        if not outcome.ended:
            raise fail(
                [
                    (
                        "error",
                        f"{outcome.what} has not ended after {timeout:g} s (still running:"
                        f" {', '.join(outcome.waiting_for)}); it may still be saving: see"
                        f" `mlaunch status {target}`, or end it with `mlaunch stop --now {target}`",
                    )
                ],
                RUN_FAILED,
            )
        typer.echo(f"{outcome.what} has ended")
        if outcome.status is not None:
            typer.echo(status_text(outcome.status))
