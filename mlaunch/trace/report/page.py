"""The report's HTML: the header of facts, the sections' tables, and the page that embeds
plotly.js, the stylesheet, the scripts and the figures' JSON."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from mlaunch.model.spans import ResourceAttr
from mlaunch.model.spec import resolve
from mlaunch.model.strategies import format_ranks
from mlaunch.trace.goodput import GoodputReport
from mlaunch.trace.reader import TraceInputError
from mlaunch.trace.report.charts import GOODPUT_PARTS
from mlaunch.trace.report.style import fmt_ms, group_of, group_order
from mlaunch.trace.report.timeline import Timeline
from mlaunch.trace.summary import Summary


def _asset(name: str) -> str:
    """A file of ``assets/`` (the stylesheet and scripts inlined into every report)."""
    return resources.files(__package__).joinpath("assets", name).read_text("utf-8")


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


# --------------------------------------------------------------------------------------------
# The header


def _setting(resolved: dict[str, Any], path: str) -> Any:
    """One setting's value from ``resolved.json`` (None when absent)."""
    v = (resolved.get("settings") or {}).get(path)
    return v.get("value") if isinstance(v, dict) else None


def _world_fact(summary: Summary, resolved: dict[str, Any]) -> str:
    """Nodes x processes and the parallel sizes."""
    res = summary.run
    world = res.get(ResourceAttr.WORLD_SIZE) or resolved.get("world_size")
    nodes = _setting(resolved, "launch.nnodes") or (len(summary.hosts) or None)
    tp, pp, dp = (res.get(a) for a in (ResourceAttr.TP_SIZE, ResourceAttr.PP_SIZE,
                                       ResourceAttr.DP_SIZE))  # fmt: skip
    layout = "-"
    if world:
        w, n = int(world), int(nodes or 0)
        per_node = str(w // n) if n and w % n == 0 else "?"
        layout = f"{n or '?'} node(s) x {per_node} process(es) = {w} ranks"
    return layout + f"; TP={tp or '?'} PP={pp or '?'} DP={dp or '?'}"


def _model_fact(res: dict[str, Any]) -> str:
    """The model's shape and an estimate of its size, from the resource attributes."""
    layers = res.get(ResourceAttr.NUM_LAYERS)
    hidden = res.get(ResourceAttr.HIDDEN_SIZE)
    heads = res.get(ResourceAttr.NUM_ATTENTION_HEADS)
    if not (layers and hidden):
        return "-"
    # 12·L·h² is the weight count of L standard blocks (attention 4h², MLP 8h²); embeddings
    # depend on the vocabulary, which the trace does not carry.
    blocks = 12 * int(layers) * int(hidden) ** 2
    model = (f"{layers} layers, hidden {hidden}, {heads or '?'} heads "
             f"(≈{blocks / 1e6:.3g}M parameters in the blocks)")  # fmt: skip
    extra = [f"{k}={res[k]}" for k in (ResourceAttr.SEQUENCE_LENGTH, ResourceAttr.BATCH_SIZE,
                                        ResourceAttr.PRECISION) if k in res]  # fmt: skip
    if extra:
        model += "; " + ", ".join(extra)
    return model


def _groups_fact(summary: Summary, resolved: dict[str, Any]) -> str:
    """The span groups seen in the trace, and the configured spec when it is known."""
    seen = sorted({group_of(s.name) for s in summary.spans}, key=group_order)
    groups = ", ".join(seen)
    spec = _setting(resolved, "telemetry.span_groups")
    if spec:
        try:
            configured = ", ".join(sorted(str(g) for g in resolve(str(spec))))
        except ValueError:
            configured = "?"
        groups = f"{spec} = {configured} (seen in the trace: {', '.join(seen)})"
    return groups


def _header(
    run_dir: Path, summary: Summary, gp: GoodputReport, resolved: dict[str, Any]
) -> list[tuple[str, str]]:
    """The run's identity as (label, value) rows."""
    res = summary.run
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
        ("world", _world_fact(summary, resolved)),
        ("hosts", hosts or "-"),
        ("model", _model_fact(res)),
        ("span groups", _groups_fact(summary, resolved)),
        ("exporting ranks", exporting),
        ("wall time", fmt_ms(gp.job_wall_ms)),
        ("goodput", good),
    ]


# --------------------------------------------------------------------------------------------
# The sections


