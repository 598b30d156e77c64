"""``mlaunch trace report``: one self-contained HTML file that explains a run.

The file holds everything it needs (plotly.js embedded once, the data as inline JSON, a small
script and stylesheet), so it opens from disk with no network. Sections:

* a header: run id, world layout (nodes x processes, TP/PP/DP), model size, span groups, exporting
  ranks, wall time and goodput;
* a zoomable timeline of a window of iterations: one lane per exporting rank (labelled with its
  pipeline stage), spans nested by depth and coloured by group, the attributes on hover, and
  ``megatron.pp.recv_forward.linked`` spans joined to their sender by arrows;
* the span breakdown of ``mlaunch trace summary`` (a sortable table) and the per-rank step skew;
* training curves from ``progress.jsonl`` (from the step spans' attributes when it is missing);
* the goodput split of ``mlaunch trace goodput`` as stacked bars.

Large runs: the summary, skew and goodput stream over every span (the same aggregators as the
``trace`` commands); only the timeline window's spans are held in memory and written out. The
window is ``--iterations A:B`` (inclusive) or, by default, the first and last
:data:`EDGE_ITERATIONS` iterations (with the set-up before the first and the tail after the last),
the omitted middle drawn as a marked gap. A window is a time range shared by all lanes, from the
earliest start to the latest end of its iterations' steps on any rank; every span overlapping it
is drawn once, clipped to it (so a straggler's neighbouring step shows at the edge). That keeps a 1,000-iteration ``per_step`` report to
plotly.js (about 4.8 MB) plus a few hundred KB. Trace files are read twice: once for the
aggregates and the step times that place the window, once for the window's spans.

plotly is used only for its JavaScript bundle: figures are written as plain JSON for
``Plotly.newPlot``, which keeps the Python side free of plotly's (slow) figure validation.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from mlaunch import envcontract
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import ALIASES, STEP_SPAN, Attr, ResourceAttr, span_def
from mlaunch.model.spec import resolve
from mlaunch.model.strategies import format_ranks
from mlaunch.outputs import open_output
from mlaunch.trace.chrome import assign_lanes
from mlaunch.trace.goodput import GoodputAggregator, GoodputReport
from mlaunch.trace.reader import Resource, TraceInputError, TraceReader, attributes, is_error
from mlaunch.trace.summary import Summary, SummaryAggregator, no_spans_error

#: Where ``write_report`` puts the report when no output path is given (inside the run directory).
REPORT_FILE = "report.html"
#: Iterations shown at each end of the run by the default timeline window.
EDGE_ITERATIONS = 3
#: A timeline window with more spans than this is refused (the browser would crawl); the error
#: says to choose a narrower ``--iterations``.
MAX_TIMELINE_SPANS = 150_000
#: The width of a "hidden iterations" gap on the timeline, as a share of the shown time.
_GAP_SHARE = 0.04
_NS_PER_MS = 1e6
_STEP = STEP_SPAN  # megatron.train.iteration (older traces' megatron.train_step, via ALIASES)
_OTHER_GROUP = "other"

#: One colour per span group (categorical, readable on white); spans outside the catalogue
#: (a user script's own names) are dark grey.
GROUP_COLOURS: dict[str, str] = {
    SpanGroup.JOB: "#9e9e9e",
    SpanGroup.CHECKPOINT: "#8c564b",
    SpanGroup.EVALUATE: "#e377c2",
    SpanGroup.MODEL_INIT: "#bcbd22",
    SpanGroup.LOAD_CHECKPOINT: "#c49c94",
    SpanGroup.STEP: "#1f77b4",
    SpanGroup.FORWARD_BACKWARD: "#6baed6",
    SpanGroup.OPTIMIZER: "#ff7f0e",
    SpanGroup.MICROBATCH: "#2ca02c",
    SpanGroup.LAYER: "#98df8a",
    SpanGroup.COMMUNICATION: "#d62728",
    SpanGroup.ACTIVATION_OFFLOAD: "#ffbb78",
    SpanGroup.DATA_LOADING: "#9467bd",
    SpanGroup.FIRST_ITERATION: "#17becf",
    SpanGroup.TRACE_REGION: "#c5b0d5",
    SpanGroup.INFERENCE: "#f7b6d2",
    _OTHER_GROUP: "#525252",
}


# --------------------------------------------------------------------------------------------
# The iteration window


def parse_iterations(text: str) -> tuple[int, int]:
    """``"A:B"`` (inclusive, ``A <= B``) or ``"A"`` (just A) as ``(A, B)``.

    Raises ``ValueError`` with a message fit for the user.
    """
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            a = b = int(parts[0])
        elif len(parts) == 2:
            a, b = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{text!r} is not an iteration range; write A:B with whole numbers, e.g. 10:20"
        ) from None
    if a < 0 or b < 0:
        raise ValueError(f"{text!r}: iterations are not negative")
    if a > b:
        raise ValueError(f"{text!r}: the first iteration is after the last; write {b}:{a}")
    return a, b


def choose_iterations(
    present: Sequence[int], requested: tuple[int, int] | None, edge: int = EDGE_ITERATIONS
) -> list[tuple[int, int]]:
    """The iteration ranges the timeline shows, given the sorted distinct iterations the trace
    holds: ``requested`` clipped to the trace, or the first and last ``edge`` iterations (all of
    them when the run is short). Raises ``TraceInputError`` when ``requested`` misses the trace."""
    if requested is not None:
        a, b = requested
        inside = [i for i in present if a <= i <= b]
        if not inside:
            held = f"iterations {present[0]}-{present[-1]}" if present else "no train steps"
            raise TraceInputError(
                f"--iterations {a}:{b}: no megatron.train.iteration in that range (the trace holds "
                f"{held})",
                fix="choose a range inside the trace's iterations",
            )
        return [(inside[0], inside[-1])]
    if not present:
        return []
    if len(present) <= 2 * edge + 1:
        return [(present[0], present[-1])]
    return [(present[0], present[edge - 1]), (present[-edge], present[-1])]


# --------------------------------------------------------------------------------------------
# Reading


class _Step(NamedTuple):
    iteration: int
    start: int
    end: int
    loss: float | None
    grad_norm: float | None


class _Scan:
    """Pass 1: the summary and goodput aggregates, plus every rank's step times (to place the
    window; tens of bytes a step) and the attributes used when ``progress.jsonl`` is missing."""

    def __init__(self) -> None:
        self.summary = SummaryAggregator()
        self.goodput = GoodputAggregator()
        self.steps: dict[int, list[_Step]] = {}

    def add(self, res: Resource, spans: list[dict[str, Any]], flagged: bool) -> None:
        """Fold one batch in."""
        self.summary.add(res, spans, flagged)
        self.goodput.add(res, spans, flagged)
        if res.launcher:  # the launcher's job trace: in the aggregates, no lane of its own
            return
        steps = self.steps.setdefault(res.rank, [])
        canon = ALIASES
        for s in spans:
            name = s["name"]
            if canon.get(name, name) != _STEP:
                continue
            a = attributes(s.get("attributes"))
            it = a.get(Attr.ITERATION)
            if it is None:
                continue
            try:  # an iteration that is no number is no step of the timeline's window
                it = int(it)
            except (TypeError, ValueError):
                continue
            steps.append(
                _Step(it, s["startTimeUnixNano"], s["endTimeUnixNano"],
                      _float(a.get(Attr.LOSS)), _float(a.get(Attr.GRAD_NORM)))
            )  # fmt: skip

    def extent(self, rank: int) -> tuple[int, int]:
        """Earliest start and latest end of any span of ``rank``."""
        st = self.goodput.ranks[rank]
        return st.lo, st.hi


class _WSpan(NamedTuple):
    """A span of the timeline window (field names as :func:`assign_lanes` expects)."""

    start: int
    end: int
    name: str
    key: tuple[str, str]  # (traceId, spanId)
    parent: str
    attrs: dict[str, Any]
    links: list[tuple[str, str]]
    error: bool


def _float(v: Any) -> float | None:
    """An attribute as a float, ``None`` when missing or not a number."""
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def _segments(
    scan: _Scan, ranges: list[tuple[int, int]], present: Sequence[int]
) -> list[tuple[int, int]]:
    """The time ranges (ns) of the window: for each iteration range, the earliest start to the
    latest end of its steps on any rank, stretched to the run's start (end) when the range holds
    the first (last) iteration, so set-up and tail are shown. No steps: the whole trace."""
    ranks = list(scan.goodput.ranks)
    run_lo = min(scan.extent(r)[0] for r in ranks)
    run_hi = max(scan.extent(r)[1] for r in ranks)
    if not ranges:
        return [(run_lo, run_hi)]
    segs: list[tuple[int, int]] = []
    for a, b in ranges:
        chosen = [s for st in scan.steps.values() for s in st if a <= s.iteration <= b]
        lo = run_lo if a == present[0] else min(s.start for s in chosen)
        hi = run_hi if b == present[-1] else max(s.end for s in chosen)
        segs.append((lo, hi))
    segs.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in segs:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def in_window(start: int, end: int, segs: Sequence[tuple[int, int]]) -> bool:
    """Whether a span [start, end] is drawn: it overlaps a segment (a zero-length span: lies in
    one)."""
    if start == end:
        return any(lo <= start <= hi for lo, hi in segs)
    return any(start < hi and end > lo for lo, hi in segs)


def _collect_window(reader: TraceReader, segs: list[tuple[int, int]]) -> dict[int, list[_WSpan]]:
    """Pass 2: the spans overlapping any segment, per rank, attributes decoded."""
    out: dict[int, list[_WSpan]] = {}
    kept = 0
    for res, spans, _ in reader:
        if res.launcher:
            continue
        keep = out.setdefault(res.rank, [])
        for s in spans:
            start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
            if not in_window(start, end, segs):
                continue
            links = [(lk.get("traceId", ""), lk.get("spanId", "")) for lk in s.get("links") or ()]
            keep.append(
                _WSpan(start, end, s["name"], (s.get("traceId", ""), s.get("spanId", "")),
                       s.get("parentSpanId") or "", attributes(s.get("attributes")), links,
                       is_error(s))
            )  # fmt: skip
            kept += 1
            if kept > MAX_TIMELINE_SPANS:
                raise TraceInputError(
                    f"the timeline window holds more than {MAX_TIMELINE_SPANS:,} spans",
                    fix="choose fewer iterations with --iterations A:B",
                )
    return out


def read_progress(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of ``progress.jsonl`` (the last one per iteration and kind, so a resumed run's
    repeats count once) and the number of unreadable lines skipped (a crash can cut the last)."""
    path = run_dir / envcontract.PROGRESS_FILE
    if not path.is_file():
        return [], 0
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                it = int(rec["iteration"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            (evals if "eval_loss" in rec else train)[it] = rec
    return [train[i] for i in sorted(train)] + [evals[i] for i in sorted(evals)], bad


def _read_resolved(run_dir: Path) -> dict[str, Any]:
    """``resolved.json`` as ``mlaunch train`` wrote it, or {} (plain torchrun runs have none)."""
    try:
        data = json.loads((run_dir / envcontract.RESOLVED_JSON_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --------------------------------------------------------------------------------------------
# Formatting


def fmt_ms(v: float) -> str:
    """Milliseconds as three significant digits in µs / ms / s / min."""
    a = abs(v)
    if a == 0:
        return "0"
    if a < 1:
        return f"{v * 1e3:.3g}µs"
    if a < 1e3:
        return f"{v:.3g}ms"
    if a < 6e4:
        return f"{v / 1e3:.3g}s"
    return f"{v / 6e4:.3g}min"


def group_of(name: str) -> str:
    """The span group a span name belongs to (``other`` outside the catalogue)."""
    try:
        return str(span_def(name).group)
    except KeyError:
        return _OTHER_GROUP


def _group_order(group: str) -> int:
    order = list(GROUP_COLOURS)
    return order.index(group) if group in order else len(order)


def _hover_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    return html.escape(text if len(text) <= 80 else text[:77] + "...")


# --------------------------------------------------------------------------------------------
# Figures (plain plotly.js JSON)


@dataclass
class _Timeline:
    figure: dict[str, Any]
    spans: int
    lanes: int
    links: int
    unresolved_links: int


def _build_timeline(
    window: dict[int, list[_WSpan]],
    segs: list[tuple[int, int]],
    t0: int,
    resources_by_rank: dict[int, dict[str, Any]],
    ranges: list[tuple[int, int]],
    focus: int | None = None,
) -> _Timeline:
    """One lane per rank (rows = nesting depth, plus extra rows for spans that overlap without
    nesting), one bar trace per group, one arrow trace for the links, the omitted middle of the
    run collapsed into a marked gap. ``focus``: where the view opens when set-up is long."""
    shown = sum(hi - lo for lo, hi in segs)
    gap = int(shown * _GAP_SHARE) if len(segs) > 1 else 0
    offsets: list[int] = []
    acc = 0
    for lo, hi in segs:
        offsets.append(acc)
        acc += (hi - lo) + gap

    def x_start(t: int) -> float:
        # a start in a gap (or before the window) snaps to the next segment's start
        for (lo, hi), off in zip(segs, offsets, strict=True):
            if t < hi:
                return (off + max(0, t - lo)) / _NS_PER_MS
        lo, hi = segs[-1]
        return (offsets[-1] + hi - lo) / _NS_PER_MS

    def x_end(t: int) -> float:
        # an end in a gap (or after the window) snaps to the previous segment's end
        for (lo, hi), off in zip(reversed(segs), reversed(offsets), strict=True):
            if t > lo:
                return (off + min(t, hi) - lo) / _NS_PER_MS
        return offsets[0] / _NS_PER_MS

    traces: dict[str, dict[str, Any]] = {}
    tickvals: list[float] = []
    ticktext: list[str] = []
    shapes: list[dict[str, Any]] = []
    placed: dict[tuple[str, str], tuple[float, float, float]] = {}  # key -> (x0, x1, y)
    base_row = 0
    n_spans = 0
    ranks = sorted(r for r, sp in window.items() if sp)
    for lane_no, rank in enumerate(ranks):
        spans = window[rank]
        sub = assign_lanes(spans)  # type: ignore[arg-type]  # duck-typed: start/end/parent/key
        order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end, i))
        stacks: dict[int, list[int]] = {}
        depth = [0] * len(spans)
        for i in order:
            st = stacks.setdefault(sub[i], [])
            while st and st[-1] <= spans[i].start:
                st.pop()
            depth[i] = len(st)
            st.append(spans[i].end)
        sub_rows: dict[int, int] = {}
        for i in range(len(spans)):
            sub_rows[sub[i]] = max(sub_rows.get(sub[i], 0), depth[i] + 1)
        sub_base: dict[int, int] = {}
        lane_rows = 0
        for k in sorted(sub_rows):
            sub_base[k] = lane_rows
            lane_rows += sub_rows[k]
        res = resources_by_rank.get(rank, {})
        stage = res.get(ResourceAttr.PP_RANK)
        host = res.get(ResourceAttr.HOST_NAME)
        tickvals.append(base_row + (lane_rows - 1) / 2)
        ticktext.append(f"rank {rank}" + (f" · PP {stage}" if stage is not None else ""))
        if lane_no % 2 == 1:  # zebra lanes, the first one plain
            shapes.append({
                "type": "rect", "xref": "paper", "x0": 0, "x1": 1, "yref": "y",
                "y0": base_row - 0.5, "y1": base_row + lane_rows - 0.5, "layer": "below",
                "fillcolor": "rgba(0,0,0,0.04)", "line": {"width": 0},
            })  # fmt: skip
        where = f"rank {rank}" + (f" ({html.escape(str(host))})" if host else "")
        for i, sp in enumerate(spans):
            group = group_of(sp.name)
            tr = traces.get(group)
            if tr is None:
                tr = traces[group] = {
                    "type": "bar", "orientation": "h", "name": group, "base": [], "x": [],
                    "y": [], "hovertext": [], "customdata": [], "hoverinfo": "text",
                    "width": 0.82, "marker": {"color": GROUP_COLOURS.get(group, "#525252"),
                                              "line": {"width": 0}},
                }  # fmt: skip
            x0, x1 = x_start(sp.start), x_end(sp.end)
            y = base_row + sub_base[sub[i]] + depth[i]
            dur = (sp.end - sp.start) / _NS_PER_MS
            lines = [
                f"<b>{html.escape(sp.name)}</b>",
                f"{where} · {group}",
                f"start +{fmt_ms((sp.start - t0) / _NS_PER_MS)} · duration {fmt_ms(dur)}",
            ]
            if sp.error:
                lines.append("<b>status ERROR</b>")
            lines += [f"{html.escape(k)} = {_hover_value(v)}" for k, v in sp.attrs.items()]
            tr["base"].append(round(x0, 6))
            tr["x"].append(round(max(x1 - x0, 0.0), 6))
            tr["y"].append(y)
            tr["hovertext"].append("<br>".join(lines))
            tr["customdata"].append(sp.key[1])
            placed[sp.key] = (x0, x1, y)
            n_spans += 1
        base_row += lane_rows + 1  # one blank row between lanes

    # Links: an arrow from the end of the sender's span to the start of the linking span.
    lx: list[float | None] = []
    ly: list[float | None] = []
    sizes: list[int] = []
    links = unresolved = 0
    for rank in ranks:
        for sp in window[rank]:
            for target in sp.links:
                src = placed.get(target)
                if src is None:
                    unresolved += 1  # the sender's rank did not export, or is outside the window
                    continue
                dst = placed[sp.key]
                lx += [src[1], dst[0], None]
                ly += [src[2], dst[2], None]
                sizes += [0, 9, 0]
                links += 1
    data = [traces[g] for g in sorted(traces, key=_group_order)]
    if links:
        data.append({
            "type": "scatter", "mode": "lines+markers", "name": "links (send → linked recv)",
            "x": lx, "y": ly, "hoverinfo": "skip", "connectgaps": False,
            "line": {"color": "rgba(40,40,40,0.7)", "width": 1},
            "marker": {"symbol": "arrow", "angleref": "previous", "size": sizes,
                       "color": "rgba(40,40,40,0.9)"},
        })  # fmt: skip

    annotations: list[dict[str, Any]] = []
    if gap:
        for k in range(len(segs) - 1):
            gx0 = (offsets[k] + segs[k][1] - segs[k][0]) / _NS_PER_MS
            gx1 = offsets[k + 1] / _NS_PER_MS
            shapes.append({
                "type": "rect", "xref": "x", "yref": "paper", "x0": gx0, "x1": gx1, "y0": 0,
                "y1": 1, "fillcolor": "rgba(120,120,120,0.18)", "line": {"width": 0},
                "layer": "below",
            })  # fmt: skip
            hidden = fmt_ms((segs[k + 1][0] - segs[k][1]) / _NS_PER_MS)
            text = f"{hidden} hidden"
            if k + 1 < len(ranges) and ranges[k + 1][0] - ranges[k][1] > 1:
                text = f"iterations {ranges[k][1] + 1}-{ranges[k + 1][0] - 1} hidden ({hidden})"
            annotations.append({
                "x": (gx0 + gx1) / 2, "y": 1, "xref": "x", "yref": "paper", "yanchor": "top",
                "showarrow": False, "font": {"size": 11, "color": "#333"}, "text": text,
                "bgcolor": "rgba(255,255,255,0.85)",
            })  # fmt: skip
    rows = max(base_row - 1, 1)
    x_axis: dict[str, Any] = {
        "title": {"text": "ms since the window's start (grey bands: hidden iterations)"},
        "zeroline": False, "showgrid": True,
    }  # fmt: skip
    total_x = (offsets[-1] + segs[-1][1] - segs[-1][0]) / _NS_PER_MS
    if focus is not None and total_x > 0 and x_start(focus) > 0.3 * total_x:
        # Set-up (model init, data) often outlasts the shown steps many times over: open on the
        # steps; plotly's double-click first returns here, the second shows everything.
        lo = x_start(focus)
        x_axis["range"] = [lo - 0.01 * (total_x - lo), total_x]
    layout = {
        "height": int(min(max(260, rows * 18 + 140), 3000)),
        "barmode": "overlay", "hovermode": "closest", "dragmode": "zoom",
        "margin": {"l": 110, "r": 20, "t": 60, "b": 50},
        "xaxis": x_axis,
        "yaxis": {"autorange": "reversed", "tickmode": "array", "tickvals": tickvals,
                  "ticktext": ticktext, "showgrid": False, "zeroline": False},
        "legend": {"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom"},
        "hoverlabel": {"align": "left"}, "shapes": shapes, "annotations": annotations,
    }  # fmt: skip
    return _Timeline({"data": data, "layout": layout}, n_spans, len(ranks), links, unresolved)


def _line_chart(
    title: str, ytitle: str, series: list[tuple[str, list[int], list[float], str]]
) -> dict[str, Any]:
    """A small chart over iterations; ``series`` = (name, iterations, values, mode)."""
    data = [
        {"type": "scatter", "mode": mode, "name": name, "x": xs, "y": ys,
         "marker": {"size": 4}, "line": {"width": 1.5}}
        for name, xs, ys, mode in series
    ]  # fmt: skip
    return {
        "data": data,
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 14}}, "height": 280,
            "margin": {"l": 60, "r": 15, "t": 40, "b": 40}, "hovermode": "x unified",
            "xaxis": {"title": {"text": "iteration"}}, "yaxis": {"title": {"text": ytitle}},
            "showlegend": len(series) > 1, "legend": {"x": 1, "xanchor": "right", "y": 1},
        },
    }  # fmt: skip


