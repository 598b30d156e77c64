"""The report's timeline figure (plain plotly.js JSON): one lane per exporting rank, spans nested
by depth and coloured by group, link arrows, and the omitted middle of the run as a marked gap."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlaunch.model.spans import ResourceAttr
from mlaunch.trace.chrome import assign_lanes
from mlaunch.trace.links import LinkTargets
from mlaunch.trace.report.style import (
    GROUP_COLOURS,
    NS_PER_MS,
    OTHER_COLOUR,
    fmt_ms,
    group_of,
    group_order,
    hover_value,
)
from mlaunch.trace.report.window import Mark, WSpan

#: The width of a "hidden iterations" gap on the timeline, as a share of the shown time.
_GAP_SHARE = 0.04


@dataclass
class Timeline:
    """The timeline figure and what it draws."""

    figure: dict[str, Any]
    spans: int
    lanes: int
    links: int
    unresolved_links: int


class _XAxis:
    """Trace times (ns) onto the x axis (ms): the window's segments laid end to end, a gap of
    :data:`_GAP_SHARE` of the shown time between two."""

    def __init__(self, segs: list[tuple[int, int]]) -> None:
        self.segs = segs
        shown = sum(hi - lo for lo, hi in segs)
        self.gap = int(shown * _GAP_SHARE) if len(segs) > 1 else 0
        self.offsets: list[int] = []
        acc = 0
        for lo, hi in segs:
            self.offsets.append(acc)
            acc += (hi - lo) + self.gap

    def start(self, t: int) -> float:
        """Where a span starting at ``t`` is drawn: a start in a gap (or before the window)
        snaps to the next segment's start."""
        for (lo, hi), off in zip(self.segs, self.offsets, strict=True):
            if t < hi:
                return (off + max(0, t - lo)) / NS_PER_MS
        lo, hi = self.segs[-1]
        return (self.offsets[-1] + hi - lo) / NS_PER_MS

    def end(self, t: int) -> float:
        """Where a span ending at ``t`` is drawn: an end in a gap (or after the window) snaps
        to the previous segment's end."""
        for (lo, hi), off in zip(reversed(self.segs), reversed(self.offsets), strict=True):
            if t > lo:
                return (off + min(t, hi) - lo) / NS_PER_MS
        return self.offsets[0] / NS_PER_MS

    def total(self) -> float:
        """The drawn width of the whole window, gaps included."""
        return (self.offsets[-1] + self.segs[-1][1] - self.segs[-1][0]) / NS_PER_MS


def _rows_in_lane(spans: Sequence[WSpan]) -> tuple[list[int], int]:
    """Each span's row inside its rank's lane, and the lane's height in rows: spans that overlap
    without nesting go to sub-lanes (:func:`assign_lanes`), stacked one under the other, and
    inside a sub-lane the row is the nesting depth."""
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
    return [sub_base[sub[i]] + depth[i] for i in range(len(spans))], lane_rows


def _group_trace(group: str) -> dict[str, Any]:
    """The (empty) bar trace of one span group."""
    return {
        "type": "bar", "orientation": "h", "name": group, "base": [], "x": [],
        "y": [], "hovertext": [], "customdata": [], "hoverinfo": "text",
        "width": 0.82, "marker": {"color": GROUP_COLOURS.get(group, OTHER_COLOUR),
                                  "line": {"width": 0}},
    }  # fmt: skip


def _hover_text(sp: WSpan, where: str, group: str, t0: int) -> str:
    """A span's hover label: name, rank and group, times, error status, attributes."""
    dur = (sp.end - sp.start) / NS_PER_MS
    lines = [
        f"<b>{html.escape(sp.name)}</b>",
        f"{where} · {group}",
        f"start +{fmt_ms((sp.start - t0) / NS_PER_MS)} · duration {fmt_ms(dur)}",
    ]
    if sp.error:
        lines.append("<b>status ERROR</b>")
    lines += [f"{html.escape(k)} = {hover_value(v)}" for k, v in sp.attrs.items()]
    return "<br>".join(lines)


