"""One run model (``mlaunch.rundir.RunState``) behind every view, on real two-rank torchrun runs
of a ``--script`` worker that traces through ``mlaunch.telemetry`` (it runs until the test
touches its stop file, so no step of the test races the run's end):

- a live capture (``--groups all --iterations 3`` under ``per_step``, whose step spans are
  exported before the capture and carry no capture id) and a recorder dump (``--recorded
  --wait``): ``status``, ``status --json``, the watch's view, the report's marks and default
  window, and train's closing lines all name the same captures, phases and iterations, during
  the run and after it; after it no hang suspicion, the beats at the last iteration, no ack
  still ``listening``;
- ``--recorded`` refused (exit 2, nothing written) on a run without a flight recorder, and on a
  run stopped by SIGTERM.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch, progress

from mlaunch.cli.status_watch import render
from mlaunch.rundir import layout as lay
from mlaunch.slurm.watch import WatchState, snapshot
from mlaunch.trace.report import render_report

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "telemetry_script.py"


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def cli(*args: str, cwd: Path) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", *args], cwd=cwd, env=clean_env(COLUMNS="200"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out.returncode, out.stdout + out.stderr


def start(tmp_path: Path, *otel: str) -> tuple[subprocess.Popen, Path, Path]:
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    proc = mlaunch(
        "--script", str(SCRIPT), "--nproc-per-node", "2", "--device", "cpu",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-span-groups", "per_step",
        "--otel-export-strategy", "all_ranks", *otel,
        cwd=tmp_path, env=clean_env(SCRIPT_STOP_FILE=str(stop), SCRIPT_ITER_SECONDS="0.05",
                                    COLUMNS="200"),
    )  # fmt: skip
    wait_for(lambda: len(progress(run_dir)) >= 3 or proc.poll() is not None, "iterations")
    assert proc.poll() is None, proc.communicate()[0][-4000:]
    return proc, run_dir, stop


def views(run_dir: Path, tmp_path: Path) -> tuple[dict, str, str]:
    """``status --json``, ``status`` and the watch's view (one refresh, as text)."""
    code, out = cli("status", str(run_dir), "--json", cwd=tmp_path)
    assert code == 0, out
    st = json.loads(out)
    code, text = cli("status", str(run_dir), cwd=tmp_path)
    assert code == 0, text
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(snapshot(str(run_dir), tmp_path, WatchState()), 200))
    return st, text, console.export_text()


def capture_line(c: dict) -> str:
    """How ``status``, the watch and train's closing lines show one capture."""
    what = f"groups {c['groups']}" if c["groups"] is not None else "flight recorders"
    lo, hi = c["iterations"]
    where = f"iteration {lo}" if lo == hi else f"iterations {lo}-{hi}"
    return f"{c['id']} ({what} of every rank, {where}): {c['phase']}"


def test_every_view_reads_one_run_model_during_and_after_the_run(tmp_path):
    proc, run_dir, stop = start(
        tmp_path, "--otel-recorder-groups", "all", "--otel-recorder-slow-factor", "1000"
    )
    try:
        code, out = cli(
            "trace", "capture", str(run_dir), "--groups", "all", "--iterations", "3", "--wait",
            "--json", cwd=tmp_path,
        )  # fmt: skip
        assert code == 0, out
        live = json.loads(out)
        assert live["complete"] and set(live["outcome"]) == {"0", "1"}, live
        window = [live["start_iteration"], live["end_iteration"]]
        code, out = cli("trace", "capture", str(run_dir), "--recorded", "--wait", "--json",
                        cwd=tmp_path)  # fmt: skip
        assert code == 0, out
        rec = json.loads(out)
        assert rec["complete"] and set(rec["outcome"]) == {"0", "1"}, rec

        st, text, watched = views(run_dir, tmp_path)
        assert st["state"] == "running"
        captures = st["captures"]
        assert [(c["id"], c["phase"], c["groups"], c["ranks"]) for c in captures] == [
            (live["id"], "done", "all", None), (rec["id"], "done", None, None),
        ]  # fmt: skip
        assert captures[0]["iterations"] == window
        dumps = st["dumps"]
        assert sorted((d["rank"], d["trigger"]) for d in dumps) == [(0, "request"), (1, "request")]
        assert captures[1]["iterations"] == [
            min(d["iterations"][0] for d in dumps),
            max(d["iterations"][1] for d in dumps),
        ]
        for c in captures:
            assert f"capture:  {capture_line(c)}" in text
            assert f"capture: {capture_line(c)}" in watched
        assert "recorder: 2 dumps from ranks 0-1 (request)" in text
        assert "recorder: dumps from ranks 0-1" in watched
    finally:
        stop.touch()
    code, out = finish(proc)
    assert code == 0, out[-4000:]

    # After the run: the same captures, phases and iterations everywhere, and no hang line.
    st, text, watched = views(run_dir, tmp_path)
    assert st["state"] == "completed"
    assert st["captures"] == captures and st["dumps"] == dumps
    code, once = cli("status", str(run_dir), "--watch", cwd=tmp_path)  # not a terminal: once
    assert code == 0, once
    for c in captures:
        for view in (text, watched, once, out):
            assert capture_line(c) in view, view
    assert "recorder: 2 dumps from ranks 0-1 (request)" in out  # train's closing lines
    for view in (text, watched, once):
        assert "hang:" not in view and "last progress" not in view, view
    # The report's default window holds the capture, its mark the run model's iterations.
    report = render_report(run_dir)
    marks = {m.label: m.iterations for m in report.marks if m.kind == "capture"}
    assert marks[live["id"]] == tuple(window)
    assert any(a <= window[0] and window[1] <= b for a, b in report.window), report.window
    # Beats and acks end with the run: each rank's last iteration, and nothing listening.
    for rank in (0, 1):
        done = json.loads((run_dir / f"script-worker-rank{rank}.json").read_text())["iterations"]
        beat = json.loads(lay.heartbeat_file(run_dir, rank).read_text())
        assert (beat["iteration"], beat["ended"]) == (done, True), beat
        ack = json.loads(lay.capture_ack_file(run_dir, rank).read_text())
        assert ack["state"] == "done" and ack["ended_ns"], ack
    # A finished run takes no request: exit 2, nothing written.
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    code, out = cli("trace", "capture", str(run_dir), "--recorded", cwd=tmp_path)
    assert code == 2 and "completed" in out and "Traceback" not in out, out
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_recorded_is_refused_without_a_recorder_and_after_sigterm(tmp_path):
    proc, run_dir, stop = start(tmp_path)
    try:
        code, out = cli("trace", "capture", str(run_dir), "--recorded", "--wait", cwd=tmp_path)
        assert code == 2 and "no flight recorder" in out and "Traceback" not in out, out
        assert len(out.strip().splitlines()) == 1, out
        assert not (run_dir / lay.CAPTURE_REQUEST_FILE).exists()
        proc.send_signal(signal.SIGTERM)
        code, _ = finish(proc)
    finally:
        stop.touch()
        if proc.poll() is None:
            proc.kill()
    st = json.loads(cli("status", str(run_dir), "--json", cwd=tmp_path)[1])
    assert st["state"] not in ("running", "completed"), st
    code, out = cli("trace", "capture", str(run_dir), "--recorded", cwd=tmp_path)
    assert code == 2 and re.search(r"the run has \w+ \(it is not running\)", out), out
    assert not (run_dir / lay.CAPTURE_REQUEST_FILE).exists()