def _curves(
    progress: list[dict[str, Any]], scan: _Scan, res: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], str]:
    """The training-curve figures (div id -> figure) and where their data came from."""
    train = [r for r in progress if "eval_loss" not in r]
    evals = [r for r in progress if "eval_loss" in r]
    source = envcontract.PROGRESS_FILE
    if not train:
        # No progress file (plain torchrun without the run directory, or another script): the
        # step spans carry iteration, loss and grad norm; take the rank that owns the loss (the
        # last pipeline stage), step time from the span, tokens/s from the resource's batch.
        owner = max(
            scan.steps, key=lambda r: (sum(s.loss is not None for s in scan.steps[r]), r),
            default=None,
        )  # fmt: skip
        if owner is None or not scan.steps[owner]:
            return {}, "nowhere: no progress.jsonl and no megatron.train.iteration spans"
        tokens = int(res.get(ResourceAttr.BATCH_SIZE) or 0) * int(
            res.get(ResourceAttr.SEQUENCE_LENGTH) or 0
        )
        by_it = {s.iteration: s for s in scan.steps[owner]}
        for it in sorted(by_it):
            s = by_it[it]
            ms = (s.end - s.start) / _NS_PER_MS
            rec: dict[str, Any] = {"iteration": it, "loss": s.loss, "grad_norm": s.grad_norm,
                                   "step_ms": ms}  # fmt: skip
            if tokens and ms > 0:
                rec["tokens_per_sec"] = tokens / (ms / 1e3)
            train.append(rec)
        source = f"megatron.train.iteration span attributes of rank {owner} (no progress.jsonl)"

    def col(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
        pts = [(int(r["iteration"]), float(r[key])) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    loss_series = [("train", *col(train, "loss"), "lines+markers")]
    if evals:
        loss_series.append(("eval", *col(evals, "eval_loss"), "lines+markers"))
    spec = [
        ("chart-loss", "loss", "cross entropy", loss_series),
        ("chart-lr", "learning rate", "lr", [("lr", *col(train, "lr"), "lines+markers")]),
        ("chart-grad-norm", "grad norm", "norm",
         [("grad norm", *col(train, "grad_norm"), "lines+markers")]),
        ("chart-tokens", "throughput", "tokens/s",
         [("tokens/s", *col(train, "tokens_per_sec"), "lines+markers")]),
        ("chart-step-time", "step time", "ms",
         [("step time", *col(train, "step_ms"), "lines+markers")]),
    ]  # fmt: skip
    figs: dict[str, dict[str, Any]] = {}
    for div, title, ytitle, series in spec:
        series = [s for s in series if s[1]]
        if series:
            figs[div] = _line_chart(title, ytitle, series)
    return figs, source


def _skew_figure(summary: Summary) -> dict[str, Any] | None:
    if summary.skew is None:
        return None
    labels = [f"rank {r.rank}" for r in summary.ranks]
    colours = ["#d62728" if r.straggler else "#1f77b4" for r in summary.ranks]
    ref = summary.skew.reference_median_ms
    return {
        "data": [
            {"type": "bar", "name": "median step", "x": labels,
             "y": [r.median_ms for r in summary.ranks], "marker": {"color": colours},
             "customdata": [[r.p95_ms, r.ratio, r.steps] for r in summary.ranks],
             "hovertemplate": "%{x}<br>median %{y:.3f} ms<br>p95 %{customdata[0]:.3f} ms<br>"
                              "%{customdata[1]:.3f}x the median of medians<br>"
                              "%{customdata[2]} steps<extra></extra>"},
        ],
        "layout": {
            "title": {"text": "median megatron.train.iteration per rank (red: straggler; dashed: "
                              "median of medians)", "x": 0, "font": {"size": 14}},
            "height": 280, "margin": {"l": 60, "r": 15, "t": 40, "b": 40},
            "yaxis": {"title": {"text": "ms"}}, "showlegend": False,
            "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": ref, "y1": ref,
                        "line": {"dash": "dash", "color": "#555", "width": 1}}],
        },
    }  # fmt: skip


