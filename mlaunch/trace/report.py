"""``mlaunch trace report``: one self-contained, offline HTML file per run (plotly.js embedded):
a header (run identity, layout, goodput, stragglers), a per-rank timeline of the run's phases,
the span breakdown, training curves from ``progress.jsonl`` and the goodput split.

The traces are read once, feeding the summary and goodput aggregators together; plotly is
imported only when rendering.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract
from mlaunch.model.spans import ResourceAttr, SpanName
from mlaunch.trace.goodput import GoodputAggregator, GoodputReport
from mlaunch.trace.reader import TraceInputError, TraceReader
from mlaunch.trace.stats import Interval, merge
from mlaunch.trace.summary import Summary, SummaryAggregator, no_spans_error

#: Timeline lanes: label -> (span names, colour). Order is drawing order.
PHASES: dict[str, tuple[tuple[str, ...], str]] = {
    "model init": ((SpanName.MODEL_INIT.value,), "#9467bd"),
    "data setup": ((SpanName.DATA_SETUP.value,), "#8c564b"),
    "load checkpoint": ((SpanName.LOAD_CHECKPOINT.value,), "#e377c2"),
    "train step": ((SpanName.TRAIN_STEP.value,), "#2ca02c"),
    "save checkpoint": ((SpanName.SAVE_CHECKPOINT.value,), "#1f77b4"),
    "evaluate": ((SpanName.EVALUATE.value,), "#17becf"),
    # Last and thin: it wraps the first step, so it is drawn as a strip over it.
    "first iteration": ((SpanName.FIRST_ITERATION.value,), "#ff7f0e"),
}
_THIN = frozenset({"first iteration"})
#: Goodput parts in stacking order with their colours.
GOODPUT_PARTS: tuple[tuple[str, str, str], ...] = (
    ("productive", "productive_ms", "#2ca02c"),
    ("restart", "restart_ms", "#ff7f0e"),
    ("checkpoint", "checkpoint_ms", "#1f77b4"),
    ("evaluation", "evaluation_ms", "#17becf"),
    ("unaccounted", "unaccounted_ms", "#c7c7c7"),
)
#: Progress-record fields plotted as training curves: key -> title.
CURVES: dict[str, str] = {
    "loss": "loss", "lr": "learning rate", "tokens_per_sec": "tokens/s", "grad_norm": "grad norm",
}  # fmt: skip
#: At most this many bars per rank and phase; denser intervals are coalesced across small gaps.
MAX_BARS = 400


@dataclass
class ReportData:
    """Everything the report shows, computed before any rendering."""

    source: Path
    summary: Summary
    goodput: GoodputReport
    t0_ns: int
    timeline: dict[int, dict[str, list[Interval]]]  # rank -> phase -> intervals (ns from t0)
    merged_counts: dict[int, dict[str, int]]  # rank -> phase -> spans behind the bars
    progress: list[dict[str, Any]] = field(default_factory=list)
    progress_path: Path | None = None


def coalesce(intervals: list[Interval], max_bars: int = MAX_BARS) -> list[Interval]:
    """Merged intervals, further joined across gaps shorter than extent/max_bars until at most
    ``max_bars`` remain, so a long run's thousands of steps draw as a few hundred bars."""
    iv = merge(intervals)
    if len(iv) <= max_bars:
        return iv
    gap = (iv[-1][1] - iv[0][0]) / max_bars
    while len(iv) > max_bars:
        out: list[Interval] = [iv[0]]
        for s, e in iv[1:]:
            if s - out[-1][1] <= gap:
                out[-1] = (out[-1][0], max(e, out[-1][1]))
            else:
                out.append((s, e))
        iv, gap = out, gap * 2
    return iv


def read_progress(
    run_dir: Path, *, skip_invalid: bool = False
) -> tuple[list[dict[str, Any]], Path | None]:
    """The records of ``progress.jsonl`` (training and eval lines), or ``([], None)`` if absent."""
    path = run_dir / envcontract.PROGRESS_FILE
    if not path.is_file():
        return [], None
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                if not isinstance(rec, dict) or "iteration" not in rec:
                    raise ValueError("not a progress record (no 'iteration')")
            except ValueError as e:
                if skip_invalid:
                    continue
                raise TraceInputError(
                    f"bad progress record ({e})", path=path, line=n,
                    fix="repair or delete that line, or pass --skip-invalid",
                ) from None  # fmt: skip
            out.append(rec)
    return out, path


