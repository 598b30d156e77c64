"""``mlaunch logs RUN_DIR|JOB_ID [--rank R] [--attempt N] [--node N] [--tail N] [--follow]``:
parse, find the logs (:mod:`mlaunch.rundir.worker_logs`), print them.

The workers' output goes to standard output (``[rank R]`` before each line when several ranks
are shown); which attempt is shown, and each new one while following, is said on standard error.
``--follow`` ends when the run ends, by the verdict ``mlaunch status --watch`` ends on
(:func:`mlaunch.slurm.status.job_status`'s ``live``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from mlaunch.cli.errors import PlainErrorsCommand, fail

TARGET = "RUN_DIR|JOB_ID"


def _ranks_text(ranks: Any) -> str:
    from mlaunch.model.strategies import format_ranks

    return format_ranks(list(ranks)) if ranks else "none"


def register(app: typer.Typer) -> None:
    """Add the ``logs`` command to the root app."""

    @app.command(
        "logs", cls=PlainErrorsCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )
    def logs(
        target: str = typer.Argument(
            ...,
            metavar=TARGET,
            help="A run directory, a SLURM job id, or trainjob/NAME (a Kubernetes TrainJob).",
        ),
        rank: int | None = typer.Option(
            None, "--rank", metavar="R", help="Only this (global) rank's output."
        ),
        attempt: int | None = typer.Option(
            None,
            "--attempt",
            metavar="N",
            help="This attempt instead of the newest. Attempts are numbered from 0 over the"
            " run's life: each torchrun restart and each later launch into the run directory"
            " (a resume, a SLURM requeue) adds one.",
        ),
        node: int | None = typer.Option(
            None, "--node", metavar="N", help="Only the ranks of node N (logs/nodeN)."
        ),
        tail: int | None = typer.Option(
            None, "--tail", metavar="N", help="Only the last N lines of each log file."
        ),
        follow: bool = typer.Option(
            False,
            "--follow",
            "-f",
            help="Keep printing what the workers write, through restarts and requeues, until"
            " the run ends (Ctrl-C stops following; the run goes on).",
        ),
        namespace: str | None = typer.Option(
            None,
            "--namespace",
            "-n",
            metavar="NS",
            help="With trainjob/NAME: its namespace (default: the kubeconfig context's).",
        ),
    ) -> None:
        """The workers' output (stdout, then stderr, of each rank) of the newest attempt of a
        run, from its run directory: a local run, every node of a SLURM job, or a run
        directory copied elsewhere."""
        from mlaunch.cli.trainjob_ops import is_trainjob, trainjob_logs_command

        if is_trainjob(target):  # trainjob/NAME, or the run directory of one: its pods' logs
            raise typer.Exit(
                trainjob_logs_command(
                    target,
                    namespace=namespace,
                    node=node,
                    tail=tail,
                    follow=follow,
                    rank=rank,
                    attempt=attempt,
                )  # fmt: skip
            )
        if namespace is not None:
            raise fail(
                [("--namespace", "only for a TrainJob (trainjob/NAME or its run directory)")]
            )
        code = _logs(target, rank, attempt, node, tail, follow)
        raise typer.Exit(code)


def _logs(
    target: str,
    rank: int | None,
    attempt: int | None,
    node: int | None,
    tail: int | None,
    follow: bool,
) -> int:
    from mlaunch.rundir import layout as lay
    from mlaunch.rundir import worker_logs as wl
    from mlaunch.slurm.status import StatusInputError, job_status, resolve_target

    problems = []
    if tail is not None and tail < 0:
        problems.append(("--tail", f"{tail}: give a number of lines, 0 or more"))
    if attempt is not None and follow:
        problems.append(("--attempt", "--follow follows the newest attempt; drop one of them"))
    for flag, value in (("--rank", rank), ("--attempt", attempt), ("--node", node)):
        if value is not None and value < 0:
            problems.append((flag, f"{value}: numbers start at 0"))
    if problems:
        raise fail(problems)
    cwd = Path.cwd()
    try:
        t = resolve_target(target, cwd)
    except StatusInputError as exc:
        raise fail([(TARGET, str(exc))]) from None
    if t.run_dir is None:
        raise fail([(TARGET, f"job {t.job_id}: its run directory is not found from here")])
    if not lay.is_run_dir(t.run_dir):
        raise fail(
            [(TARGET, f"{target} is not a run directory (no {lay.RESOLVED_JSON_FILE}, launcher"
              f" record or {lay.LOGS_DIR}/ in it)")]
        )  # fmt: skip
    found = wl.find(t.run_dir)
    if node is not None and found.nodes and node not in found.nodes:
        raise fail([("--node", f"{node}: the run has node(s) {_ranks_text(found.nodes)}")])
    if rank is not None and found.ranks and rank not in found.ranks:
        raise fail([("--rank", f"{rank}: the run has rank(s) {_ranks_text(found.ranks)}")])
    ranks = [rank] if rank is not None else None

    def prefix_for(shown: int) -> bool:
        return rank is None and shown > 1

    out = sys.stdout
    if follow:
        latest = found.latest
        shown = len(wl.select(latest, ranks, node)) if latest else len(found.ranks)
        prefixed = prefix_for(shown)

        def emit(r: wl.RankLog, line: str) -> None:
            out.write(f"[rank {r.rank}] {line}\n" if prefixed else line + "\n")
            out.flush()

        def announce(a: wl.Attempt, all_: wl.WorkerLogs) -> None:
            typer.echo(f"== {a.describe(all_.launches)} ==", err=True)

        def ended() -> bool:
            return not job_status(target, cwd).live

        try:
            wl.follow(
                t.run_dir, emit, ended, ranks=ranks, node=node, tail=tail, on_attempt=announce
            )
        except BrokenPipeError:
            return _gone()
        except KeyboardInterrupt:
            typer.echo("stopped following (the run goes on)", err=True)
        return 0

    if not found.attempts:
        if attempt is not None:
            raise fail([("--attempt", f"{attempt}: the run has no attempt yet")])
        typer.echo(f"{t.run_dir}: no worker output yet (no worker has started)", err=True)
        return 0
    if attempt is not None and attempt >= len(found.attempts):
        last = len(found.attempts) - 1
        raise fail([("--attempt", f"{attempt}: the run has attempt(s) 0-{last}" if last else
                     f"{attempt}: the run has attempt 0 only")])  # fmt: skip
    chosen = found.attempts[attempt] if attempt is not None else found.attempts[-1]
    shown = wl.select(chosen, ranks, node)
    if not shown:
        what = f"rank {rank}" if rank is not None else "a rank"
        where = f" on node {node}" if node is not None else ""
        raise fail(
            [("--rank" if rank is not None else "--node",
              f"{what} has no log{where} in attempt {chosen.number} (its ranks:"
              f" {_ranks_text(r.rank for r in chosen.ranks)})")]
        )  # fmt: skip
    typer.echo(f"== {chosen.describe(found.launches)} ==", err=True)
    prefixed = prefix_for(len(shown))
    try:
        for r in shown:
            for path in r.files():
                lines = wl.tail_lines(path, tail)
                if prefixed:
                    head = f"[rank {r.rank}] "
                    lines = [head + ln for ln in lines]
                if lines:
                    out.write("\n".join(lines) + "\n")
        out.flush()
    except BrokenPipeError:
        return _gone()
    return 0


def _gone() -> int:
    from mlaunch.cli.trace_common import reader_went_away

    raise reader_went_away()
