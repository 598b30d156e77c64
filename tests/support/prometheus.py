"""What a Prometheus backend calls an OpenTelemetry metric, as the OpenTelemetry collector's
``prometheus`` exporter names it (``pkg/translator/prometheus``, metric suffixes on, the
default), and the series Lens's Megatron dashboard queries (``data/``)."""

from __future__ import annotations

import re
from pathlib import Path

#: The collector's unit words (the part of its table a training metric can use).
_UNITS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
    "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes", "KBy": "kilobytes",
    "MBy": "megabytes", "GBy": "gigabytes", "%": "percent",
}  # fmt: skip
_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "y": "year"}

DASHBOARD_FILE = Path(__file__).parent / "data" / "lens_megatron_dashboard_metrics.txt"


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[^a-zA-Z0-9]+", text) if w]


def prometheus_series(name: str, kind: str, unit: str) -> set[str]:
    """The series names of one OTLP metric (``kind`` as OTLP/JSON says it: gauge, sum,
    histogram): dots to underscores, the unit as a suffix unless the name already ends in it
    (braced units dropped, ``1`` on a gauge is ``ratio``), ``_total`` for a sum,
    ``_bucket``/``_sum``/``_count`` for a histogram."""
    words = _words(name)
    main, _, per = unit.partition("/")
    suffix: list[str] = []
    if main and not main.startswith("{"):
        if main == "1":
            suffix = ["ratio"] if kind == "gauge" else []
        else:
            suffix = _words(_UNITS.get(main, main))
    if per and not per.startswith("{"):
        suffix += ["per", _PER_UNITS.get(per, per)]
    if suffix and words[-len(suffix) :] != suffix:
        words += suffix
    base = "_".join(words)
    if kind == "sum":
        return {base + "_total"}
    if kind == "histogram":
        return {base + p for p in ("_bucket", "_sum", "_count")}
    return {base}


def dashboard_series() -> tuple[set[str], set[str]]:
    """(the training series the dashboard queries, the labels its panels filter by)."""
    series: set[str] = set()
    labels: set[str] = set()
    training = True
    for line in DASHBOARD_FILE.read_text().splitlines():
        if line.startswith("# not from training:"):
            training = False
        elif line.startswith("label "):
            labels.add(line.split()[1])
        elif training and line and not line.startswith("#"):
            series.add(line)
    return series, labels
