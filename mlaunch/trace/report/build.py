"""Render a run's report: read the trace twice, build the figures, write the page."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.outputs import open_output
from mlaunch.rundir import layout as lay
from mlaunch.rundir.state import RunState
from mlaunch.trace.goodput import GoodputReport
from mlaunch.trace.metrics import read_metric_points
from mlaunch.trace.reader import ReadStats
from mlaunch.trace.report.charts import curves, curves_need_steps, goodput_figure, skew_figure
from mlaunch.trace.report.page import page
from mlaunch.trace.report.rundir import (
    default_output,
    read_progress,
    read_resolved,
    run_directory,
)
from mlaunch.trace.report.timeline import Timeline, build_timeline, mark_text
from mlaunch.trace.report.window import (
    Mark,
    StoreScan,
    choose_iterations,
    collect_window,
    segments,
)
from mlaunch.trace.store import StoreReader, open_reader
from mlaunch.trace.summary import Summary


def with_run_model(marks: list[Mark], model: RunState) -> list[Mark]:
    """``marks`` with the iterations the run model knows where their spans could not tell: a
    capture's (by id) from its acks or schedule, a recorder dump's (by trigger and rank) from
    the recorder's index."""
    captures = {c.id: c.iterations for c in model.captures if c.iterations is not None}
    out = []
    for m in marks:
        its = m.iterations
        if its is None and m.kind == "capture":
            its = captures.get(m.label)
        elif its is None and m.kind == "recorder":
            held = [d.iterations for d in model.dumps
                    if d.trigger == m.label and d.rank in m.ranks and d.iterations]  # fmt: skip
            its = (min(a for a, _ in held), max(b for _, b in held)) if held else None  # type: ignore[misc]
        out.append(m._replace(iterations=its) if its != m.iterations else m)
    return out


@dataclass
class ReportResult:
    """A rendered report and what it shows."""

    html: str
    window: list[tuple[int, int]]  # the iteration ranges of the timeline ([] = whole trace)
    timeline_spans: int
    lanes: int
    links: int
    notes: list[str] = field(default_factory=list)
    #: The live captures and recorder dumps the timeline marks.
    marks: list[Mark] = field(default_factory=list)

    def write(self, out: Path) -> Path:
        """Write atomically (never a half-written report that looks complete); return ``out``."""
        out = Path(out)
        with open_output(out) as f:  # the rule of mlaunch.outputs (checked by the caller)
            f.write(self.html)
        return out


def _notes(
    read_stats: ReadStats,
    bad_progress: int,
    timeline: Timeline,
    ranges: list[tuple[int, int]],
    workers: bool = True,
) -> list[str]:
    """What the report skipped or could not show, for its Notes section. ``workers`` False:
    the trace holds only the launcher's job trace."""
    notes: list[str] = []
    if read_stats.skipped_lines:
        notes.append(f"{len(read_stats.skipped_lines)} unreadable trace line(s) skipped")
    if read_stats.torn_lines:
        notes.append(f"{len(read_stats.torn_lines)} torn last line(s) skipped (a crashed or "
                     "still-running writer)")  # fmt: skip
    if read_stats.skipped_spans:
        notes.append(f"{len(read_stats.skipped_spans)} malformed span(s) skipped")
    if bad_progress:
        notes.append(f"{bad_progress} unreadable line(s) of {lay.PROGRESS_FILE} skipped")
    if timeline.unresolved_links:
        notes.append(f"{timeline.unresolved_links} link(s) point at spans not in the window "
                     "(the sender did not export, or sent outside the window)")  # fmt: skip
    if not workers:
        notes.append("only the launcher's job trace (mlaunch.job and its attempts): the workers"
                     " exported no spans")  # fmt: skip
    elif not ranges:
        notes.append("no megatron.train.iteration spans with an iteration (the step group is off): "
                     "the timeline shows the whole trace")  # fmt: skip
    return notes


def _figures(
    timeline: Timeline,
    curve_figs: dict[str, dict[str, Any]],
    summary: Summary,
    gp: GoodputReport,
) -> dict[str, dict[str, Any]]:
    """Every figure of the page by the id of the element that shows it."""
    figures: dict[str, dict[str, Any]] = {"timeline": timeline.figure}
    figures.update(curve_figs)
    skew_fig = skew_figure(summary)
    if skew_fig is not None:
        figures["chart-skew"] = skew_fig
    figures["chart-goodput"] = goodput_figure(gp)
    return figures


