"""The worker's side of the hang watchdog: the request watcher writes the progress beat and
answers a ``trigger: "hang"`` capture request itself, off a training thread that is stuck inside
its spans: the open-span stack of every thread and the recorder's ring are written from there."""

from __future__ import annotations

import json
import os
import threading
import time

from mlaunch import envcontract, telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay
from mlaunch.telemetry import _capture


def _request(run_dir, **body) -> None:
    body = {"id": "h1", "created_ns": time.time_ns(), "run_id": "testrun", "ranks": None, **body}
    (run_dir / lay.CAPTURE_REQUEST_FILE).write_text(json.dumps(body))


def _stopped_watcher() -> _capture.RequestWatcher:
    """The process's watcher, its thread stopped: the test calls it (no second caller races)."""
    watcher = _capture.CONTROL.watcher
    assert watcher is not None
    watcher.halt()
    watcher.join(5)
    return watcher


def test_a_hang_request_is_answered_while_the_training_thread_is_blocked(make_settings, tmp_path):
    settings = make_settings(EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="all")
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    watcher = _stopped_watcher()
    for it in (1, 2, 3):
        telemetry.set_iteration(it)
        with telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: it}):
            pass
    inside, release = threading.Event(), threading.Event()

    def training() -> None:
        telemetry.set_iteration(4)
        with (
            telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: 4}),
            telemetry.span(G.DATA_LOADING, SpanName.GET_BATCH),
        ):
            inside.set()
            release.wait(60)  # stuck, as a hung rank is

    thread = threading.Thread(target=training, name="trainer")
    thread.start()
    try:
        assert inside.wait(30)
        _request(tmp_path, recorded=True, trigger="hang", open_spans=True)
        watcher.poll()
        body = json.loads((tmp_path / "hang" / "spans-rank0.json").read_text())
        stuck = next(t for t in body["threads"] if t["thread"] == "trainer")
        assert [s["name"] for s in stuck["spans"]] == [SpanName.ITERATION, SpanName.GET_BATCH]
        assert stuck["spans"][0]["attributes"][Attr.ITERATION] == 4
        assert all(isinstance(s["start_ns"], int) for s in stuck["spans"])
        assert body["request"] == "h1" and body["iteration"] == 4 and body["pid"] == os.getpid()
        # The ring went out at once, not at an iteration boundary the stuck thread never reaches.
        dumped = otlp_json.read_spans(lay.recorder_file(tmp_path, 0))
        done = {
            s["attributes"].get(Attr.ITERATION) for s in dumped if s["name"] == SpanName.ITERATION
        }
        assert {1, 2, 3} <= done
        assert {s["attributes"][Attr.RECORDER_TRIGGER] for s in dumped} == {"hang"}
    finally:
        release.set()
        thread.join(30)


def test_a_hang_request_of_an_earlier_incarnation_is_ignored(make_settings, tmp_path):
    telemetry.setup(
        make_settings(EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="all"),
        rank=0, world_size=2, run_dir=tmp_path,
    )  # fmt: skip
    watcher = _stopped_watcher()
    _request(tmp_path, created_ns=1, trigger="hang", open_spans=True)
    watcher.poll()
    assert not (tmp_path / "hang").exists()


def test_under_mlaunch_every_rank_keeps_a_progress_beat_even_with_telemetry_off(
    make_settings, tmp_path, monkeypatch
):
    monkeypatch.setenv(envcontract.RUN_DIR, str(tmp_path))
    telemetry.setup(make_settings(ENABLED="false"), rank=1, world_size=2, run_dir=tmp_path)
    watcher = _stopped_watcher()
    beat = lay.heartbeat_file(tmp_path, 1)
    watcher.beat()
    assert not beat.exists()  # no iteration yet
    telemetry.set_iteration(12)
    watcher.beat()
    first = json.loads(beat.read_bytes())
    assert first["iteration"] == 12 and first["rank"] == 1 and first["pid"] == os.getpid()
    telemetry.set_iteration(13)
    watcher.beat()  # rewritten in place: one JSON object, no stale tail
    assert json.loads(beat.read_bytes())["iteration"] == 13


def test_a_rank_whose_setup_failed_says_why_in_its_first_beat_before_any_iteration(
    make_settings, tmp_path, monkeypatch
):
    monkeypatch.setenv(envcontract.RUN_DIR, str(tmp_path))
    beat = lay.heartbeat_file(tmp_path, 0)
    beat.parent.mkdir(parents=True)
    beat.write_text("x" * 600)  # an earlier process's longer beat: never a stale tail
    # A setting only this worker's code gets wrong (its save interval as text): the runtime
    # cannot be built, telemetry is off, training goes on.
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path, save_interval="10")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            first = json.loads(beat.read_bytes())
            break
        except ValueError:
            time.sleep(0.02)
    reason = first["telemetry_off"]
    assert reason.startswith("setup failed (TypeError: ") and first["iteration"] is None
    watcher = _stopped_watcher()
    telemetry.set_iteration(7)
    watcher.beat()  # every later beat keeps the reason
    later = json.loads(beat.read_bytes())
    assert later["iteration"] == 7 and later["telemetry_off"] == reason
