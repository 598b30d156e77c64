"""``mlaunch runs [DIR] [--json]``: parse, call :func:`mlaunch.slurm.status.list_runs`, render.

Each run's state is :func:`mlaunch.slurm.status.run_dir_status`'s: the words ``mlaunch status``
uses, decided by the same derivation from the run directory alone (SLURM is not asked per run).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from mlaunch.cli.errors import PlainErrorsCommand, fail

#: The columns of the plain listing.
COLUMNS = ("RUN", "STATE", "STARTED", "ITERATIONS", "ENTRY", "PATH")


def _started(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t is not None else "-"


def _iterations(done: int | None, total: int | None) -> str:
    if done is None and total is None:
        return "-"
    return f"{'-' if done is None else done}/{'-' if total is None else total}"


def register(app: typer.Typer) -> None:
    """Add the ``runs`` command to the root app."""

    @app.command(
        "runs", cls=PlainErrorsCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )
    def runs(
        folder: Path = typer.Argument(
            Path("runs"),
            metavar="DIR",
            help="The folder of run directories (default: ./runs).",
            show_default=False,
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the runs as a JSON list."),
    ) -> None:
        """The runs under DIR, newest first: run id, state (the words of `mlaunch status`),
        when it started, iterations done/total, entry point and path; the command that
        resumes a run stopped with a checkpoint. A folder that is no run, or that cannot be
        read, is listed as such."""
        from mlaunch.slurm.status import list_runs

        if not folder.is_dir():
            raise fail([("DIR", f"{folder}: no such directory; give the folder that holds the"
                         " run directories (mlaunch train writes them under ./runs)")])  # fmt: skip
        rows, note = list_runs(folder)
        if as_json:
            typer.echo(json.dumps([r.as_json() for r in rows], indent=1))
            if note:
                typer.echo(f"note: {note}", err=True)
            return
        if not rows:
            typer.echo(f"no runs under {folder}")
            return
        table = [COLUMNS] + [
            (r.run_id, r.state, _started(r.started), _iterations(r.iteration, r.train_iters),
             r.entry or "-", r.path)
            for r in rows
        ]  # fmt: skip
        widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
        out = []
        for i, line in enumerate(table):
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False))
                       + "  " + line[-1])  # fmt: skip
            row = rows[i - 1] if i else None
            if row is not None and row.resume:
                out.append(f"  resume: {row.resume}")
            if row is not None and row.note:
                out.append(f"  ({row.note})")
        if note:
            out.append(f"note: {note}")
        typer.echo("\n".join(out))
