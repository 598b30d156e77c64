"""Live capture in one process: the watcher arms a capture, ``set_iteration`` switches the groups
on at the start iteration and off after the window; a rank that exports nothing starts its
exporter for it; captured spans carry the capture id; a rank that gets the request late captures
what is left, past the window nothing; stale and foreign requests are ignored; a running capture
is never replaced; the run ending inside the window ends it."""

from __future__ import annotations

import json
import time

from mlaunch import envcontract, telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay
from mlaunch.telemetry import _capture


def _iterations(first: int, last: int) -> None:
    for it in range(first, last + 1):
        telemetry.set_iteration(it)
        with (
            telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: it}),
            telemetry.span(G.LAYER, SpanName.LAYER_FORWARD),
        ):
            pass


def _captured(run_dir, rank: int) -> dict[int, list[str]]:
    """Iteration -> names of the spans of that iteration (by their iteration parent)."""
    path = lay.traces_file(run_dir, rank)
    spans = otlp_json.read_spans(path) if path.exists() else []
    by_id = {s["span_id"]: s for s in spans}
    out: dict[int, list[str]] = {}
    for s in spans:
        node = s
        while node is not None and node["name"] != SpanName.ITERATION:
            node = by_id.get(node["parent_span_id"])
        assert node is not None, s
        assert s["attributes"][Attr.CAPTURE_ID] == "c1"
        out.setdefault(node["attributes"][Attr.ITERATION], []).append(s["name"])
    return out


def _capture_request(**extra) -> _capture.Capture:
    body = {"id": "c1", "groups": "step,layer", "iterations": 3, "start_iteration": 5}
    return _capture.parse_capture({**body, **extra})


def _ack(run_dir, rank: int) -> dict:
    return json.loads(lay.capture_ack_file(run_dir, rank).read_text())


def test_non_exporting_rank_captures_exactly_the_window_with_its_own_exporter(
    make_settings, tmp_path
):
    # single_rank exports the last rank: rank 0 of 2 exports nothing.
    handle = telemetry.setup(
        make_settings(EXPORT_STRATEGY="single_rank", SPAN_GROUPS="default"),
        rank=0, world_size=2, run_dir=tmp_path,
    )  # fmt: skip
    assert not handle.exporting
    capture = _capture_request()
    _capture.CONTROL.schedule(capture)
    assert capture.exporter_started and _capture.AT == 5
    _iterations(1, 10)
    assert (capture.state, capture.first, capture.last) == ("done", 5, 7)
    assert _capture.AT == _capture.NEVER  # back to one compare that never fires
    assert not telemetry.is_enabled(G.LAYER)
    telemetry.shutdown(2.0)
    got = _captured(tmp_path, 0)
    assert sorted(got) == [5, 6, 7]
    want = sorted([SpanName.ITERATION, SpanName.LAYER_FORWARD])
    assert all(sorted(v) == want for v in got.values()), got
    ack = _ack(tmp_path, 0)
    assert (ack["state"], ack["first_iteration"], ack["last_iteration"]) == ("done", 5, 7)
    assert ack["exporter_started"] is True and ack["world_size"] == 2


def test_late_rank_captures_what_is_left_and_after_the_window_misses(make_settings, tmp_path):
    telemetry.setup(make_settings(SPAN_GROUPS="default"), rank=0, world_size=1, run_dir=tmp_path)
    _iterations(1, 5)
    capture = _capture_request()  # window 5-7, armed while the rank is past 5
    _capture.CONTROL.schedule(capture)
    _iterations(6, 9)
    assert (capture.state, capture.first, capture.last) == ("done", 6, 7)
    late = _capture_request(id="c2", start_iteration=2)
    _capture.CONTROL.schedule(late)
    _iterations(10, 11)
    assert late.state == "missed" and late.first is None
    telemetry.shutdown(2.0)
    assert sorted(_captured(tmp_path, 0)) == [6, 7]


def test_a_running_capture_is_never_replaced_and_the_run_ending_inside_it_ends_it(
    make_settings, tmp_path
):
    telemetry.setup(make_settings(SPAN_GROUPS="default"), rank=0, world_size=1, run_dir=tmp_path)
    capture = _capture_request(iterations=100)
    _capture.CONTROL.schedule(capture)
    _iterations(1, 6)
    _capture.CONTROL.schedule(_capture_request(id="other", start_iteration=8))
    assert _capture.CONTROL.capture is capture and capture.state == "running"
    telemetry.shutdown(2.0)
    assert (capture.state, capture.first, capture.last) == ("done", 5, 6)
    assert _ack(tmp_path, 0)["state"] == "done"


