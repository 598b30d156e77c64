"""``mlaunch.rundir``: the one atomic write and lock, and a capture's one life in the run model
(the files as workers write them; the real runs are tests/integration/test_run_model.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mlaunch.rundir import atomic
from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import append_line, dump_record
from mlaunch.rundir.state import RunState


def test_an_atomic_write_has_its_mode_from_the_start_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "sub" / "resolved.env"
    atomic.write_atomic(path, "SECRET=1\n", mode=0o600)
    assert path.read_text() == "SECRET=1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        atomic.write_atomic(path, object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError), atomic.atomic_path(tmp_path / "part.parquet") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["resolved.env"]
    assert not (tmp_path / "part.parquet").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_lock_held_by_another_process_is_busy(tmp_path):
    lock = tmp_path / ".replay.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys,time;fd=os.open(sys.argv[1],os.O_RDWR|os.O_CREAT);"
         "fcntl.flock(fd,fcntl.LOCK_EX);print('held',flush=True);sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(atomic.Busy), atomic.locked(lock, blocking=False):
            pass
    finally:
        holder.communicate("")
    with atomic.locked(lock, blocking=False) as fd:
        assert fd >= 0


def _request(run_dir: Path, **body) -> dict:
    req = {"id": "c1", "created_ns": 10, "run_id": "r", "ranks": None, "recorded": False,
           "groups": "all", "iterations": 3, "seconds": None, "start_iteration": 20, **body}  # fmt: skip
    atomic.write_json(run_dir / lay.CAPTURE_REQUEST_FILE, req)
    return req


def _ack(run_dir: Path, rank: int, **body) -> None:
    atomic.write_json(lay.capture_ack_file(run_dir, rank), {"rank": rank, **body})


def test_a_capture_has_one_life_from_the_files_the_workers_write(tmp_path):
    _request(tmp_path)

    def phase(ended: bool = False) -> tuple[str, list[int] | None]:
        c = RunState.read(tmp_path, ended=ended).as_json()["captures"][-1]
        return c["phase"], c["iterations"]

    assert phase() == ("requested", [20, 22])  # the scheduled window before any answer
    assert phase(ended=True)[0] == "missed"
    _ack(tmp_path, 0, id="c1", state="scheduled")
    _ack(tmp_path, 1, id="c1", state="scheduled")
    assert phase() == ("scheduled", [20, 22])
    _ack(tmp_path, 0, id="c1", state="running", first_iteration=21)
    assert phase()[0] == "running"
    _ack(tmp_path, 0, id="c1", state="done", first_iteration=21, last_iteration=23)
    _ack(tmp_path, 1, id="c1", state="done", first_iteration=21, last_iteration=23)
    assert phase() == ("done", [21, 23])  # what the ranks covered wins over the schedule
    # A nemo-lens worker that cannot capture says why: refused.
    _request(tmp_path, id="c2", start_iteration=None, start_ns=5)
    for rank in (0, 1):
        path = (
            tmp_path / lay.TELEMETRY_DIR / lay.LENS_CAPTURE_ACK_TEMPLATE.format(rank=rank, id="c2")
        )
        atomic.write_json(
            path, {"id": "c2", "rank": rank, "applied": False, "reason": "no exporter"}
        )
    state = RunState.read(tmp_path, ended=False)
    assert state.capture is not None and (state.capture.phase, state.capture.note) == (
        "refused", "no exporter",
    )  # fmt: skip


def test_a_recorder_request_is_done_once_a_rank_dumped_after_it(tmp_path):
    atomic.write_json(tmp_path / lay.CAPTURE_REQUEST_FILE,
                      {"id": "d1", "created_ns": 100, "ranks": None, "recorded": True})  # fmt: skip
    assert RunState.read(tmp_path, ended=False).capture.phase == "requested"  # type: ignore[union-attr]
    line = dump_record(1, 0, "request", 40, [7, 8, 9])
    append_line(lay.recorder_index_file(tmp_path, 1), line)
    state = RunState.read(tmp_path, ended=False)
    assert state.as_json()["captures"] == [
        {"id": "d1", "phase": "done", "groups": None, "iterations": [7, 9], "ranks": None}
    ]
    assert state.window_includes() == [(7, 9)]
    assert [d["trigger"] for d in state.as_json()["dumps"]] == ["request"]


def test_the_hook_writes_its_ack_through_rundir_without_mlaunch_installed(tmp_path):
    # A nemo-lens worker's interpreter has no mlaunch (-S): the hook loads rundir by path.
    import mlaunch.lens_hook.capture as hook

    code = (
        "import importlib.util as u, sys;"
        "assert u.find_spec('mlaunch') is None;"
        f"spec = u.spec_from_file_location('h', {str(Path(hook.__file__))!r});"
        "h = u.module_from_spec(spec); spec.loader.exec_module(h);"
        "h._load_mlaunch();"
        "from mlaunch.rundir.atomic import write_json;"
        f"write_json({str(tmp_path / 'ack.json')!r}, {{'id': 'x'}})"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "ack.json").read_text()) == {"id": "x"}


def test_a_capture_stays_in_the_run_model_when_the_hang_watchdog_replaces_its_request(tmp_path):
    from mlaunch.launcher.hang_report import request_hang_spans

    _request(tmp_path)
    for rank in (0, 1):
        _ack(tmp_path, rank, id="c1", state="done", first_iteration=20, last_iteration=22)
    request_hang_spans(tmp_path, "r")
    assert json.loads((tmp_path / lay.CAPTURE_REQUEST_FILE).read_text())["trigger"] == "hang"
    assert RunState.read(tmp_path, ended=True).as_json()["captures"] == [
        {"id": "c1", "phase": "done", "groups": "all", "iterations": [20, 22], "ranks": None}
    ]


def test_the_lens_hook_in_an_mlaunch_worker_never_answers_for_it(tmp_path):
    # The hook in a worker that runs mlaunch.telemetry refuses iteration windows at once; the
    # mlaunch worker takes them a moment later: the refusal must not end the capture.
    _request(tmp_path)
    for rank in (0, 1):
        _ack(tmp_path, rank, state="listening", id=None, pid=100 + rank)
        path = (
            tmp_path / lay.TELEMETRY_DIR / lay.LENS_CAPTURE_ACK_TEMPLATE.format(rank=rank, id="c1")
        )
        atomic.write_json(path, {"id": "c1", "rank": rank, "pid": 100 + rank, "applied": False,
                                 "reason": "nemo-lens workers capture by time"})  # fmt: skip
    assert RunState.read(tmp_path, ended=False).capture.phase == "requested"  # type: ignore[union-attr]


def test_the_launcher_record_and_hang_reports_read_back_typed_in_the_run_model(tmp_path):
    """What the launcher writes (its record through restarts, a hang and the end; each node's
    hang report) reads back as the typed records RunState carries: one reader for every view."""
    import time
    from types import SimpleNamespace

    from mlaunch.launcher.hang_report import HangReport, RankView, write_report
    from mlaunch.launcher.run import LauncherRecord, RankFailure, Restart
    from mlaunch.rundir.records import LauncherAttempts, LauncherFailure, LauncherRestart

    started = time.time()
    plan = SimpleNamespace(
        run_dir=tmp_path, run_id="r1", settings=SimpleNamespace(launch=SimpleNamespace(node_rank=0))
    )
    rec = LauncherRecord(plan, started)  # type: ignore[arg-type]
    running = RunState.read(tmp_path)
    assert isinstance(running.launcher, LauncherAttempts) and not running.ended
    assert running.launcher.started == started and running.launcher.attempt == 0
    rec.restarted(Restart(1, "rank 1 killed by SIGKILL", 1, started + 1))
    for node in (1, 0):
        write_report(tmp_path, HangReport(
            started + 2 + node, node, 1, 5.0, 6.0, "heartbeats", "stop", "rank 1 waits",
            [RankView(rank=node, iteration=3, span="forward")],
        ))  # fmt: skip
    rec.ended(1, None, [RankFailure(1, 1, 0, "ValueError", "boom", tmp_path / "w.log")])
    state = RunState.read(tmp_path)
    la = state.launcher
    assert la is not None and state.ended and la.attempt == 1 and la.exit_code == 1
    assert la.restarts == (LauncherRestart(1, 1, "rank 1 killed by SIGKILL", started + 1),)
    assert la.failures == (LauncherFailure(1, 1, 0, "ValueError", "boom", str(tmp_path / "w.log")),)
    assert [(r.node, r.attempt, r.action) for r in state.hang_reports] == [
        (0, 1, "stop"),
        (1, 1, "stop"),
    ]
    assert [r["rank"] for h in state.hang_reports for r in h.ranks] == [0, 1]
    # An earlier launch's reports are not this one's.
    assert RunState.read(tmp_path, since=started + 10).hang_reports == []
    lay.launcher_record_file(tmp_path, 0).write_text('{"started": "yesterday"}')
    assert RunState.read(tmp_path).launcher is None


def test_flock_has_one_implementation_in_the_tree():
    """Every lock (the launcher's lifetime lock, the trace store's, the run directory's) goes
    through rundir.atomic: one flock, one Busy, one rule for who holds it."""
    root = Path(__file__).resolve().parents[2] / "mlaunch"
    users = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "fcntl.flock" in p.read_text(encoding="utf-8")
    )
    assert users == ["rundir/atomic.py"]


def test_envcontract_names_environment_variables_only():
    """The run directory's names and records have one home (mlaunch.rundir): envcontract no
    longer re-exports them, so no call site reaches them a second way."""
    from mlaunch import envcontract as ec
    from mlaunch.rundir import records

    names = {*lay.__all__, *records.__all__} - {
        "default_run_dir"
    }  # envcontract's run_dir() uses it
    leaked = sorted(n for n in names if hasattr(ec, n))
    assert leaked == []
