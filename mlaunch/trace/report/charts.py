"""The report's small charts as plain plotly.js JSON: training curves, step time per rank and the
goodput split."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from mlaunch.model.spans import ResourceAttr
from mlaunch.rundir import layout as lay
from mlaunch.trace.goodput import GoodputReport
from mlaunch.trace.metrics import MetricPoints
from mlaunch.trace.report.curve import Curve, Points
from mlaunch.trace.report.rundir import TRAIN_KEYS, Progress
from mlaunch.trace.report.style import NS_PER_MS, fmt_ms
from mlaunch.trace.report.window import Scan
from mlaunch.trace.summary import Summary

#: Goodput categories: (label, Breakdown attribute, colour).
GOODPUT_PARTS = (
    ("productive", "productive_ms", "#2ca02c"),
    ("startup", "restart_ms", "#ff7f0e"),
    ("checkpoint", "checkpoint_ms", "#8c564b"),
    ("evaluation", "evaluation_ms", "#e377c2"),
    ("unaccounted", "unaccounted_ms", "#bdbdbd"),
)


def _traces(name: str, pts: Points, mode: str) -> list[dict[str, Any]]:
    """The plotly traces of one curve: its points, or (decimated) each bucket's min-max as a
    band under the line of its means."""
    line = {"type": "scatter", "mode": mode, "name": name, "x": pts.xs, "y": pts.ys,
            "marker": {"size": 4}, "line": {"width": 1.5}}  # fmt: skip
    if pts.lo is None:
        return [line]
    line["mode"] = "lines"
    edge = {"type": "scatter", "mode": "lines", "x": pts.xs, "showlegend": False,
            "line": {"width": 0.5, "color": "rgba(31,119,180,0.5)"}}  # fmt: skip
    return [
        {**edge, "name": f"{name} min", "y": pts.lo},
        {**edge, "name": f"{name} max", "y": pts.hi, "fill": "tonexty",
         "fillcolor": "rgba(31,119,180,0.2)"},
        line,
    ]  # fmt: skip


def _line_chart(title: str, ytitle: str, series: list[tuple[str, Points, str]]) -> dict[str, Any]:
    """A small chart over iterations; ``series`` = (name, points, mode)."""
    data = [t for name, pts, mode in series for t in _traces(name, pts, mode)]
    thinned = [pts for _, pts, _ in series if pts.lo is not None]
    if thinned:  # say so: a reader must not take a bucket's mean for a point
        p = max(thinned, key=lambda p: p.width)
        title += (f" (decimated: {p.iterations:,} iterations in {len(p.xs):,} buckets of "
                  f"{p.width:,}; line: mean, band: min-max)")  # fmt: skip
    return {
        "data": data,
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 14}}, "height": 280,
            "margin": {"l": 60, "r": 15, "t": 40, "b": 40}, "hovermode": "x unified",
            "xaxis": {"title": {"text": "iteration"}}, "yaxis": {"title": {"text": ytitle}},
            "showlegend": len(series) > 1, "legend": {"x": 1, "xanchor": "right", "y": 1},
        },
    }  # fmt: skip


def _curves_from_steps(
    scan: Scan, res: dict[str, Any], metrics: MetricPoints | None = None
) -> tuple[dict[str, Curve], str]:
    """Training curves rebuilt from the step spans when there is no progress file (plain
    torchrun without the run directory, or another script such as Megatron-LM), and where they
    came from. A curve the spans leave empty (Megatron-LM's steps carry no loss) takes the
    ``megatron.training.*`` metrics' points (:func:`_metric_curves`)."""
    # The step spans carry iteration, loss and grad norm; take the rank that owns the loss (the
    # last pipeline stage), step time from the span, tokens/s from the resource's batch.
    owner = scan.curve_rank()
    if owner is None:
        return {}, "nowhere: no progress.jsonl and no megatron.train.iteration spans"
    tokens = int(res.get(ResourceAttr.BATCH_SIZE) or 0) * int(
        res.get(ResourceAttr.SEQUENCE_LENGTH) or 0
    )
    out = {k: Curve() for k in TRAIN_KEYS}
    loss, lr, gn, tps, step_ms = (out[k] for k in TRAIN_KEYS)
    for s in scan.rank_steps(owner):  # the last step of an iteration counts, all of it
        ms = (s.end - s.start) / NS_PER_MS
        it = s.iteration
        loss.add(it, s.loss)
        gn.add(it, s.grad_norm)
        step_ms.add(it, ms)
        tps.add(it, tokens / (ms / 1e3) if tokens and ms > 0 else None)
    source = f"megatron.train.iteration span attributes of rank {owner} (no progress.jsonl)"
    empty = [k for k in TRAIN_KEYS if not out[k].points().xs]
    if metrics and empty:
        from_metrics, rank = _metric_curves(scan, owner, metrics, empty)
        if from_metrics:
            out.update(from_metrics)
            names = ", ".join(k.replace("_", " ") for k in from_metrics)
            source += f"; {names} from the megatron.training.* metrics of rank {rank}"
    return out, source


def _metric_curves(
    scan: Scan, owner: int, metrics: MetricPoints, keys: list[str]
) -> tuple[dict[str, Curve], int | None]:
    """The ``keys`` curves from a rank's metrics (the loss owner's, else the rank with the most
    points: Megatron-LM records them on its exporting rank), each point placed at the iteration
    whose step last ended by the time it was exported; points before the first step are left
    out. Returns the non-empty curves and the rank."""
    rank = (
        owner
        if owner in metrics
        else max(metrics, key=lambda r: sum(map(len, metrics[r].values())))
    )
    ends: list[tuple[int, int]] = sorted(
        (s.end, s.iteration) for s in scan.rank_steps(rank if rank in scan.step_counts else owner)
    )
    times = [e for e, _ in ends]
    out: dict[str, Curve] = {}
    for key in keys:
        curve = Curve()
        for t, value in metrics[rank].get(key, ()):
            i = bisect_right(times, t) - 1
            if i >= 0:
                curve.add(ends[i][1], value)
        if curve.points().xs:
            out[key] = curve
    return out, rank


def curves_need_steps(progress: Progress) -> bool:
    """Whether :func:`curves` draws from the step spans (no training record in ``progress``):
    only then does pass 1 keep every rank's steps (:attr:`Scan.keep_steps`)."""
    return not progress.has_train


def curves(
    progress: Progress, scan: Scan, res: dict[str, Any], metrics: MetricPoints | None = None
) -> tuple[dict[str, dict[str, Any]], str]:
    """The training-curve figures (div id -> figure) and where their data came from:
    ``progress.jsonl``, else the step spans and the workers' metrics (``metrics``,
    :func:`~mlaunch.trace.metrics.read_metric_points`)."""
    train, source = progress.train, lay.PROGRESS_FILE
    if not progress.has_train:
        train, source = _curves_from_steps(scan, res, metrics)
        if not train:
            return {}, source
    col = {k: c.points() for k, c in train.items()}
    loss_series = [("train", col["loss"], "lines+markers")]
    evals = progress.evals.points()
    if evals.xs:
        loss_series.append(("eval", evals, "lines+markers"))
    spec = [
        ("chart-loss", "loss", "cross entropy", loss_series),
        ("chart-lr", "learning rate", "lr", [("lr", col["lr"], "lines+markers")]),
        ("chart-grad-norm", "grad norm", "norm",
         [("grad norm", col["grad_norm"], "lines+markers")]),
        ("chart-tokens", "throughput", "tokens/s",
         [("tokens/s", col["tokens_per_sec"], "lines+markers")]),
        ("chart-step-time", "step time", "ms",
         [("step time", col["step_ms"], "lines+markers")]),
    ]  # fmt: skip
    figs: dict[str, dict[str, Any]] = {}
    for div, title, ytitle, series in spec:
        series = [s for s in series if s[1].xs]
        if series:
            figs[div] = _line_chart(title, ytitle, series)
    return figs, source


def skew_figure(summary: Summary) -> dict[str, Any] | None:
    """The median step time per rank as bars (stragglers red), or None without step spans."""
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


def goodput_figure(gp: GoodputReport) -> dict[str, Any]:
    """The goodput split of all ranks and of each rank as stacked bars (% of wall time)."""
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
