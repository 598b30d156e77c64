"""The run directory around a trace: where the report goes, and the files beside the traces
(``progress.jsonl`` for the training curves, ``resolved.json`` for the header)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract
from mlaunch.model.spans import Metric
from mlaunch.trace.report.curve import Curve


def run_directory(path: Path) -> Path:
    """The run directory behind ``path``: itself, or the one holding a traces file or the
    ``telemetry/`` directory given instead (where progress.jsonl and resolved.json live)."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    return d.parent if d.name == envcontract.TELEMETRY_DIR else d


def default_output(path: Path) -> Path:
    """``RUN_DIR/report.html`` for a run directory, or a file or telemetry directory in it."""
    return run_directory(path) / envcontract.REPORT_FILE


#: The fields of a training record of ``progress.jsonl`` (:class:`~mlaunch.envcontract.ProgressStep`)
#: the curves draw.
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_sec", "step_ms")


@dataclass
class Progress:
    """The curves of ``progress.jsonl``: one per :data:`TRAIN_KEYS` from the training records,
    one of ``eval_loss`` from the eval records, each bounded (:class:`~.curve.Curve`), so the
    file is read as a stream at any length."""

    train: dict[str, Curve] = field(default_factory=lambda: {k: Curve() for k in TRAIN_KEYS})
    evals: Curve = field(default_factory=Curve)
    #: Whether the file has any training record (else the curves come from the step spans).
    has_train: bool = False


def read_progress(run_dir: Path) -> tuple[Progress, int]:
    """The curves of ``progress.jsonl`` (the last record per iteration and kind, so a resumed
    run's repeats count once) and the number of unreadable lines skipped (a crash can cut the
    last; a line that is no record, or has no whole-number iteration, is skipped too)."""
    prog = Progress()
    path = run_dir / envcontract.PROGRESS_FILE
    if not path.is_file():
        return prog, 0
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            rec = envcontract.read_progress_record(raw)
            if rec is None or not isinstance(rec.iteration, int):
                bad += 1
                continue
            if isinstance(rec, envcontract.ProgressEval):
                prog.evals.add(rec.iteration, rec.eval_loss)
                continue
            prog.has_train = True
            for k, curve in prog.train.items():
                curve.add(rec.iteration, getattr(rec, k))
    return prog, bad


def read_resolved(run_dir: Path) -> dict[str, Any]:
    """``resolved.json`` as ``mlaunch train`` wrote it, or {} (plain torchrun runs have none)."""
    try:
        data = json.loads((run_dir / envcontract.RESOLVED_JSON_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


#: The curves Megatron-LM's metrics give (its ``megatron.training.*`` instruments, which the
#: trainer records under the same names): instrument -> the :data:`TRAIN_KEYS` curve.
METRIC_CURVES: dict[str, str] = {
    Metric.LOSS: "loss",
    Metric.LEARNING_RATE: "lr",
    Metric.GRAD_NORM: "grad_norm",
    Metric.TOKENS_PER_SEC: "tokens_per_sec",
    Metric.STEP_DURATION_MS: "step_ms",
}


#: Per rank, per curve key, ``(time ns, value)`` points (:func:`read_metric_points`).
MetricPoints = dict[int, dict[str, list[tuple[int, float]]]]


def read_metric_points(run_dir: Path) -> MetricPoints:
    """Per rank, the :data:`METRIC_CURVES` values its metrics files hold
    (``telemetry/metrics-rank<R>.jsonl``: the file exporter's, or what the embedded receiver got
    from a Megatron-LM worker), as ``(time ns, value)`` per curve key in time order: a gauge's
    value at each export; for the step-duration histogram (cumulative), the mean step of each
    export interval (the change of its sum over the change of its count). Unreadable lines are
    skipped (a torn last line of a live run)."""
    from mlaunch.otlp.otlp_json import read_metrics

    out: MetricPoints = {}
    tel = run_dir / envcontract.TELEMETRY_DIR
    if not tel.is_dir():
        return out
    for path in sorted(tel.glob("metrics-rank*.jsonl")):
        named = envcontract.parse_telemetry_file(path.name)
        if named is None or named.rank is None or named.spool:
            continue
        try:
            metrics = read_metrics(path)
        except (OSError, ValueError):
            continue
        points: dict[str, list[tuple[int, float]]] = {}
        last_hist: tuple[float, float] | None = None
        for m in metrics:
            key = METRIC_CURVES.get(m["name"])
            if key is None:
                continue
            for dp in m["data_points"]:
                try:
                    t = int(dp["timeUnixNano"])
                    if m["kind"] == "histogram":
                        total, count = float(dp.get("sum", 0.0)), float(dp.get("count", 0))
                        prev = last_hist or (0.0, 0.0)
                        last_hist = (total, count)
                        if count <= prev[1]:
                            continue  # no step recorded since the last export
                        value = (total - prev[0]) / (count - prev[1])
                    else:
                        value = float(dp["asDouble"] if "asDouble" in dp else dp["asInt"])
                except (KeyError, TypeError, ValueError):
                    continue
                points.setdefault(key, []).append((t, value))
        if points:
            out[named.rank] = {k: sorted(v) for k, v in points.items()}
    return out
