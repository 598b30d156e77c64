"""``mlaunch trace``: the commands that read a run's traces without a backend and the two that
act on a run.

Readers, each through the input's span store (:func:`mlaunch.trace.store.open_reader`): PATH is
a run directory (its ``telemetry/traces-rank*.jsonl`` and ``spool-traces-rank*.jsonl``,
deduplicated), a directory of trace files, or any OTLP/JSON lines file, e.g. what an
OpenTelemetry collector's file exporter writes; the store is built beside it on the first read
(or in the cache directory where that cannot be written).

* ``summary`` (per-name statistics, step skew), ``goodput`` (the wall-time split), ``stragglers``
  (who makes the others wait): computed by :mod:`mlaunch.trace` and rendered here as tables
  (``--json`` for machines);
* ``export`` (Chrome trace-event JSON, or OTLP-JSON back) and ``sql`` (DuckDB over the store);
* ``report`` (the HTML report), defined in :mod:`mlaunch.cli.trace_report` and registered last.

On a run: ``capture`` (turn on span groups, the profiler or the flight recorders in a running
job: :mod:`mlaunch.launcher.capture`) and ``replay`` (send the spans and metrics a run could not
deliver to a collector: :mod:`mlaunch.trace.replay`).

What lives here is the command line: options, the rendering of results as text, and bad input
turned into one line and exit 2 with the file, the line and the fix, never a traceback. Nothing
here imports torch or the OpenTelemetry SDK.
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
    help="Read a run's traces without a backend (summary, goodput, stragglers, sql, a"
    " Chrome/Perfetto export, an HTML report), turn on detail in a running job (capture) and"
    " send its undelivered spans to a collector (replay).",
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
    ranks' medians. Synchronous collectives make step times equal; `mlaunch trace stragglers`
    names the rank the others wait for.
    """
    from mlaunch.trace.summary import summarize_store

    def compute(reader: Any) -> Any:
        return summarize_store(reader.store, straggler_threshold=straggler_threshold)

    _show(path, skip_invalid, compute, as_json, _render_summary)


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
        if len(result.ranks) > 1:
            # Synchronous collectives make every rank's step as long as the slowest: the skew
            # above cannot name the rank the others wait for. The waits can.
            con.print(
                "[dim]step times hide the rank others wait for (collectives make them equal): "
                "`mlaunch trace stragglers` charges each wait to the rank that arrived last[/dim]",
                highlight=False,
            )
    style = "red" if flags else "green"
    con.print(f"[{style}]error spans: {result.errors}  truncated spans: {result.truncated}[/]")
    if result.shared_root_ids:
        from mlaunch.trace.summary import SHARED_IDS_NOTE

        note = SHARED_IDS_NOTE.format(n=result.shared_root_ids)
        con.print(f"[yellow]note: {note}[/yellow]", markup=True, highlight=False)
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
        typer.echo(
            f"wrote {'standard output' if is_stdout(output) else output} ({fmt.value}): {n:,} spans",
            err=is_stdout(output),  # the spans themselves are on standard output
        )
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
    # The launcher's job trace is a process of its own, but no rank: counted apart.
    ranks = stats.processes - stats.launchers
    procs = f"{ranks} rank{'s' if ranks != 1 else ''}"
    if stats.launchers:
        procs += (
            " and the launcher" if stats.launchers == 1 else f" and {stats.launchers} launchers"
        )
    typer.echo(
        f"wrote {'standard output' if is_stdout(output) else output} ({fmt.value}): "
        f"{stats.spans:,} spans, {procs}, "
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
    iteration's excess over the rank's median step. [b]startup[/b]: what every start costs, the
    first launch's and each restart's: startup.model_init, checkpoint.load, startup.dataloader,
    train.first_iteration and the rest of megatron.startup, outside steps, plus that excess, plus
    requeue (the gaps between restarts). [b]checkpoint[/b]: checkpoint.save. [b]evaluation[/b]:
    evaluate. [b]unaccounted[/b]: the rest. Older traces' documented names count the same.
    Nested spans are never counted twice (precedence step > startup > checkpoint > evaluation),
    so the parts add up to wall. Overall = sums over ranks. --json keeps the names restart_ms
    and restart_split_ms for the startup part.
    """
    from mlaunch.trace.goodput import goodput_store

    _show(path, skip_invalid, lambda r: goodput_store(r.store), as_json, _render_goodput)


def _render_goodput(report: Any) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title="goodput", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ("rank", "host", "goodput", "wall", "productive", "startup", "ckpt", "eval", "unacct")
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
    con.print(f"start-up cost (all ranks): {split}", highlight=False)
    if not report.ranks:
        con.print("only the launcher's job trace: the workers exported no spans, so none of the"
                  " job's wall time shows as productive", highlight=False)  # fmt: skip
    con.print("[dim]ckpt = checkpoint saves, eval = evaluation, unacct = unaccounted; "
              "see `mlaunch trace goodput --help` for the definitions[/dim]")  # fmt: skip


@app.command("stragglers", cls=PlainErrorsCommand)
def stragglers_cmd(
    path: Path = typer.Argument(..., help=_PATH_HELP, show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help=SKIP_HELP),
) -> None:
    """Who makes everyone wait: at every synchronising point the rank that arrived last is
    charged the time the others waited, per rank and phase, most first.

    Synchronising points: the gradient all-reduce (megatron.grad_sync.finish, per iteration and
    pipeline stage) and pipeline P2P pairs (recv_forward joined to the sender's send_forward by
    its link, recv_backward to send_backward). [b]phase[/b]: where the late rank lost the time
    against its peers (forward, backward, data_loading, optimizer, checkpoint, evaluation, ...);
    a rank late only because it waited on its pipeline neighbour passes the charge on. Needs the
    spans of every rank (--otel-export-strategy all_ranks, or the flight recorders): with one
    exporting rank it exits 2 and says how to get them. docs/hangs.md has the details.
    """
    from mlaunch.trace.stragglers import stragglers_store

    _show(path, skip_invalid, lambda r: stragglers_store(r.store), as_json, _render_stragglers)


#: Rows of the stragglers table shown as text (the rest is summed up: most are noise).
_STRAGGLER_ROWS = 10

#: Characters of a row's iterations in a pipe or a file, where no terminal sets the width: a
#: scattered set (every other iteration of a long run) would make a row thousands of characters
#: long. The count, the extent and the first runs fit; ``--json`` has every iteration.
_PLAIN_ITERATIONS_CHARS = 60


def _render_stragglers(result: Any) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    term = con.is_terminal
    if not term:  # a pipe or a file: one row a line, never folded
        con = Console(width=1 << 16, soft_wrap=True, no_color=True, highlight=False)
    points = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in result.sync_points.items())
    con.print(
        f"[b]ranks[/b] {format_ranks(result.ranks_seen)}  [b]synchronising points[/b] {points}"
        f"  [b]waits charged[/b] {result.total_wait_s:.3f} s",
        highlight=False,
    )
    if result.missing_ranks:
        con.print(
            f"[yellow]warning: no spans from ranks {format_ranks(result.missing_ranks)}: waits "
            "they caused or suffered are not counted (--otel-export-strategy all_ranks)[/]",
            highlight=False,
        )
    if not result.ranks:
        con.print("no rank made another wait")
        return
    shown = result.ranks[:_STRAGGLER_ROWS]
    cols = ("rank", "host", "phase", "caused wait", "waits", "iterations")

    def table(iterations: list[str]) -> Table:
        if term:
            t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        else:  # plain: no box lines around the rows
            t = Table(box=None, pad_edge=False, show_edge=False)
        for col in cols:
            t.add_column(
                col, justify="right" if col in ("rank", "caused wait", "waits") else "left"
            )
        for c, its in zip(shown, iterations, strict=True):
            t.add_row(
                str(c.rank), c.host or "-", c.phase, f"{c.caused_wait_s:.3f} s", str(c.waits),
                its,
            )  # fmt: skip
        return t

    # The iterations get what the other columns leave of the terminal's width, so a row stays
    # one line; a set that does not fit is summed up as a count and its first runs.
    others = con.measure(table([""] * len(shown))).maximum - len(cols[-1])
    width = con.width - others if term else _PLAIN_ITERATIONS_CHARS
    con.print(table([format_ranks(c.iterations, width) or "-" for c in shown]))
    if rest := result.ranks[len(shown) :]:
        con.print(
            f"[dim]{len(rest)} more row(s), {sum(c.caused_wait_s for c in rest):.3f} s in all "
            "(--json has every row)[/dim]",
            highlight=False,
        )
    top = result.ranks[0]
    con.print(
        f"rank {top.rank} made the others wait most: {top.caused_wait_s:.3f} s, late in "
        f"{top.phase}",
        highlight=False,
    )


class SqlFormat(StrEnum):
    """Output formats of ``mlaunch trace sql``."""

    table = "table"
    json = "json"
    csv = "csv"


@app.command("sql", cls=PlainErrorsCommand)
def sql_cmd(
    run_dir: Path = typer.Argument(..., help=_PATH_HELP, show_default=False),
    query: str = typer.Argument(..., help="A DuckDB SQL query.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of row objects."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV with a header row."),
) -> None:
    """Run SQL over a run's span store: views [b]spans[/b] (one row per span) and [b]resources[/b].

    The store (RUN_DIR/trace-store, Parquet; a traces file's beside it, or in
    $XDG_CACHE_HOME/mlaunch/stores where that cannot be written) is built from the OTLP-JSON on
    first use; every other trace command reads it from then on.
    Columns of spans: trace_id, span_id, parent_id, name, group, rank, node, iteration (the
    span's own, else its enclosing megatron.train.iteration step's on its rank), microbatch,
    start_ns, end_ns, duration_ns (end - start, >= 0), status (2 = error), truncated,
    attributes (JSON), links, events, extra, resource_id; docs/trace.md says each. Span ids are
    unique within a rank only (nemo-lens 0.1.0 ranks seeded alike share them): join a span to
    its parent on rank, trace_id and parent_id.
    Examples: docs/trace.md, "SQL over a run".
    """
    from mlaunch.trace.reader import TraceInputError
    from mlaunch.trace.store import run_sql

    if as_json and as_csv:
        raise error("--json and --csv are exclusive; fix: pass one of them")
    if not (run_dir.is_dir() or run_dir.is_file()):
        raise error(
            f"{run_dir}: not a run directory or a traces file; fix: pass a run directory"
            " (runs/<run_id>) or an OTLP-JSON traces file"
        )
    reader = _open(run_dir, skip_invalid=False)
    try:
        result = run_sql(reader.store, query)
    except TraceInputError as e:
        raise error(e.render().replace("\n  fix:", "; fix:")) from None
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
    groups: str | None = typer.Option(
        None,
        "--groups",
        metavar="SPEC",
        help="Span groups to turn on for the window (presets and groups, e.g. all or layer,microbatch).",
    ),
    iterations: int | None = typer.Option(
        None, "--iterations", metavar="N", help="Keep them on for N iterations."
    ),
    seconds: float | None = typer.Option(
        None, "--seconds", metavar="S", help="Keep them on for S seconds (instead of --iterations)."
    ),
    ranks: str = typer.Option("all", "--ranks", help="all, or ranks as R,R,..."),
    profiler: bool = typer.Option(
        False,
        "--profiler",
        help="Also run torch.profiler for the window (telemetry/profiler-rank<R>-<id>.json).",
    ),
    recorded: bool = typer.Option(
        False, "--recorded", help="Every selected rank writes what its flight recorder holds now."
    ),
    wait: bool = typer.Option(
        False,
        "--wait",
        help="Wait until every selected rank has applied and ended the capture (with --recorded"
        " alone: written its dump).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
) -> None:
    """Turn on detail in a running job: with --groups, every selected rank switches those span
    groups on at the same iteration (printed), keeps them for --iterations N (or --seconds S)
    and switches back; ranks that export nothing export for the window. With --recorded, each
    selected rank writes its flight recorder (telemetry/recorder-rank<R>.jsonl).

    The request goes into the run directory, which each worker reads at most once a second; a
    request left behind never applies to a later run or restart. Exit 2, with nothing written,
    for a run that is not running, --recorded on a run without a flight recorder, an unknown
    rank, a bad spec or window, or while another capture runs.
    """
    from mlaunch.launcher.capture import CaptureInputError, request_capture, wait_for_capture
    from mlaunch.launcher.run_status import JobStatus
    from mlaunch.slurm.status import StatusInputError, job_status

    def status() -> JobStatus:
        try:
            return job_status(target, Path.cwd())
        except StatusInputError as exc:
            raise CaptureInputError(str(exc)) from None

    try:
        req = request_capture(
            target,
            status,
            recorded=recorded,
            ranks=ranks,
            groups=groups,
            iterations=iterations,
            seconds=seconds,
            profiler=profiler,
        )
    except CaptureInputError as e:
        raise error(str(e)) from None
    if not as_json:
        typer.echo(_capture_text(req))
    if wait:  # a live capture's end, or (--recorded alone) every rank's dump
        req = wait_for_capture(req)
    if as_json:
        typer.echo(json.dumps(req.as_json(), indent=2))
    elif req.waited:
        typer.echo(_capture_outcome_text(req))
    if req.waited and not req.complete:
        raise typer.Exit(RUN_FAILED)


def _capture_text(req: Any) -> str:
    """What was asked, in one or two lines."""
    who = "every rank" if req.ranks is None else f"ranks {format_ranks(req.ranks)}"
    if not req.live:
        return (
            f"requested {req.id}: {who} of {req.run_dir} write their flight recorders at their"
            f" next iteration (the run was at iteration {req.iteration}); read them with"
            f" mlaunch trace summary {req.run_dir}"
        )
    if req.iterations is not None:
        window = (
            f"iterations {req.start_iteration}-{req.start_iteration + req.iterations - 1}"
            if req.iterations > 1
            else f"iteration {req.start_iteration}"
        )
    else:
        window = f"{req.seconds:g} s from iteration {req.start_iteration}"
    what = req.groups or "no extra groups"
    lines = [
        f"capture {req.id}: {what} on {who} of {req.run_dir} for {window}"
        f" (the run was at iteration {req.iteration})"
        + ("; torch.profiler too" if req.profiler else "")
        + ("; flight recorders written now" if req.recorded else "")
    ]
    if req.exporter_started:
        one = len(req.exporter_started) == 1
        lines.append(
            f"rank{'' if one else 's'} {format_ranks(req.exporter_started)}"
            f" export{'s' if one else ''} nothing under the run's strategy:"
            f" {'its' if one else 'their'} exporter starts for the capture"
        )
    if req.expected_ranks is not None and req.ranks is not None:
        silent = sorted(set(req.ranks) - set(req.expected_ranks))
        if silent:
            lines.append(
                f"rank{'s' if len(silent) > 1 else ''} {format_ranks(silent)}: no worker there"
                " has said it listens (telemetry off, not started yet, or its node does not"
                " share the run directory: then run the same command on that node)"
            )
    if req.lens_ranks is not None:
        lines.append(
            "nemo-lens workers (a time window; they cannot see iterations): "
            + (
                f"ranks {format_ranks(req.lens_ranks)} capture"
                if req.lens_ranks
                else "none capture"
            )
        )
        lines += [f"  rank {r}: {why}" for r, why in sorted(req.lens_cannot.items())][:8]
    lines.append(f"read it with: mlaunch trace report {req.run_dir}")
    return "\n".join(lines)


def _capture_outcome_text(req: Any) -> str:
    """Each rank's outcome after --wait."""
    outcome = req.outcome or {}
    lines = []
    for rank in req.expected_ranks or sorted(outcome):
        ack = outcome.get(rank)
        if ack is None:
            lines.append(
                f"rank {rank}: no answer (stopped, or its node does not share the run"
                " directory: then run the same command on that node)"
            )
            continue
        first, last = ack.get("first_iteration"), ack.get("last_iteration")
        span = f"iterations {first}-{last}" if first is not None else "no iteration"
        if ack.get("applied_ns") and ack.get("ended_ns"):  # a nemo-lens worker's time window
            span = f"{(ack['ended_ns'] - ack['applied_ns']) / 1e9:.1f} s of nemo-lens spans"
        extra = f"; profiler trace {ack['profiler_file']}" if ack.get("profiler_file") else ""
        note = f" ({ack['note']})" if ack.get("note") else ""
        lines.append(f"rank {rank}: {ack.get('state')}, {span}{extra}{note}")
    if not lines:
        lines.append("no rank answered: is telemetry on in this run?")
    return "\n".join(lines)


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


# `mlaunch trace report` lives in mlaunch/cli/trace_report.py; registered last, so it is
# the `report` command this app runs.
from mlaunch.cli.trace_report import register as _register_report  # noqa: E402

_register_report(app)