def collect(path: Path, *, skip_invalid: bool = False) -> ReportData:
    """Read the traces once (summary + goodput) and the progress records of ``path``."""
    reader = TraceReader.open(path, skip_invalid=skip_invalid)
    summ, good = SummaryAggregator(), GoodputAggregator()
    for res, spans, flagged in reader:
        try:
            summ.add(res, spans, flagged)
            good.add(res, spans)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise reader.error_here(f"malformed span ({type(e).__name__}: {e})") from None
    if not summ.durations:
        raise no_spans_error(reader)
    t0 = min(st.lo for st in good.ranks.values())
    timeline: dict[int, dict[str, list[Interval]]] = {}
    counts: dict[int, dict[str, int]] = {}
    for rank, st in sorted(good.ranks.items()):
        timeline[rank], counts[rank] = {}, {}
        for label, (names, _) in PHASES.items():
            if SpanName.TRAIN_STEP.value in names:
                raw = list(zip(st.step_starts, st.step_ends, strict=True))
            else:
                raw = [iv for n in names for iv in st.spans.get(n, [])]
            if raw:
                timeline[rank][label] = [(s - t0, e - t0) for s, e in coalesce(raw)]
                counts[rank][label] = len(raw)
    progress, ppath = ([], None)
    if path.is_dir():
        progress, ppath = read_progress(path, skip_invalid=skip_invalid)
    return ReportData(
        source=path, summary=summ.finish(reader.stats), goodput=good.finish(), t0_ns=t0,
        timeline=timeline, merged_counts=counts, progress=progress, progress_path=ppath,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Rendering (plotly imported here only)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1200px;color:#222;padding:0 16px}
h1{font-size:1.5em;margin-bottom:4px}h2{font-size:1.2em;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em}td,th{padding:3px 10px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.kv td{text-align:left}.muted{color:#777}.bad{color:#c00;font-weight:600}
.cards{display:flex;gap:16px;flex-wrap:wrap;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px}.card b{font-size:1.4em;display:block}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _fig_html(fig: Any) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def _header(d: ReportData) -> str:
    s, g = d.summary, d.goodput
    run_id = s.run.get(ResourceAttr.RUN_ID, "?")
    cards = [
        ("goodput", f"{100 * g.overall.goodput:.1f}%"),
        ("job wall time", f"{g.job_wall_ms / 1000:.2f} s"),
        ("ranks", str(len(s.rank_ids))),
        ("spans", f"{s.read.get('spans', 0):,}"),
        ("error spans", str(s.errors)),
        ("truncated spans", str(s.truncated)),
    ]
    if s.skew is not None:
        k = s.skew
        cards.append(("slowest rank", f"{k.slowest_rank} ({k.slowest_ratio:.2f}x)"))
    card_html = "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards)
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in s.run.items())
    rows += f"<tr><td>hosts</td><td>{_e(', '.join(s.hosts) or '-')}</td></tr>"
    strag = ""
    if s.skew is not None and s.skew.stragglers:
        strag = f'<p class="bad">stragglers: ranks {_e(", ".join(map(str, s.skew.stragglers)))}</p>'
    return (
        f"<h1>mlaunch run report: {_e(run_id)}</h1>"
        f'<p class="muted">from {_e(d.source)}</p><div class="cards">{card_html}</div>{strag}'
        f'<table class="kv">{rows}</table>'
    )


def _timeline_fig(d: ReportData) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, (_, colour) in PHASES.items():
        ys, xs, bases, texts = [], [], [], []
        for rank, phases in d.timeline.items():
            for s, e in phases.get(label, []):
                ys.append(f"rank {rank}")
                bases.append(s / 1e9)
                xs.append((e - s) / 1e9)
                texts.append(f"{label}<br>{s / 1e9:.3f}-{e / 1e9:.3f} s")
        if ys:
            fig.add_trace(go.Bar(
                y=ys, x=xs, base=bases, orientation="h", name=label, marker_color=colour,
                hovertext=texts, hoverinfo="text", width=0.25 if label in _THIN else None,
            ))  # fmt: skip
    fig.update_layout(
        barmode="overlay", height=140 + 40 * len(d.timeline), xaxis_title="seconds since start",
        yaxis={"autorange": "reversed"}, margin={"t": 30},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
    )  # fmt: skip
    return fig


def _breakdown(d: ReportData) -> str:
    import plotly.graph_objects as go

    top = d.summary.spans[:25][::-1]
    fig = go.Figure(go.Bar(
        y=[s.name for s in top], x=[s.total_ms / 1000 for s in top], orientation="h",
        hovertext=[f"{s.count:,} spans, mean {s.mean_ms:.3f} ms, p95 {s.p95_ms:.3f} ms"
                   for s in top], marker_color="#4c78a8",
    ))  # fmt: skip
    fig.update_layout(height=120 + 22 * len(top), xaxis_title="total seconds (all ranks)",
                      margin={"t": 20, "l": 280})  # fmt: skip
    head = "".join(f"<th>{h}</th>" for h in
                   ("name", "count", "total ms", "mean ms", "p50 ms", "p95 ms", "max ms", "share",
                    "errors", "truncated"))  # fmt: skip
    rows = "".join(
        f"<tr><td>{_e(s.name)}</td><td>{s.count:,}</td><td>{s.total_ms:,.3f}</td>"
        f"<td>{s.mean_ms:,.3f}</td><td>{s.p50_ms:,.3f}</td><td>{s.p95_ms:,.3f}</td>"
        f"<td>{s.max_ms:,.3f}</td><td>{'-' if s.share is None else f'{100 * s.share:.1f}%'}</td>"
        f"<td>{s.errors or ''}</td><td>{s.truncated or ''}</td></tr>"
        for s in d.summary.spans
    )
    return _fig_html(fig) + f"<table><tr>{head}</tr>{rows}</table>"


def _curves(d: ReportData) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not d.progress:
        return f'<p class="muted">no {envcontract.PROGRESS_FILE} in this run directory</p>'
    train = [r for r in d.progress if "loss" in r]
    evals = [r for r in d.progress if "eval_loss" in r]
    fig = make_subplots(rows=2, cols=2, subplot_titles=list(CURVES.values()))
    for i, key in enumerate(CURVES):
        pts = [(r["iteration"], r[key]) for r in train if r.get(key) is not None]
        row, col = divmod(i, 2)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                 name=CURVES[key]), row=row + 1, col=col + 1)  # fmt: skip
        if key == "loss" and evals:
            fig.add_trace(go.Scatter(x=[r["iteration"] for r in evals],
                                     y=[r["eval_loss"] for r in evals], mode="lines+markers",
                                     name="eval loss"), row=1, col=1)  # fmt: skip
    fig.update_layout(height=560, margin={"t": 40})
    fig.update_xaxes(title_text="iteration")
    return _fig_html(fig)