def render_report(
    run_dir: Path, iterations: tuple[int, int] | None = None, *, skip_invalid: bool = False
) -> ReportResult:
    """Read a run directory (or a traces file) and render the report's HTML.

    Raises ``TraceInputError`` for unreadable input, a trace without spans, or an ``iterations``
    window outside the trace.
    """
    run_dir = Path(run_dir)
    # The span store of the input (built on its first read: mlaunch.trace.store.open_reader).
    return render_from(run_dir, open_reader(run_dir, skip_invalid=skip_invalid), iterations)


@dataclass
class ReportData:
    """Everything the page shows, before it is written as HTML."""

    run_dir: Path
    summary: Summary
    goodput: GoodputReport
    resolved: dict[str, Any]
    timeline: Timeline
    ranges: list[tuple[int, int]]
    curve_figs: dict[str, dict[str, Any]]
    curve_source: str
    notes: list[str]
    marks: list[Mark]
    meta: dict[str, Any]


def render_from(
    run_dir: Path, reader: StoreReader, iterations: tuple[int, int] | None = None
) -> ReportResult:
    """:func:`render_report` of what ``reader`` reads."""
    return render(prepare(run_dir, reader, iterations))


def prepare(
    run_dir: Path, reader: StoreReader, iterations: tuple[int, int] | None = None
) -> ReportData:
    """The report's data, read column-wise from the store (:mod:`.window`)."""
    read_stats = reader.stats
    base_dir = run_directory(run_dir)
    progress, bad_progress = read_progress(base_dir)
    scan = StoreScan(reader.store, curves_need_steps(progress))
    summary = scan.result
    gp = scan.goodput.finish()

    present = scan.iterations()
    # The run model says which iterations each capture and dump covered: under per_step a
    # capture's step spans were exported before it began and carry no capture id, so its mark
    # alone cannot tell; the default window shows every one of them.
    model = RunState.read(base_dir)
    marks = with_run_model(scan.marks(), model)
    include = [m.iterations for m in marks if m.iterations is not None]
    ranges = choose_iterations(present, iterations, include=include + model.window_includes())
    segs = segments(scan, ranges, present)
    window = collect_window(reader.store, segs)
    focus = scan.first_start(ranges[0][0]) if ranges else None
    timeline = build_timeline(window, segs, scan.run_start(), scan.resources, ranges, focus, marks)

    # No worker resource when only the launcher's job trace is there: no step spans to draw from.
    first_res = scan.resources[min(scan.resources)] if scan.resources else {}
    # Without progress.jsonl (a Megatron-LM worker), the workers' metrics fill the curves the
    # step spans leave empty.
    metric_points = read_metric_points(base_dir) if curves_need_steps(progress) else {}
    curve_figs, curve_source = curves(progress, scan, first_res, metric_points)
    notes = _notes(read_stats, bad_progress, timeline, ranges, bool(scan.goodput.ranks))
    notes.extend(f"marked on the timeline: {mark_text(m)}" for m in marks)
    meta = {
        "timeline": {"spans": timeline.spans, "lanes": timeline.lanes, "links": timeline.links,
                     "window": ranges},
        "marks": [{"kind": m.kind, "label": m.label, "ranks": list(m.ranks),
                   "iterations": list(m.iterations) if m.iterations else None} for m in marks],
        "charts": {k: [len(t["x"]) for t in f["data"]] for k, f in curve_figs.items()},
    }  # fmt: skip
    return ReportData(run_dir, summary, gp, read_resolved(base_dir), timeline, ranges,
                      curve_figs, curve_source, notes, marks, meta)  # fmt: skip


def render(d: ReportData) -> ReportResult:
    """The page of prepared data."""
    html = page(
        d.run_dir, d.summary, d.goodput, d.resolved, d.timeline, d.ranges, d.curve_figs,
        d.curve_source, d.notes, _figures(d.timeline, d.curve_figs, d.summary, d.goodput), d.meta,
    )  # fmt: skip
    t = d.timeline
    return ReportResult(html, d.ranges, t.spans, t.lanes, t.links, d.notes, d.marks)


def write_report(
    run_dir: Path,
    out: Path | None = None,
    iterations: tuple[int, int] | None = None,
    *,
    skip_invalid: bool = False,
) -> Path:
    """Write the HTML report of ``run_dir`` to ``out`` (default ``run_dir/report.html``) and
    return its path. ``iterations`` = (A, B), inclusive, picks the timeline window (default: the
    first and last few iterations). Raises ``TraceInputError`` (``.render()`` gives the message
    for the user) for bad input and ``OSError`` when ``out`` cannot be written."""
    out = default_output(run_dir) if out is None else Path(out)
    return render_report(Path(run_dir), iterations, skip_invalid=skip_invalid).write(out)
