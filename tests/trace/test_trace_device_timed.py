"""A GPU trace's device-timed spans sit on the device's timeline: a child can end after its
host-timed parent (the host enqueues forward-backward and leaves ``megatron.forward_backward``
long before the GPU finishes it, and the offload copies run on their own stream). The readers
take each span's own times and do not clip it to its parent (docs/telemetry.md, "Span times on
CPU and on GPU"); this synthetic trace is laid out as a GPU step is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.synthetic_traces import TraceBuilder, check_chrome_trace

from mlaunch.model.spans import SpanName
from mlaunch.trace.chrome import export_chrome
from mlaunch.trace.goodput import goodput_store
from mlaunch.trace.report.build import render_report
from mlaunch.trace.store import open_reader
from mlaunch.trace.summary import summarize_store

S = SpanName


def _gpu_like_step(device_spans: bool = True) -> TraceBuilder:
    """One step of one rank in ms: host-timed iteration 0-200 and forward_backward 10-100 (the
    host's enqueue); device-timed microbatches and the offload copies run until 150, past their
    parent's end, and all of them before the step's sync at 170 (inside the iteration)."""
    b = TraceBuilder(world_size=1)
    step = b.span(0, S.ITERATION, 0, 200, attrs={"megatron.iteration": 1})
    fb = b.span(0, S.FORWARD_BACKWARD, 10, 100, parent=step)
    if device_spans:
        b.span(0, S.MICROBATCH_FORWARD, 20, 60, parent=fb)
        b.span(0, S.ACTIVATION_OFFLOAD, 55, 130, parent=fb)  # copy stream: overlaps compute
        b.span(0, S.ACTIVATION_RELOAD, 85, 135, parent=fb)
        b.span(0, S.MICROBATCH_BACKWARD, 135, 150, parent=fb)  # starts after its parent ended
    b.span(0, S.OPTIMIZER, 175, 195, parent=step)
    return b


LATE = {S.ACTIVATION_OFFLOAD: 75.0, S.ACTIVATION_RELOAD: 50.0, S.MICROBATCH_BACKWARD: 15.0}


def test_chrome_export_keeps_a_child_that_ends_after_its_parent_whole(tmp_path: Path) -> None:
    _gpu_like_step().write_run_dir(tmp_path / "run")
    out = tmp_path / "trace.json"
    export_chrome(open_reader(tmp_path / "run"), out)
    xs = check_chrome_trace(json.loads(out.read_text()))  # every thread's slices still nest
    by_name = {e["name"]: e for e in xs}
    assert len(xs) == len(by_name) == 7
    for name, dur_ms in LATE.items():
        assert by_name[name]["dur"] == pytest.approx(dur_ms * 1e3)  # not clipped to its parent
    # Those that straddle their parent's end cannot nest in its lane: they get one of their own.
    for name in (S.ACTIVATION_OFFLOAD, S.ACTIVATION_RELOAD):
        assert by_name[name]["tid"] != by_name[S.FORWARD_BACKWARD]["tid"]
    assert by_name[S.MICROBATCH_FORWARD]["tid"] == by_name[S.FORWARD_BACKWARD]["tid"]


def test_summary_and_goodput_read_device_timed_children_as_they_are(tmp_path: Path) -> None:
    _gpu_like_step().write_run_dir(tmp_path / "gpu")
    summary = summarize_store(open_reader(tmp_path / "gpu").store)
    rows = {x.name: x for x in summary.spans}
    for name, dur_ms in LATE.items():
        assert rows[name].count == 1 and rows[name].p50_ms == pytest.approx(dur_ms)
    assert rows[S.ITERATION].p50_ms == pytest.approx(200)
    # Goodput is decided by the step spans: the device-timed children change nothing.
    _gpu_like_step(device_spans=False).write_run_dir(tmp_path / "host")
    gpu = goodput_store(open_reader(tmp_path / "gpu").store).ranks[0].breakdown
    host = goodput_store(open_reader(tmp_path / "host").store).ranks[0].breakdown
    assert gpu.to_json() == host.to_json()
    assert gpu.productive_ms == pytest.approx(200) and gpu.wall_ms == pytest.approx(200)


def test_the_report_timeline_draws_every_span_of_such_a_step(tmp_path: Path) -> None:
    _gpu_like_step().write_run_dir(tmp_path / "run")
    result = render_report(tmp_path / "run")
    assert result.timeline_spans == 7 and result.lanes == 1