def test_seconds_window_ends_at_the_first_boundary_after_it(make_settings, tmp_path):
    telemetry.setup(make_settings(SPAN_GROUPS="default"), rank=0, world_size=1, run_dir=tmp_path)
    capture = _capture_request(iterations=None, seconds=0.3)
    _capture.CONTROL.schedule(capture)
    _iterations(1, 6)
    assert capture.state == "running"
    time.sleep(0.35)
    _iterations(7, 8)
    assert (capture.state, capture.first, capture.last) == ("done", 5, 6)


def test_watcher_ignores_stale_foreign_and_other_ranks_requests(tmp_path):
    path = tmp_path / lay.CAPTURE_REQUEST_FILE
    watcher = _capture.RequestWatcher(path, "run1", 1, started_ns=1000, on_recorded=lambda: None)
    _capture.CONTROL.reset()
    try:
        base = {"groups": "all", "iterations": 2, "start_iteration": 9, "created_ns": 2000}
        for n, request in enumerate(
            (
                {**base, "created_ns": 999},  # before this process: an earlier run
                {**base, "run_id": "run2"},
                {**base, "ranks": [0]},
            )
        ):
            path.write_text(json.dumps({**request, "id": f"r{n}"}))
            time.sleep(0.01)  # a new mtime
            watcher.poll()
            assert _capture.CONTROL.capture is None, request
        path.write_text(json.dumps({**base, "id": "ok", "ranks": [1]}))
        watcher.poll()
        assert _capture.CONTROL.capture is not None and _capture.CONTROL.capture.id == "ok"
    finally:
        _capture.CONTROL.reset()


def test_a_rank_that_cannot_build_its_exporter_acks_missed(make_settings, tmp_path, monkeypatch):
    telemetry.setup(
        make_settings(EXPORT_STRATEGY="single_rank", SPAN_GROUPS="default"),
        rank=0, world_size=2, run_dir=tmp_path,
    )  # fmt: skip
    from mlaunch.telemetry import _runtime

    def broken(*args, **kwargs):
        raise RuntimeError("no exporter")

    monkeypatch.setattr(_runtime, "Runtime", broken)
    capture = _capture_request()
    _capture.CONTROL.schedule(capture)
    assert capture.state == "missed" and "no exporter" in capture.note
    assert _capture.AT == _capture.NEVER
    assert _ack(tmp_path, 0)["state"] == "missed"
    _iterations(1, 8)  # training goes on untouched
    assert not telemetry.is_enabled(G.LAYER)


def test_the_worker_identity_is_derived_once_for_the_recorder_watcher_and_exporter(
    make_settings, tmp_path, monkeypatch
):
    """One run id choice per setup: the flight recorder, the request watcher, the progress beat
    and a capture's on-demand exporter all get the identity setup derived (a second derivation
    could pick another run id or directory where the environment changed in between)."""
    from mlaunch.settings import run_id

    calls = []
    real = run_id.choose_run_id

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_id, "choose_run_id", counted)
    monkeypatch.setenv(envcontract.RUN_DIR, str(tmp_path))  # under mlaunch train: the beat too
    telemetry.setup(
        make_settings(EXPORT_STRATEGY="single_rank", SPAN_GROUPS="default", RECORDER_GROUPS="layer"),
        rank=0, world_size=2, run_dir=tmp_path,
    )  # fmt: skip
    capture = _capture_request()
    _capture.CONTROL.schedule(capture)  # builds this rank's exporter for the capture
    assert capture.exporter_started
    _iterations(1, 8)
    assert capture.state == "done"
    assert telemetry.recorder_dump("request") > 0  # iteration 8's layer spans, recorded again
    telemetry.shutdown(2.0)
    assert len(calls) == 1
    assert sorted(_captured(tmp_path, 0)) == [5, 6, 7]
    # The exporter and the recorder name the same block trace: one identity.
    exported = otlp_json.read_spans(lay.traces_file(tmp_path, 0))
    recorded = otlp_json.read_spans(lay.recorder_file(tmp_path, 0))
    assert {s["trace_id"] for s in recorded} == {s["trace_id"] for s in exported}
    assert lay.heartbeat_file(tmp_path, 0).exists()