@dataclass
class _Lanes:
    """The bars of every lane, one trace per group, and the y axis that labels the lanes."""

    axis: _XAxis
    t0: int
    traces: dict[str, dict[str, Any]] = field(default_factory=dict)
    tickvals: list[float] = field(default_factory=list)
    ticktext: list[str] = field(default_factory=list)
    shapes: list[dict[str, Any]] = field(default_factory=list)
    #: Where each drawn span is: (x0, x1, y) by rank and key, for the link arrows (a span's
    #: ids are unique only within its rank: nemo-lens 0.1.0's ranks can share them).
    placed: LinkTargets[tuple[float, float, float]] = field(default_factory=LinkTargets)
    rows: int = 0  # the next free row
    spans: int = 0

    def add_lane(self, lane_no: int, rank: int, spans: list[WSpan], res: dict[str, Any]) -> None:
        """Draw one rank's spans below the lanes drawn so far."""
        base_row = self.rows
        span_rows, lane_rows = _rows_in_lane(spans)
        stage = res.get(ResourceAttr.PP_RANK)
        host = res.get(ResourceAttr.HOST_NAME)
        self.tickvals.append(base_row + (lane_rows - 1) / 2)
        self.ticktext.append(f"rank {rank}" + (f" · PP {stage}" if stage is not None else ""))
        if lane_no % 2 == 1:  # zebra lanes, the first one plain
            self.shapes.append({
                "type": "rect", "xref": "paper", "x0": 0, "x1": 1, "yref": "y",
                "y0": base_row - 0.5, "y1": base_row + lane_rows - 0.5, "layer": "below",
                "fillcolor": "rgba(0,0,0,0.04)", "line": {"width": 0},
            })  # fmt: skip
        where = f"rank {rank}" + (f" ({html.escape(str(host))})" if host else "")
        for sp, row in zip(spans, span_rows, strict=True):
            group = group_of(sp.name)
            tr = self.traces.get(group)
            if tr is None:
                tr = self.traces[group] = _group_trace(group)
            x0, x1 = self.axis.start(sp.start), self.axis.end(sp.end)
            y = base_row + row
            tr["base"].append(round(x0, 6))
            tr["x"].append(round(max(x1 - x0, 0.0), 6))
            tr["y"].append(y)
            tr["hovertext"].append(_hover_text(sp, where, group, self.t0))
            tr["customdata"].append(sp.key[1])
            self.placed.add(rank, sp.key, (x0, x1, y))
            self.spans += 1
        self.rows = base_row + lane_rows + 1  # one blank row between lanes


def _link_trace(
    window: dict[int, list[WSpan]],
    ranks: list[int],
    placed: LinkTargets[tuple[float, float, float]],
) -> tuple[dict[str, Any] | None, int, int]:
    """The arrows from the end of each sender's span to the start of the span linking to it
    (None when there are none), the arrows drawn, and the links whose sender is not drawn."""
    lx: list[float | None] = []
    ly: list[float | None] = []
    sizes: list[int] = []
    links = unresolved = 0
    for rank in ranks:
        for sp in window[rank]:
            for target in sp.links:
                src = placed.resolve(rank, target)
                dst = placed.resolve(rank, sp.key)
                if src is None or dst is None:
                    unresolved += 1  # the sender's rank did not export, or is outside the window
                    continue
                lx += [src[1], dst[0], None]
                ly += [src[2], dst[2], None]
                sizes += [0, 9, 0]
                links += 1
    if not links:
        return None, links, unresolved
    trace = {
        "type": "scatter", "mode": "lines+markers", "name": "links (send → linked recv)",
        "x": lx, "y": ly, "hoverinfo": "skip", "connectgaps": False,
        "line": {"color": "rgba(40,40,40,0.7)", "width": 1},
        "marker": {"symbol": "arrow", "angleref": "previous", "size": sizes,
                   "color": "rgba(40,40,40,0.9)"},
    }  # fmt: skip
    return trace, links, unresolved


