"""The workers' ``megatron.training.*`` metrics as the readers use them: Megatron-LM's names,
which mlaunch's trainer records too, read from a run directory's
``telemetry/metrics-rank<R>.jsonl`` (the file exporter's, or what the embedded receiver got from
a Megatron-LM worker). ``mlaunch trace report`` draws curves from them and ``mlaunch status
--watch`` shows each rank's newest step time and tokens/s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlaunch.model.spans import Metric
from mlaunch.rundir import layout as lay

#: The instruments the readers use -> their curve (the report's ``TRAIN_KEYS``).
METRIC_CURVES: dict[str, str] = {
    Metric.LOSS: "loss",
    Metric.LEARNING_RATE: "lr",
    Metric.GRAD_NORM: "grad_norm",
    Metric.TOKENS_PER_SEC: "tokens_per_sec",
    Metric.STEP_DURATION_MS: "step_ms",
}

#: Per rank, per curve key, ``(time ns, value)`` points in time order.
MetricPoints = dict[int, dict[str, list[tuple[int, float]]]]


def _tail_requests(path: Path, tail_bytes: int | None) -> tuple[list[dict[str, Any]], bool]:
    """The metrics requests of ``path`` (its last ``tail_bytes`` from a line boundary, when
    given) and whether that left its start out; unreadable lines (a torn last line of a live
    run) are skipped."""
    from mlaunch.trace.reader import loads_line

    cut = False
    with path.open("rb") as fh:
        if tail_bytes is not None and path.stat().st_size > tail_bytes:
            fh.seek(-tail_bytes, 2)
            fh.readline()  # the rest of a line cut by the seek
            cut = True
        out = []
        for raw in fh:
            try:
                req = loads_line(raw)
            except ValueError:
                continue
            if isinstance(req, dict):
                out.append(req)
    return out, cut


def metric_file_points(
    path: Path, tail_bytes: int | None = None
) -> dict[str, list[tuple[int, float]]]:
    """The :data:`METRIC_CURVES` values of one metrics file as ``(time ns, value)`` per curve
    key, in time order: a gauge's value at each export; for the step-duration histogram
    (cumulative), the mean step of each export interval (the change of its sum over the change
    of its count; from a tail that leaves the file's start out, the first export only sets the
    baseline)."""
    from mlaunch.otlp.otlp_json import iter_metrics

    points: dict[str, list[tuple[int, float]]] = {}
    try:
        requests, cut = _tail_requests(path, tail_bytes)
    except OSError:
        return points
    last_hist: tuple[float, float] | None = None if cut else (0.0, 0.0)
    for req in requests:
        for m in iter_metrics(req):
            key = METRIC_CURVES.get(m["name"])
            if key is None:
                continue
            for dp in m["data_points"]:
                try:
                    t = int(dp["timeUnixNano"])
                    if m["kind"] == "histogram":
                        total, count = float(dp.get("sum", 0.0)), float(dp.get("count", 0))
                        prev, last_hist = last_hist, (total, count)
                        if prev is None or count <= prev[1]:
                            continue  # the baseline, or no step recorded since the last export
                        value = (total - prev[0]) / (count - prev[1])
                    else:
                        value = float(dp["asDouble"] if "asDouble" in dp else dp["asInt"])
                except (KeyError, TypeError, ValueError):
                    continue
                points.setdefault(key, []).append((t, value))
    return {k: sorted(v) for k, v in points.items()}


def read_metric_points(run_dir: Path, tail_bytes: int | None = None) -> MetricPoints:
    """Per rank, :func:`metric_file_points` of its metrics file (spools left out)."""
    out: MetricPoints = {}
    tel = run_dir / lay.TELEMETRY_DIR
    if not tel.is_dir():
        return out
    for path in sorted(tel.glob(lay.METRICS_FILE_GLOB)):
        named = lay.parse_telemetry_file(path.name)
        if named is None or named.rank is None or named.spool:
            continue
        if points := metric_file_points(path, tail_bytes):
            out[named.rank] = points
    return out