def _goodput_fig(d: ReportData) -> Any:
    import plotly.graph_objects as go

    rows = [(f"rank {r.rank}", r.breakdown) for r in d.goodput.ranks]
    rows.append(("all ranks", d.goodput.overall))
    fig = go.Figure()
    for label, attr, colour in GOODPUT_PARTS:
        fig.add_trace(go.Bar(
            y=[r[0] for r in rows], orientation="h", name=label, marker_color=colour,
            x=[100 * getattr(b, attr) / b.wall_ms if b.wall_ms else 0 for _, b in rows],
            hovertext=[f"{label}: {getattr(b, attr) / 1000:.3f} s" for _, b in rows],
        ))  # fmt: skip
    fig.update_layout(barmode="stack", height=140 + 36 * len(rows), xaxis_title="% of wall time",
                      yaxis={"autorange": "reversed"}, margin={"t": 30},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom",
                              "traceorder": "normal"})  # fmt: skip
    return fig


def render_html(d: ReportData) -> str:
    """The complete HTML document, plotly.js inlined so it opens offline."""
    from plotly.offline import get_plotlyjs

    split = ", ".join(f"{k.replace('_', ' ')} {v / 1000:.3f} s"
                      for k, v in d.goodput.overall.restart_split_ms.items())  # fmt: skip
    sections = [
        _header(d),
        '<h2 id="timeline">Per-rank timeline</h2>', _fig_html(_timeline_fig(d)),
        '<h2 id="spans">Span breakdown</h2>', _breakdown(d),
        '<h2 id="curves">Training curves</h2>', _curves(d),
        '<h2 id="goodput">Goodput</h2>', _fig_html(_goodput_fig(d)),
        f'<p class="muted">restart cost: {_e(split)}. Definitions: docs/trace.md or '
        "<code>mlaunch trace goodput --help</code>.</p>",
    ]  # fmt: skip
    title = _e(d.summary.run.get(ResourceAttr.RUN_ID, "run"))
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>mlaunch report {title}'
        f"</title><style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>"
        + "\n".join(sections)
        + "</body></html>\n"
    )


def write_report(path: Path, out: Path, *, skip_invalid: bool = False) -> ReportData:
    """Collect, render and write the report atomically; return what it showed."""
    data = collect(path, skip_invalid=skip_invalid)
    text = render_html(data)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return data