def _gap_marks(
    axis: _XAxis, ranges: list[tuple[int, int]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A grey band over each gap between segments and a label saying what it hides."""
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    if not axis.gap:
        return shapes, annotations
    segs, offsets = axis.segs, axis.offsets
    for k in range(len(segs) - 1):
        gx0 = (offsets[k] + segs[k][1] - segs[k][0]) / NS_PER_MS
        gx1 = offsets[k + 1] / NS_PER_MS
        shapes.append({
            "type": "rect", "xref": "x", "yref": "paper", "x0": gx0, "x1": gx1, "y0": 0,
            "y1": 1, "fillcolor": "rgba(120,120,120,0.18)", "line": {"width": 0},
            "layer": "below",
        })  # fmt: skip
        hidden = fmt_ms((segs[k + 1][0] - segs[k][1]) / NS_PER_MS)
        text = f"{hidden} hidden"
        if k + 1 < len(ranges) and ranges[k + 1][0] - ranges[k][1] > 1:
            text = f"iterations {ranges[k][1] + 1}-{ranges[k + 1][0] - 1} hidden ({hidden})"
        annotations.append({
            "x": (gx0 + gx1) / 2, "y": 1, "xref": "x", "yref": "paper", "yanchor": "top",
            "showarrow": False, "font": {"size": 11, "color": "#333"}, "text": text,
            "bgcolor": "rgba(255,255,255,0.85)",
        })  # fmt: skip
    return shapes, annotations


#: Band colours of the marks: live captures and flight-recorder dumps.
_MARK_STYLE = {
    "capture": ("rgba(255,150,0,0.13)", "rgba(230,120,0,0.9)"),
    "recorder": ("rgba(150,60,200,0.11)", "rgba(130,40,180,0.9)"),
}


def mark_text(mark: Mark) -> str:
    """A mark's label: what it is, its iterations and ranks."""
    its = ""
    if mark.iterations is not None:
        a, b = mark.iterations
        its = f", iteration {a}" if a == b else f", iterations {a}-{b}"
    ranks = ",".join(map(str, mark.ranks))
    what = f"capture {mark.label}" if mark.kind == "capture" else f"recorder dump ({mark.label})"
    return f"{what}{its}, rank{'s' if len(mark.ranks) != 1 else ''} {ranks}"


def _mark_bands(
    axis: _XAxis, marks: Sequence[Mark]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A coloured band over each live capture and recorder dump in the window, labelled."""
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for k, mark in enumerate(marks):
        x0, x1 = axis.start(mark.start), axis.end(mark.end)
        if x1 <= x0:
            continue  # outside the window (hidden in a gap)
        fill, line = _MARK_STYLE[mark.kind]
        shapes.append({
            "type": "rect", "xref": "x", "yref": "paper", "x0": x0, "x1": x1, "y0": 0, "y1": 1,
            "fillcolor": fill, "line": {"width": 1, "color": line, "dash": "dot"},
            "layer": "below", "name": f"{mark.kind}:{mark.label}",
        })  # fmt: skip
        annotations.append({
            "x": x0, "y": 1.0 - 0.06 * (k % 3), "xref": "x", "yref": "paper", "xanchor": "left",
            "yanchor": "top", "showarrow": False, "font": {"size": 11, "color": line},
            "text": html.escape(mark_text(mark)), "bgcolor": "rgba(255,255,255,0.8)",
        })  # fmt: skip
    return shapes, annotations


def _x_axis(axis: _XAxis, focus: int | None) -> dict[str, Any]:
    """The x axis, opening on the steps (``focus``) when set-up fills most of the window."""
    x_axis: dict[str, Any] = {
        "title": {"text": "ms since the window's start (grey bands: hidden iterations)"},
        "zeroline": False, "showgrid": True,
    }  # fmt: skip
    total_x = axis.total()
    if focus is not None and total_x > 0 and axis.start(focus) > 0.3 * total_x:
        # Set-up (model init, data) often outlasts the shown steps many times over: open on the
        # steps; plotly's double-click first returns here, the second shows everything.
        lo = axis.start(focus)
        x_axis["range"] = [lo - 0.01 * (total_x - lo), total_x]
    return x_axis


def build_timeline(
    window: dict[int, list[WSpan]],
    segs: list[tuple[int, int]],
    t0: int,
    resources_by_rank: dict[int, dict[str, Any]],
    ranges: list[tuple[int, int]],
    focus: int | None = None,
    marks: Sequence[Mark] = (),
) -> Timeline:
    """One lane per rank (rows = nesting depth, plus extra rows for spans that overlap without
    nesting), one bar trace per group, one arrow trace for the links, the omitted middle of the
    run collapsed into a marked gap, and a band over each live capture and recorder dump
    (``marks``). ``focus``: where the view opens when set-up is long."""
    axis = _XAxis(segs)
    lanes = _Lanes(axis, t0)
    ranks = sorted(r for r, sp in window.items() if sp)
    for lane_no, rank in enumerate(ranks):
        lanes.add_lane(lane_no, rank, window[rank], resources_by_rank.get(rank, {}))
    links_trace, links, unresolved = _link_trace(window, ranks, lanes.placed)
    data = [lanes.traces[g] for g in sorted(lanes.traces, key=group_order)]
    if links_trace is not None:
        data.append(links_trace)
    gap_shapes, annotations = _gap_marks(axis, ranges)
    mark_shapes, mark_notes = _mark_bands(axis, marks)
    rows = max(lanes.rows - 1, 1)
    layout = {
        "height": int(min(max(260, rows * 18 + 140), 3000)),
        "barmode": "overlay", "hovermode": "closest", "dragmode": "zoom",
        "margin": {"l": 110, "r": 20, "t": 60, "b": 50},
        "xaxis": _x_axis(axis, focus),
        "yaxis": {"autorange": "reversed", "tickmode": "array", "tickvals": lanes.tickvals,
                  "ticktext": lanes.ticktext, "showgrid": False, "zeroline": False},
        "legend": {"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom"},
        "hoverlabel": {"align": "left"}, "shapes": lanes.shapes + gap_shapes + mark_shapes,
        "annotations": annotations + mark_notes,
    }  # fmt: skip
    return Timeline({"data": data, "layout": layout}, lanes.spans, len(ranks), links, unresolved)