def _spans_table(summary: Summary) -> str:
    """The span breakdown of ``mlaunch trace summary`` as a sortable table."""
    span_rows = [
        [(s.name, s.name), (group_of(s.name), group_of(s.name)), (f"{s.count:,}", s.count),
         (fmt_ms(s.total_ms), s.total_ms), (fmt_ms(s.mean_ms), s.mean_ms),
         (fmt_ms(s.p50_ms), s.p50_ms), (fmt_ms(s.p95_ms), s.p95_ms), (fmt_ms(s.max_ms), s.max_ms),
         ("-" if s.share is None else f"{100 * s.share:.1f}%", -1 if s.share is None else s.share),
         (str(s.errors or ""), s.errors), (str(s.truncated or ""), s.truncated)]
        for s in summary.spans
    ]  # fmt: skip
    return _table(
        ["name", "group", "count", "total", "mean", "p50", "p95", "max", "share of step", "errors",
         "truncated"], span_rows, table_id="span-table",
    )  # fmt: skip


def _skew_section(summary: Summary) -> str:
    """The step time per rank: a chart, a table and the straggler verdict."""
    if summary.skew is None:
        return "<p>No megatron.train.iteration spans: no per-rank skew.</p>"
    k = summary.skew
    skew_rows = [
        [(str(r.rank), r.rank), (r.host or "-", r.host or ""), (str(r.steps), r.steps),
         (fmt_ms(r.median_ms), r.median_ms), (fmt_ms(r.p95_ms), r.p95_ms),
         (f"{r.ratio:.3f}x", r.ratio), ("straggler" if r.straggler else "", int(r.straggler))]
        for r in summary.ranks
    ]  # fmt: skip
    verdict = (f"stragglers: {', '.join(map(str, k.stragglers))}" if k.stragglers
               else f"no straggler above {100 * k.threshold:.0f}%")  # fmt: skip
    return (
        '<div class="chart" id="chart-skew"></div>'
        + _table(["rank", "host", "steps", "median", "p95", "vs median of medians", ""],
                 skew_rows, table_id="skew-table")
        + f"<p>slowest rank {k.slowest_rank}: median step {fmt_ms(k.slowest_median_ms)}, "
        f"{k.slowest_ratio:.3f}x the median of rank medians ({fmt_ms(k.reference_median_ms)});"
        f" {html.escape(verdict)}.</p>"
    )  # fmt: skip


def _goodput_table(gp: GoodputReport) -> str:
    """The goodput split of all ranks and of each rank as a sortable table."""
    o = gp.overall
    gp_rows = [
        [(label, i), (f"{100 * b.goodput:.1f}%", b.goodput), (fmt_ms(b.wall_ms), b.wall_ms),
         *[(fmt_ms(getattr(b, a)), getattr(b, a)) for _, a, _ in GOODPUT_PARTS]]
        for i, (label, b) in enumerate(
            [("all ranks", o)] + [(f"rank {r.rank}", r.breakdown) for r in gp.ranks]
        )
    ]  # fmt: skip
    return _table(["", "goodput", "wall", *[p[0] for p in GOODPUT_PARTS]], gp_rows,
                  table_id="goodput-table")  # fmt: skip


def _notes_section(notes: list[str]) -> str:
    """The notes on what was skipped or approximated, or nothing when there are none."""
    if not notes:
        return ""
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return f'<section id="sec-notes"><h2>Notes</h2><ul>{notes_html}</ul></section>'


def page(
    run_dir: Path, summary: Summary, gp: GoodputReport, resolved: dict[str, Any],
    timeline: Timeline, ranges: list[tuple[int, int]], curves: dict[str, Any],
    curve_source: str, notes: list[str], figures: dict[str, Any], meta: dict[str, Any],
) -> str:  # fmt: skip
    """The whole HTML document."""
    head = _header(run_dir, summary, gp, resolved)
    run_id = head[0][1]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in head)
    window = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges) or "all"
    charts = "".join(f'<div class="chart" id="{d}"></div>' for d in curves)
    if not charts:
        charts = f"<p>No training curves: {html.escape(curve_source)}.</p>"
    split = ", ".join(f"{k} {fmt_ms(v)}" for k, v in gp.overall.restart_split_ms.items())
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
time / total megatron.train.iteration time.</p>{_spans_table(summary)}</section>
<section id="sec-skew"><h2>Step time per rank</h2>{_skew_section(summary)}</section>
<section id="sec-curves"><h2>Training curves</h2>
<p class="hint">From {html.escape(curve_source)}.</p><div class="grid">{charts}</div></section>
<section id="sec-goodput"><h2>Goodput</h2>
<div class="chart" id="chart-goodput"></div>{_goodput_table(gp)}
<p class="hint">start-up cost: {html.escape(split)}. Definitions: <code>mlaunch trace goodput
--help</code>.</p></section>
{_notes_section(notes)}
</main>
<footer>mlaunch trace report · {html.escape(str(run_dir))}</footer>
<pre id="selftest" hidden></pre>
{_json_script("report-figures", figures)}
{_json_script("report-meta", meta)}
<script>{_asset("report.js")}</script>
</body></html>
"""
