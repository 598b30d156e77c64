"""Helpers shared by the telemetry tests (imported as ``telemetry_helpers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay


def read_trace_file(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Flat spans the file exporter wrote for ``rank``."""
    return otlp_json.read_spans(lay.traces_file(run_dir, rank))


def by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Spans keyed by name (last one wins)."""
    return {s["name"]: s for s in spans}


def parent_names(spans: list[dict[str, Any]]) -> dict[str, str | None]:
    """name -> parent's name (None for roots), for spans with unique names."""
    ids = {s["span_id"]: s["name"] for s in spans}
    return {s["name"]: ids.get(s["parent_span_id"]) for s in spans}


def read_metric_file(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Flat metrics the file exporter wrote for ``rank``."""
    return otlp_json.read_metrics(lay.metrics_file(run_dir, rank))
