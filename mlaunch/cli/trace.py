"""``mlaunch trace summary|export|goodput PATH`` and ``replay RUN_DIR``: thin commands over
:mod:`mlaunch.trace`.

PATH is a run directory (its ``telemetry/traces-rank*.jsonl`` and ``spool-traces-rank*.jsonl``,
deduplicated) or any OTLP/JSON lines file, e.g. what an OpenTelemetry collector's file exporter
writes. Bad input exits 2 with the file, the line and the fix; never a traceback. Nothing here
imports torch or the OpenTelemetry SDK.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from mlaunch.cli.errors import RUN_FAILED, PlainErrorsCommand, PlainErrorsGroup, error
from mlaunch.cli.trace_common import (
    OUTPUT_RULE_HELP,
    SKIP_HELP,
    cannot_write,
    check_output_or_exit,
    warn_skipped,
)
from mlaunch.model.strategies import format_ranks
from mlaunch.trace.durations import format_ms

app = typer.Typer(
    help="Read a run's traces without a backend (summary, goodput, Chrome/Perfetto export, HTML"
    " report) and send its undelivered spans to a collector (replay).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    cls=PlainErrorsGroup,
)

_PATH_HELP = "A run directory (runs/<run_id>) or an OTLP-JSON traces file."


class ExportFormat(StrEnum):
    """Output formats of ``mlaunch trace export``."""

    chrome = "chrome"
    otlp_json = "otlp-json"


def _open(path: Path, skip_invalid: bool) -> Any:
    """The trace reader for ``path``; an unusable path (a name too long for the file system, a
    permission error) exits 2 naming it, like every other bad input, instead of a traceback."""
    from mlaunch.model.spec import quoted
    from mlaunch.trace.reader import TraceInputError
    from mlaunch.trace.store import open_reader, take_warnings

    try:
        # A run directory is read through its span store, built on first read (docs/trace.md).
        reader = open_reader(path, skip_invalid=skip_invalid)
        for w in take_warnings():
            typer.echo(f"warning: {w}", err=True)
        return reader
    except TraceInputError as e:
        raise error(e.render()) from None
    except OSError as e:
        raise error(
            f"{quoted(str(path))}: {e.strerror or e}\n"
            "  fix: pass a run directory (runs/<run_id>) or an OTLP-JSON traces file"
        ) from None


def _show(
    path: Path,
    skip_invalid: bool,
    compute: Callable[[Any], Any],
    as_json: bool,
    render: Callable[[Any], None],
) -> None:
    """Read ``path``, compute a result from the reader, then print it as JSON or render it; bad
    input exits 2 naming the file and line."""
    from mlaunch.trace.reader import TraceInputError

    reader = _open(path, skip_invalid)
    try:
        result = compute(reader)
    except TraceInputError as e:
        raise error(e.render()) from None
    warn_skipped(reader.stats)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        render(result)


@app.command("summary", cls=PlainErrorsCommand)
def summary_cmd(
    path: Path = typer.Argument(..., help=_PATH_HELP, show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
    straggler_threshold: float = typer.Option(
        0.05,
        "--straggler-threshold",
        min=0.0,
        help="Flag a rank whose median step exceeds the median of all ranks' medians by more "
        "than this fraction.",
    ),  # fmt: skip
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help=SKIP_HELP),
) -> None:
    """Per span name: count, total, mean, p50/p95/max and share of step time; stragglers.

    Also per-rank skew of the step span (megatron.train.iteration; megatron.train_step in older
    traces), error and truncated span counts, and the run's identity (run id, world layout,
    model) from the resource attributes. Older traces' documented names are counted under the
    code names Megatron-LM emits.

    [b]share[/b] = the name's total time / total megatron.train.iteration time (for spans outside
    steps, e.g. checkpoint saves, their cost relative to training). Percentiles interpolate
    linearly between closest ranks. [b]skew[/b]: each rank's median step over the median of all
    ranks' medians.
    """
    from mlaunch.trace.store import StoreReader
    from mlaunch.trace.store_summary import summarize_store
    from mlaunch.trace.summary import summarize

    def compute(reader: Any) -> Any:
        if isinstance(reader, StoreReader):  # one vectorised query instead of a span loop
            return summarize_store(reader.store, straggler_threshold=straggler_threshold)
        return summarize(reader, straggler_threshold=straggler_threshold)

    _show(
        path,
        skip_invalid,
        compute,
        as_json,
        _render_summary,
    )


def _render_summary(result: Any) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from mlaunch.cli.render import name_table

    con = Console()
    # Written to a pipe or a file: plain lines that never wrap (rich would fold them at 80
    # columns), so grep and awk see one row a line.
    term = con.is_terminal
    if not term:
        con = Console(width=1 << 16, soft_wrap=True, no_color=True, highlight=False)
    run = ", ".join(f"{k}={v}" for k, v in result.run.items())
    con.print(f"[b]run[/b] {escape(run)}", highlight=False)
    hosts = ", ".join(result.hosts) or "-"
    con.print(
        f"[b]ranks[/b] {format_ranks(result.rank_ids) or '-'}  [b]hosts[/b] {escape(hosts)}",
        highlight=False,
    )

    # Error/truncated columns only when some span has them: most runs have none.
    flags = bool(result.errors or result.truncated)
    cols = ["name", "count", "total", "mean", "p50", "p95", "max", "share"]
    cols += ["err", "trunc"] if flags else []
    rows = []
    for s in result.spans:
        times = (s.total_ms, s.mean_ms, s.p50_ms, s.p95_ms, s.max_ms)
        cells = [f"{s.count:,}", *map(format_ms, times)]
        cells += ["-" if s.share is None else f"{100 * s.share:.1f}%"]
        cells += [str(s.errors or "-"), str(s.truncated or "-")] if flags else []
        rows.append((s.name, cells))
    con.print("spans by total time", highlight=False)
    head, *body = name_table(cols, rows, con.width if term else None)
    con.print(f"[b]{escape(head)}[/b]" if term else head, highlight=False)
    for line in body:
        con.print(line, markup=False, highlight=False)
    con.print()

    if result.skew is not None:
        k = result.skew
        title = "megatron.train.iteration per rank"
        if term:
            t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        else:  # plain: no box lines or title padding around the rows
            con.print(title)
            t = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("rank", "host", "steps", "median", "p95", "vs median", ""):
            t.add_column(col, justify="left" if col in ("host", "") else "right")
        for r in result.ranks:
            mark = "[red]straggler[/red]" if r.straggler else ""
            t.add_row(
                str(r.rank), r.host or "-", str(r.steps), format_ms(r.median_ms),
                format_ms(r.p95_ms), f"{r.ratio:.3f}x", mark,
            )  # fmt: skip
        con.print(t)
        if k.stragglers:
            verdict = f"[red]stragglers: {', '.join(map(str, k.stragglers))}[/red]"
        else:
            verdict = f"no straggler above {100 * k.threshold:.0f}%"
        con.print(
            f"slowest rank {k.slowest_rank}: median step {format_ms(k.slowest_median_ms)}, "
            f"{k.slowest_ratio:.3f}x the median of rank medians"
            f" ({format_ms(k.reference_median_ms)}); {verdict}",
            highlight=False,
        )
    style = "red" if flags else "green"
    con.print(f"[{style}]error spans: {result.errors}  truncated spans: {result.truncated}[/]")
    rd = result.read
    if rd:
        dup = rd["duplicate_spans_dropped"]
        note = f", {dup:,} duplicates dropped" if dup else ""
        con.print(f"[dim]read {rd['spans']:,} spans from {rd['files']} file(s){note}[/dim]")


@app.command("export", cls=PlainErrorsCommand)
def export_cmd(
    path: Path = typer.Argument(..., help=_PATH_HELP, show_default=False),
    fmt: ExportFormat = typer.Option(ExportFormat.chrome, "--format", "-f", help="Output format."),
    output: Path = typer.Option(
        ..., "--output", "-o", help="The file to write. " + OUTPUT_RULE_HELP, show_default=False
    ),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help=SKIP_HELP),
) -> None:
    """Write Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.

    [b]--format otlp-json[/b] writes the spans back as OTLP-JSON lines (from the run's span
    store when it has one), which any OpenTelemetry tool or `mlaunch trace` reads.

    One process per rank (named by rank and host), one thread per OS thread (the thread.id
    attribute, else one per rank); spans that overlap without nesting go to extra lanes. Span
    attributes are args, span events are instant events, links are flow arrows. Times are
    microseconds from the earliest span.
    """
    from mlaunch.outputs import OutputError, check_output, is_stdout
    from mlaunch.trace.chrome import export_chrome
    from mlaunch.trace.reader import TraceInputError

    try:  # the checks that need no input first: a bad -o is reported before any reading
        check_output(output)
    except OutputError as e:
        raise error(str(e)) from None
    reader = _open(path, skip_invalid)
    target = check_output_or_exit(output, path, reader.files)
    if fmt is ExportFormat.otlp_json:
        from mlaunch.trace.store import export_otlp_json

        try:
            n = export_otlp_json(reader, target)
        except TraceInputError as e:
            raise error(e.render()) from None
        except OSError as e:
            raise cannot_write(output, e) from None
        warn_skipped(reader.stats)
        typer.echo(f"wrote {output} ({fmt.value}): {n:,} spans")
        return
    try:
        stats = export_chrome(reader, target)
    except TraceInputError as e:
        raise error(e.render()) from None
    except OSError as e:
        raise cannot_write(output, e) from None
    warn_skipped(reader.stats)
    unresolved = (
        f", {stats.unresolved_links} links to unexported spans" if stats.unresolved_links else ""
    )
    typer.echo(
        f"wrote {'standard output' if is_stdout(output) else output} ({fmt.value}): "
        f"{stats.spans:,} spans, {stats.processes} ranks, "
        f"{stats.threads} threads in {stats.lanes} lanes, {stats.flows} flows{unresolved}",
        err=is_stdout(output),  # the trace itself is on standard output: keep it clean
    )


@app.command("goodput", cls=PlainErrorsCommand)
def goodput_cmd(
    path: Path = typer.Argument(..., help=_PATH_HELP, show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help=SKIP_HELP),
) -> None:
    """Productive training time over wall time, per rank and overall, and where the rest went.

    [b]wall[/b]: the launcher's mlaunch.job span (earliest start to latest end) when the run has
    one; else megatron.pretrain of older traces; else the extent of all the rank's spans.
    [b]productive[/b]: time in megatron.train.iteration (megatron.train_step) minus the first
    iteration's excess over the rank's median step. [b]restart[/b]: startup.model_init,
    checkpoint.load, startup.dataloader, train.first_iteration and the rest of megatron.startup,
    outside steps, plus that excess. [b]checkpoint[/b]: checkpoint.save. [b]evaluation[/b]:
    evaluate. [b]unaccounted[/b]: the rest. Older traces' documented names count the same.
    Nested spans are never counted twice (precedence step > restart > checkpoint > evaluation),
    so the parts add up to wall. Overall = sums over ranks.
    """
    from mlaunch.trace.goodput import goodput
    from mlaunch.trace.store import StoreReader
    from mlaunch.trace.store_goodput import goodput_store

    def compute(reader: Any) -> Any:
        if isinstance(reader, StoreReader):  # a few queries instead of a span loop
            return goodput_store(reader.store)
        return goodput(reader)

    _show(path, skip_invalid, compute, as_json, _render_goodput)


def _render_goodput(report: Any) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title="goodput", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ("rank", "host", "goodput", "wall", "productive", "restart", "ckpt", "eval", "unacct")
    for col in cols:
        t.add_column(col, justify="left" if col == "host" else "right", no_wrap=True)

    def row(label: str, host: str, b: Any, style: str | None = None) -> None:
        cells = [b.wall_ms, b.productive_ms, b.restart_ms, b.checkpoint_ms, b.evaluation_ms]
        cells.append(b.unaccounted_ms)
        t.add_row(label, host, f"{100 * b.goodput:.1f}%", *map(format_ms, cells), style=style)

    for r in report.ranks:
        row(str(r.rank), r.host or "-", r.breakdown)
    row("all", "", report.overall, style="bold")
    con.print(t)
    split = ", ".join(f"{k} {format_ms(v)}" for k, v in report.overall.restart_split_ms.items())
    con.print(f"restart cost (all ranks): {split}", highlight=False)
    con.print("[dim]ckpt = checkpoint saves, eval = evaluation, unacct = unaccounted; "
              "see `mlaunch trace goodput --help` for the definitions[/dim]")  # fmt: skip


class SqlFormat(StrEnum):
    """Output formats of ``mlaunch trace sql``."""

    table = "table"
    json = "json"
    csv = "csv"


@app.command("sql", cls=PlainErrorsCommand)
def sql_cmd(
    run_dir: Path = typer.Argument(
        ..., help="A run directory (runs/<run_id>).", show_default=False
    ),
    query: str = typer.Argument(..., help="A DuckDB SQL query.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of row objects."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV with a header row."),
) -> None:
    """Run SQL over a run's span store: views [b]spans[/b] (one row per span) and [b]resources[/b].

    The store (RUN_DIR/trace-store, Parquet) is built from the run's OTLP-JSON on first use; every
    other trace command on the run reads it from then on.
    Columns of spans: trace_id, span_id, parent_id, name, group, rank, node, iteration,
    microbatch, start_ns, end_ns, status (2 = error), truncated, attributes (JSON), links,
    events, extra, resource_id. Examples: docs/trace.md, "SQL over a run".
    """
    from mlaunch.trace.reader import TraceInputError
    from mlaunch.trace.store import open_store, run_sql, take_warnings

    if as_json and as_csv:
        raise error("--json and --csv are exclusive; fix: pass one of them")
    if not run_dir.is_dir():
        raise error(f"{run_dir}: not a run directory; fix: pass a run directory (runs/<run_id>)")
    try:
        store = open_store(run_dir)
        for w in take_warnings() + (store.warnings if store else []):
            typer.echo(f"warning: {w}", err=True)
        if store is None:
            raise error(
                f"{run_dir}: cannot build the span store (the run directory is not writable); "
                "fix: copy the run directory somewhere writable"
            )
        result = run_sql(store, query)
    except TraceInputError as e:
        raise error(e.render().replace("\n  fix:", "; fix:")) from None
    except OSError as e:
        raise error(
            f"{run_dir}: {e.strerror or e}; fix: check the path and its permissions"
        ) from None
    _print_rows(result.columns, result.rows, "json" if as_json else "csv" if as_csv else "table")


def _print_rows(columns: list[str], rows: list[tuple[Any, ...]], fmt: str) -> None:
    if fmt == "json":
        typer.echo(json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=str))
    elif fmt == "csv":
        import csv
        import sys

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(columns)
        w.writerows(rows)
    else:
        from rich import box
        from rich.console import Console
        from rich.table import Table

        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for c in columns:
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*("" if v is None else str(v) for v in r))
        Console().print(t)
        typer.echo(f"{len(rows):,} row(s)")


class ReplayProtocol(StrEnum):
    """OTLP transports ``mlaunch trace replay`` speaks."""

    grpc = "grpc"
    http_protobuf = "http/protobuf"


@app.command("replay", cls=PlainErrorsCommand)
def replay_cmd(
    run_dir: Path = typer.Argument(
        ..., help="A run directory (runs/<run_id>).", show_default=False
    ),
    endpoint: str = typer.Option(
        ..., "--endpoint", help="The collector, e.g. http://localhost:4317.", show_default=False
    ),
    protocol: ReplayProtocol = typer.Option(
        ReplayProtocol.grpc, "--protocol", help="OTLP transport."
    ),
    headers: str = typer.Option(
        "", "--headers", help="Request headers as KEY=VALUE,KEY2=VALUE2 (e.g. an API key)."
    ),
    timeout_s: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds per request."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
) -> None:
    """Send the spans and metrics a run could not deliver (its spool files) to a collector.

    Each spool line goes out as one OTLP export request. What was delivered is recorded in
    telemetry/replayed.json, line by line, so a second replay sends nothing twice and an
    interrupted one resumes. Exit 0 when everything was sent, 1 when some requests failed (they are
    kept for the next replay), 2 on a bad run directory, endpoint or header.
    """
    from mlaunch.trace.replay import ReplayInputError, parse_headers, replay

    try:
        result = replay(
            run_dir, endpoint, protocol=protocol.value, headers=parse_headers(headers),
            timeout_s=timeout_s,
        )  # fmt: skip
    except ReplayInputError as e:
        raise error(str(e)) from None
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    elif not result.files:
        typer.echo(f"nothing to replay: {run_dir} {_no_spool_reason(result.exporter)}")
    else:
        typer.echo(
            f"replayed {run_dir} to {result.endpoint} ({result.protocol}): sent {result.spans_sent:,}"
            f" spans and {result.metric_batches_sent:,} metric batches in {result.requests_sent:,}"
            f" requests; failed {result.spans_failed:,} spans and {result.metric_batches_failed:,}"
            f" metric batches; {result.spans_already_sent:,} spans were sent by earlier replays"
        )
        if result.malformed_lines:
            typer.echo(f"warning: skipped {result.malformed_lines} malformed spool lines", err=True)
    if result.failed:
        mismatch = "protocol mismatch" in (result.error or "")
        retry = (
            "" if mismatch else "; what was not sent is kept: run the same command again to retry"
        )
        raise error(f"{result.error}{retry}", RUN_FAILED)


@app.command("capture", cls=PlainErrorsCommand)
def capture_cmd(
    target: str = typer.Argument(
        ..., metavar="RUN_DIR|JOB_ID", help="A running run's directory or its SLURM job id."
    ),
    recorded: bool = typer.Option(
        False, "--recorded", help="Every selected rank writes what its flight recorder holds now."
    ),
    ranks: str = typer.Option("all", "--ranks", help="all, or ranks as R,R,..."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
) -> None:
    """Ask a running job's workers for detail: with --recorded, each selected rank writes its
    flight recorder (telemetry/recorder-rank<R>.jsonl, trigger "request") at its next iteration.

    The request goes into the run directory, which each worker reads at most once a second; a
    request left behind never applies to a later run or restart. Exit 2, with nothing written,
    for a finished run, an unknown rank or nothing to capture.
    """
    from mlaunch.launcher.capture import CaptureInputError, request_capture

    try:
        req = request_capture(target, Path.cwd(), recorded=recorded, ranks=ranks)
    except CaptureInputError as e:
        raise error(str(e)) from None
    if as_json:
        typer.echo(json.dumps(req.as_json(), indent=2))
        return
    who = "every rank" if req.ranks is None else f"ranks {format_ranks(req.ranks)}"
    typer.echo(
        f"requested {req.id}: {who} of {req.run_dir} write their flight recorders at their next"
        f" iteration (the run was at iteration {req.iteration}); read them with"
        f" mlaunch trace summary {req.run_dir}"
    )


def _no_spool_reason(exporter: str | None) -> str:
    """Why a run has no spool, from the exporter it used."""
    if exporter in ("file", "console", "none"):
        return (
            f"has no spool: it used the {exporter} exporter, which sends nothing to a collector"
            " (its spans are in telemetry/traces-*.jsonl; read them with `mlaunch trace summary`)"
        )
    if exporter == "otlp":
        return "has no spool files (every export was delivered)"
    return "has no spool files"


# `mlaunch trace report` (issue 9) lives in mlaunch/cli/trace_report.py; registered last, so it is
# the `report` command this app runs.
from mlaunch.cli.trace_report import register as _register_report  # noqa: E402

_register_report(app)
