"""``mlaunch trace report RUN_DIR [-o FILE] [--iterations A:B]``: a thin command over
:mod:`mlaunch.trace.report`, added to the ``mlaunch trace`` sub-application by :func:`register`.

Bad input (no traces, a malformed line, an ``--iterations`` that is not a range or misses the
trace, an unwritable output) exits 2 with the file or flag named; never a traceback. Nothing
heavy is imported until the command runs (plotly only while rendering).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mlaunch.cli.errors import PlainErrorsCommand, error
from mlaunch.cli.trace_common import (
    OUTPUT_RULE_HELP,
    SKIP_HELP,
    cannot_write,
    check_output_or_exit,
)

_HELP_ITERATIONS = (
    "The timeline's window of iterations, A:B inclusive (or one iteration A). Default: the "
    "first and the last few iterations, with the set-up before and the tail after."
)


def report_cmd(
    path: Path = typer.Argument(
        ..., help="A run directory (runs/<run_id>) or an OTLP-JSON traces file.",
        show_default=False,
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", show_default=False,
        help="The HTML file to write. Default: RUN_DIR/report.html. " + OUTPUT_RULE_HELP,
    ),
    iterations: str | None = typer.Option(
        None, "--iterations", metavar="A:B", help=_HELP_ITERATIONS, show_default=False
    ),
    skip_invalid: bool = typer.Option(
        False, "--skip-invalid",
        help=SKIP_HELP,
    ),
) -> None:  # fmt: skip
    """Write one self-contained HTML report of a run; it opens offline, from disk.

    A header (run id, world layout, model, span groups, exporting ranks, wall time, goodput); a
    zoomable timeline of a window of iterations with one lane per exporting rank, spans nested by
    depth and coloured by group, attributes on hover, and arrows from each pipeline send to its
    linked receive; the span breakdown (sortable) and per-rank step skew; training curves from
    progress.jsonl (loss, eval loss, learning rate, grad norm, tokens/s, step time); and the
    goodput split. plotly.js is embedded once, so the file is about 5 MB whatever the run.
    """
    from mlaunch.outputs import OutputError, check_output, is_stdout
    from mlaunch.trace.reader import TraceInputError
    from mlaunch.trace.report import default_output, parse_iterations, render_report

    window = None
    if iterations is not None:
        try:
            window = parse_iterations(iterations)
        except ValueError as e:
            raise error(
                f"--iterations {e}\n  fix: pass --iterations A:B, e.g. --iterations 10:20"
            ) from None
    out = output if output is not None else default_output(path)
    try:  # the checks that need no input first: a bad -o is reported before any reading
        check_output(out)
        files = _inputs(path)
    except OutputError as e:
        raise error(str(e)) from None
    except TraceInputError as e:
        raise error(e.render()) from None
    target = check_output_or_exit(out, path, files)
    try:
        result = render_report(path, window, skip_invalid=skip_invalid)
        result.write(target)
    except TraceInputError as e:
        raise error(e.render()) from None
    except OSError as e:
        raise cannot_write(out, e) from None
    shown = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in result.window) or "all"
    links = f", {result.links} links" if result.links else ""
    typer.echo(
        f"wrote {'standard output' if is_stdout(out) else out} ({len(result.html.encode()) / 1e6:.1f} MB): timeline iterations {shown}, "
        f"{result.timeline_spans:,} spans on {result.lanes} lane(s){links}",
        err=is_stdout(out),  # the report itself is on standard output: keep it clean
    )
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)


def _inputs(path: Path) -> list[Any]:
    """The trace files ``-o`` must not overwrite: none for a run directory whose span store is
    all that is left (its OTLP-JSON moved away), which the report reads as the other commands do."""
    from mlaunch.trace.reader import TraceInputError, discover
    from mlaunch.trace.store_layout import load_manifest

    try:
        return discover(path)
    except TraceInputError:
        if path.is_dir() and load_manifest(path) is not None:
            return []
        raise


def register(trace_app: typer.Typer) -> None:
    """Add ``report`` to the ``mlaunch trace`` sub-application."""
    trace_app.command("report", cls=PlainErrorsCommand)(report_cmd)
