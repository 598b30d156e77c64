"""What every ``mlaunch trace`` command shares: the help of ``--skip-invalid`` and ``--output``,
the skipped-input warnings and the output-file check (:mod:`mlaunch.outputs`). Their failures
go through :func:`mlaunch.cli.errors.error`, like every other command's."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

import typer

from mlaunch.cli.errors import error

SKIP_HELP = (
    "Skip malformed lines and spans instead of failing (a torn last line, what a crashed or "
    "still-running writer leaves, is always skipped with a warning)."
)
#: The one output-file rule (mlaunch.outputs), summed up for every --output help.
OUTPUT_RULE_HELP = (
    "- writes to standard output. Missing directories are created; a regular file is replaced atomically, a symlink's target "
    "is written, a device or FIFO (/dev/stdout) is written in place; an input trace file or a "
    "file of the run directory being read is refused (docs/trace.md, Output files)."
)


#: The exit status of a writer whose reader went away: what a shell reports for ``cat`` killed by
#: SIGPIPE (128 + 13), so ``set -o pipefail`` scripts see the same from both.
BROKEN_PIPE_EXIT = 141


def reader_went_away() -> typer.Exit:
    """Standard output's reader went away (``| head``): nothing is said, and the caller raises
    the returned exit (:data:`BROKEN_PIPE_EXIT`), as ``cat`` would end."""
    # What is still buffered for the closed pipe would fail again at exit ("Exception
    # ignored ... BrokenPipeError"): standard output goes to /dev/null from here on.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return typer.Exit(BROKEN_PIPE_EXIT)


def cannot_write(output: Path, exc: OSError) -> typer.Exit:
    """The one-line failure of an output that could not be written (a full disk, a permission
    taken away while writing); the caller raises the returned ``typer.Exit(2)``.

    A reader that went away (``-o - | head``, a FIFO closed early) is no failure: it took what
    it wanted. As ``cat``, nothing is said, and the exit is :data:`BROKEN_PIPE_EXIT`."""
    if exc.errno == errno.EPIPE:
        return reader_went_away()
    return error(
        f"--output {output}: cannot write: {exc.strerror}; fix: choose a writable output path"
    )


def warn_skipped(stats: Any) -> None:
    """Warnings for what the reader skipped: torn last lines (always), and the malformed lines
    and spans ``--skip-invalid`` dropped (the first five each, then a count)."""
    if stats.torn_lines:
        where = ", ".join(f"{p}:{n}" for p, n in stats.torn_lines[:5])
        more = f" and {len(stats.torn_lines) - 5} more" if len(stats.torn_lines) > 5 else ""
        typer.echo(
            f"warning: skipped {len(stats.torn_lines)} torn last line(s) (a crashed or "
            f"still-running writer): {where}{more}",
            err=True,
        )
    for what, items in (("lines", stats.skipped_lines), ("spans", stats.skipped_spans)):
        for path, line, why in items[:5]:
            typer.echo(f"warning: skipped {path}:{line}: {why}", err=True)
        if len(items) > 5:
            typer.echo(f"warning: ... {len(items) - 5} more skipped {what}", err=True)


def check_output_or_exit(output: Path, path: Path, files: Any) -> Path:
    """The path to write ``output`` to by the rule of :mod:`mlaunch.outputs`, checked against
    the input ``path`` and its trace ``files``; a refused target exits 2 with one line."""
    from mlaunch.outputs import OutputError, check_output
    from mlaunch.rundir.layout import TELEMETRY_DIR
    from mlaunch.trace.report import run_directory

    run_dir = run_directory(path)
    is_run = (run_dir / TELEMETRY_DIR).is_dir() or path.is_dir()
    try:
        return check_output(
            output, inputs=[f.path for f in files], run_dir=run_dir if is_run else None
        )
    except OutputError as e:
        raise error(str(e)) from None