#: Goodput categories: (label, Breakdown attribute, colour).
GOODPUT_PARTS = (
    ("productive", "productive_ms", "#2ca02c"),
    ("restart", "restart_ms", "#ff7f0e"),
    ("checkpoint", "checkpoint_ms", "#8c564b"),
    ("evaluation", "evaluation_ms", "#e377c2"),
    ("unaccounted", "unaccounted_ms", "#bdbdbd"),
)


def _goodput_figure(gp: GoodputReport) -> dict[str, Any]:
    rows = [("all ranks", gp.overall)] + [(f"rank {r.rank}", r.breakdown) for r in gp.ranks]
    data = []
    for label, attr, colour in GOODPUT_PARTS:
        ms = [getattr(b, attr) for _, b in rows]
        pct = [
            100 * v / b.wall_ms if b.wall_ms else 0.0 for v, (_, b) in zip(ms, rows, strict=True)
        ]
        data.append({
            "type": "bar", "orientation": "h", "name": label, "y": [r[0] for r in rows], "x": pct,
            "marker": {"color": colour}, "customdata": [fmt_ms(v) for v in ms],
            "hovertemplate": f"%{{y}}: {label} %{{x:.1f}}% (%{{customdata}})<extra></extra>",
        })  # fmt: skip
    return {
        "data": data,
        "layout": {
            "barmode": "stack", "height": int(120 + 28 * len(rows)),
            "margin": {"l": 90, "r": 15, "t": 30, "b": 40},
            "xaxis": {"title": {"text": "% of wall time"}, "range": [0, 100]},
            "yaxis": {"autorange": "reversed"},
            "legend": {"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom"},
        },
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# The report


@dataclass
class ReportResult:
    """A rendered report and what it shows."""

    html: str
    window: list[tuple[int, int]]  # the iteration ranges of the timeline ([] = whole trace)
    timeline_spans: int
    lanes: int
    links: int
    notes: list[str] = field(default_factory=list)

    def write(self, out: Path) -> Path:
        """Write atomically (never a half-written report that looks complete); return ``out``."""
        out = Path(out)
        with open_output(out) as f:  # the rule of mlaunch.outputs (checked by the caller)
            f.write(self.html)
        return out


def run_directory(path: Path) -> Path:
    """The run directory behind ``path``: itself, or the one holding a traces file or the
    ``telemetry/`` directory given instead (where progress.jsonl and resolved.json live)."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    return d.parent if d.name == envcontract.TELEMETRY_DIR else d


def default_output(path: Path) -> Path:
    """``RUN_DIR/report.html`` for a run directory, or a file or telemetry directory in it."""
    return run_directory(path) / REPORT_FILE


def render_report(
    run_dir: Path, iterations: tuple[int, int] | None = None, *, skip_invalid: bool = False
) -> ReportResult:
    """Read a run directory (or a traces file) and render the report's HTML.

    Raises ``TraceInputError`` for unreadable input, a trace without spans, or an ``iterations``
    window outside the trace.
    """
    run_dir = Path(run_dir)
    reader = TraceReader.open(run_dir, skip_invalid=skip_invalid)
    scan = _Scan()
    for res, spans, flagged in reader:
        try:
            scan.add(res, spans, flagged)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise reader.error_here(f"malformed span ({type(e).__name__}: {e})") from None
    if not scan.summary.durations:
        raise no_spans_error(reader)
    read_stats = reader.stats
    summary = scan.summary.finish(read_stats)
    gp = scan.goodput.finish()

    present = sorted({s.iteration for st in scan.steps.values() for s in st})
    ranges = choose_iterations(present, iterations)
    segs = _segments(scan, ranges, present)
    window = _collect_window(reader.reread(), segs)
    t0 = min(scan.extent(r)[0] for r in scan.goodput.ranks)
    focus = None
    if ranges:
        a = ranges[0][0]
        focus = min(s.start for st in scan.steps.values() for s in st if s.iteration == a)
    timeline = _build_timeline(window, segs, t0, scan.summary.resources, ranges, focus)

    base_dir = run_directory(run_dir)
    progress, bad_progress = read_progress(base_dir)
    first_res = scan.summary.resources[min(scan.summary.resources)]
    curves, curve_source = _curves(progress, scan, first_res)
    resolved = _read_resolved(base_dir)

    notes: list[str] = []
    if read_stats.skipped_lines:
        notes.append(f"{len(read_stats.skipped_lines)} unreadable trace line(s) skipped")
    if read_stats.torn_lines:
        notes.append(f"{len(read_stats.torn_lines)} torn last line(s) skipped (a crashed or "
                     "still-running writer)")  # fmt: skip
    if read_stats.skipped_spans:
        notes.append(f"{len(read_stats.skipped_spans)} malformed span(s) skipped")
    if bad_progress:
        notes.append(f"{bad_progress} unreadable line(s) of {envcontract.PROGRESS_FILE} skipped")
    if timeline.unresolved_links:
        notes.append(f"{timeline.unresolved_links} link(s) point at spans not in the window "
                     "(the sender did not export, or sent outside the window)")  # fmt: skip
    if not ranges:
        notes.append("no megatron.train.iteration spans with an iteration (the step group is off): "
                     "the timeline shows the whole trace")  # fmt: skip

    figures: dict[str, dict[str, Any]] = {"timeline": timeline.figure}
    figures.update(curves)
    skew_fig = _skew_figure(summary)
    if skew_fig is not None:
        figures["chart-skew"] = skew_fig
    figures["chart-goodput"] = _goodput_figure(gp)
    meta = {
        "timeline": {"spans": timeline.spans, "lanes": timeline.lanes, "links": timeline.links,
                     "window": ranges},
        "charts": {k: [len(t["x"]) for t in f["data"]] for k, f in curves.items()},
    }  # fmt: skip
    page = _page(
        run_dir, summary, gp, resolved, timeline, ranges, curves, curve_source, notes, figures,
        meta,
    )  # fmt: skip
    return ReportResult(page, ranges, timeline.spans, timeline.lanes, timeline.links, notes)


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


# --------------------------------------------------------------------------------------------
# HTML


def _asset(name: str) -> str:
    return resources.files("mlaunch.trace").joinpath("report_assets", name).read_text("utf-8")


def _plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as e:
        raise TraceInputError(
            "the report needs plotly (its JavaScript is embedded in the file)",
            fix="pip install plotly (the range in pyproject.toml)",
        ) from e
    return get_plotlyjs()


def _json_script(element_id: str, value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, default=str)
    # "</" would end the <script> element early; "<\/" is the same JSON string.
    text = text.replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def _table(
    headers: Sequence[str], rows: Iterable[Sequence[tuple[str, Any]]], *, table_id: str
) -> str:
    """A sortable HTML table; each cell is (text, sort key)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(
            f'<td data-v="{html.escape(str(key))}">{html.escape(text)}</td>' for text, key in row
        )
        body.append(f"<tr>{cells}</tr>")
    return (f'<table id="{table_id}" class="sortable"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")  # fmt: skip


def _header(
    run_dir: Path, summary: Summary, gp: GoodputReport, resolved: dict[str, Any]
) -> list[tuple[str, str]]:
    """The run's identity as (label, value) rows."""
    res = summary.run
    settings = resolved.get("settings") or {}

    def setting(path: str) -> Any:
        v = settings.get(path)
        return v.get("value") if isinstance(v, dict) else None

    world = res.get(ResourceAttr.WORLD_SIZE) or resolved.get("world_size")
    nodes = setting("launch.nnodes") or (len(summary.hosts) or None)
    tp, pp, dp = (res.get(a) for a in (ResourceAttr.TP_SIZE, ResourceAttr.PP_SIZE,
                                       ResourceAttr.DP_SIZE))  # fmt: skip
    layout = "-"
    if world:
        w, n = int(world), int(nodes or 0)
        per_node = str(w // n) if n and w % n == 0 else "?"
        layout = f"{n or '?'} node(s) x {per_node} process(es) = {w} ranks"
    layout += f"; TP={tp or '?'} PP={pp or '?'} DP={dp or '?'}"

    layers = res.get(ResourceAttr.NUM_LAYERS)
    hidden = res.get(ResourceAttr.HIDDEN_SIZE)
    heads = res.get(ResourceAttr.NUM_ATTENTION_HEADS)
    model = "-"
    if layers and hidden:
        # 12·L·h² is the weight count of L standard blocks (attention 4h², MLP 8h²); embeddings
        # depend on the vocabulary, which the trace does not carry.
        blocks = 12 * int(layers) * int(hidden) ** 2
        model = (f"{layers} layers, hidden {hidden}, {heads or '?'} heads "
                 f"(≈{blocks / 1e6:.3g}M parameters in the blocks)")  # fmt: skip
        extra = [f"{k}={res[k]}" for k in (ResourceAttr.SEQUENCE_LENGTH, ResourceAttr.BATCH_SIZE,
                                            ResourceAttr.PRECISION) if k in res]  # fmt: skip
        if extra:
            model += "; " + ", ".join(extra)

    seen = sorted({group_of(s.name) for s in summary.spans}, key=_group_order)
    groups = ", ".join(seen)
    spec = setting("telemetry.span_groups")
    if spec:
        try:
            configured = ", ".join(sorted(str(g) for g in resolve(str(spec))))
        except ValueError:
            configured = "?"
        groups = f"{spec} = {configured} (seen in the trace: {', '.join(seen)})"
    exporting = format_ranks(summary.rank_ids) or "-"
    if resolved.get("exporting_ranks") is not None:
        exporting += f" (planned: {format_ranks(resolved['exporting_ranks'])})"
    o = gp.overall
    good = (f"{100 * o.goodput:.1f}% (productive {fmt_ms(o.productive_ms)} of "
            f"{fmt_ms(o.wall_ms)} rank-time)")  # fmt: skip
    run_id = res.get(ResourceAttr.RUN_ID) or resolved.get("run_id") or run_dir.name
    hosts = ", ".join(summary.hosts[:8]) + (" …" if len(summary.hosts) > 8 else "")
    return [
        ("run id", str(run_id)),
        ("world", layout),
        ("hosts", hosts or "-"),
        ("model", model),
        ("span groups", groups),
        ("exporting ranks", exporting),
        ("wall time", fmt_ms(gp.job_wall_ms)),
        ("goodput", good),
    ]


def _page(
    run_dir: Path, summary: Summary, gp: GoodputReport, resolved: dict[str, Any],
    timeline: _Timeline, ranges: list[tuple[int, int]], curves: dict[str, Any],
    curve_source: str, notes: list[str], figures: dict[str, Any], meta: dict[str, Any],
) -> str:  # fmt: skip
    head = _header(run_dir, summary, gp, resolved)
    run_id = head[0][1]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in head)

    window = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges) or "all"
    span_rows = [
        [(s.name, s.name), (group_of(s.name), group_of(s.name)), (f"{s.count:,}", s.count),
         (fmt_ms(s.total_ms), s.total_ms), (fmt_ms(s.mean_ms), s.mean_ms),
         (fmt_ms(s.p50_ms), s.p50_ms), (fmt_ms(s.p95_ms), s.p95_ms), (fmt_ms(s.max_ms), s.max_ms),
         ("-" if s.share is None else f"{100 * s.share:.1f}%", -1 if s.share is None else s.share),
         (str(s.errors or ""), s.errors), (str(s.truncated or ""), s.truncated)]
        for s in summary.spans
    ]  # fmt: skip
    spans_table = _table(
        ["name", "group", "count", "total", "mean", "p50", "p95", "max", "share of step", "errors",
         "truncated"], span_rows, table_id="span-table",
    )  # fmt: skip
    skew_html = "<p>No megatron.train.iteration spans: no per-rank skew.</p>"
    if summary.skew is not None:
        k = summary.skew
        skew_rows = [
            [(str(r.rank), r.rank), (r.host or "-", r.host or ""), (str(r.steps), r.steps),
             (fmt_ms(r.median_ms), r.median_ms), (fmt_ms(r.p95_ms), r.p95_ms),
             (f"{r.ratio:.3f}x", r.ratio), ("straggler" if r.straggler else "", int(r.straggler))]
            for r in summary.ranks
        ]  # fmt: skip
        verdict = (f"stragglers: {', '.join(map(str, k.stragglers))}" if k.stragglers
                   else f"no straggler above {100 * k.threshold:.0f}%")  # fmt: skip
        skew_html = (
            '<div class="chart" id="chart-skew"></div>'
            + _table(["rank", "host", "steps", "median", "p95", "vs median of medians", ""],
                     skew_rows, table_id="skew-table")
            + f"<p>slowest rank {k.slowest_rank}: median step {fmt_ms(k.slowest_median_ms)}, "
            f"{k.slowest_ratio:.3f}x the median of rank medians ({fmt_ms(k.reference_median_ms)});"
            f" {html.escape(verdict)}.</p>"
        )  # fmt: skip
    charts = "".join(f'<div class="chart" id="{d}"></div>' for d in curves)
    if not charts:
        charts = f"<p>No training curves: {html.escape(curve_source)}.</p>"
    o = gp.overall
    split = ", ".join(f"{k} {fmt_ms(v)}" for k, v in o.restart_split_ms.items())
    gp_rows = [
        [(label, i), (f"{100 * b.goodput:.1f}%", b.goodput), (fmt_ms(b.wall_ms), b.wall_ms),
         *[(fmt_ms(getattr(b, a)), getattr(b, a)) for _, a, _ in GOODPUT_PARTS]]
        for i, (label, b) in enumerate(
            [("all ranks", o)] + [(f"rank {r.rank}", r.breakdown) for r in gp.ranks]
        )
    ]  # fmt: skip
    gp_table = _table(["", "goodput", "wall", *[p[0] for p in GOODPUT_PARTS]], gp_rows,
                      table_id="goodput-table")  # fmt: skip
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    notes_section = (
        f'<section id="sec-notes"><h2>Notes</h2><ul>{notes_html}</ul></section>' if notes else ""
    )
    links_note = f", {timeline.links} link arrow(s)" if timeline.links else ""
    total_spans = summary.read.get("spans", sum(s.count for s in summary.spans))

    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="mlaunch trace report">
<title>mlaunch report · {html.escape(run_id)}</title>
<style>{_asset("report.css")}</style>
<script>{_asset("errors.js")}</script>
<script>{_plotly_js()}</script>
</head><body>
<header><h1>Run <code>{html.escape(run_id)}</code></h1><dl class="facts">{dl}</dl>
<nav><a href="#sec-timeline">timeline</a> · <a href="#sec-spans">span breakdown</a> ·
<a href="#sec-skew">step skew</a> · <a href="#sec-curves">training curves</a> ·
<a href="#sec-goodput">goodput</a></nav></header>
<main>
<section id="sec-timeline"><h2>Timeline</h2>
<p class="hint">Iterations {html.escape(window)}; {timeline.spans:,} spans on {timeline.lanes}
lane(s){links_note}. Drag to zoom, double-click to reset, click a group in the legend to hide
it; hover a span for its attributes. Rows inside a lane are nesting depth; the view opens on
the steps when set-up is long (double-click twice to see it all). Other windows:
<code>mlaunch trace report RUN_DIR --iterations A:B</code>.</p>
<div id="timeline"></div></section>
<section id="sec-spans"><h2>Span breakdown</h2>
<p class="hint">All {total_spans:,} spans of all ranks; click a column to sort. share = total
time / total megatron.train.iteration time.</p>{spans_table}</section>
<section id="sec-skew"><h2>Step time per rank</h2>{skew_html}</section>
<section id="sec-curves"><h2>Training curves</h2>
<p class="hint">From {html.escape(curve_source)}.</p><div class="grid">{charts}</div></section>
<section id="sec-goodput"><h2>Goodput</h2>
<div class="chart" id="chart-goodput"></div>{gp_table}
<p class="hint">restart cost: {html.escape(split)}. Definitions: <code>mlaunch trace goodput
--help</code>.</p></section>
{notes_section}
</main>
<footer>mlaunch trace report · {html.escape(str(run_dir))}</footer>
<pre id="selftest" hidden></pre>
{_json_script("report-figures", figures)}
{_json_script("report-meta", meta)}
<script>{_asset("report.js")}</script>
</body></html>
"""
