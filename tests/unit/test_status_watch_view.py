"""``mlaunch status --watch`` on a SLURM job id whose run directory is shared (SLURM faked; the
real terminal and a real run are tests/integration/test_status_watch.py): the view reads the
ranks, goodput, hang timeout, hang report, capture request and recorder dumps from the run
directory, and ends when SLURM says the job ended."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.synthetic_traces import TraceBuilder

from mlaunch.cli import status_watch
from mlaunch.model.spans import Attr, ResourceAttr, SpanName
from mlaunch.slurm import status as st
from mlaunch.slurm import watch as w
from mlaunch.slurm.client import SlurmJobInfo

pytestmark = pytest.mark.slurm


def info(state: str) -> SlurmJobInfo:
    return SlurmJobInfo(
        job_id="42", state=state, reason="None", exit_code="0:0", restarts=0, nodes="n[1-2]",
        start="2000-01-01T00:00:00", end="", elapsed="00:01:00", name="mlaunch-tiny", stdout="",
        work_dir="", source="scontrol",
    )  # fmt: skip


def shared_run_dir(tmp_path: Path, train_iters: int = 10) -> Path:
    """runs/42 as a 2-rank SLURM job leaves it: records, progress, both ranks' traces."""
    d = tmp_path / "runs" / "42"
    b = TraceBuilder(world_size=2, run_id="42")
    now_ms = (time.time_ns() - 1_700_000_000_000_000_000) / 1e6
    for r in range(2):
        b.resources[r] = {**b.resource(r), ResourceAttr.BATCH_SIZE: 8,
                          ResourceAttr.SEQUENCE_LENGTH: 32}  # fmt: skip
        for it in (1, 2):
            t = now_ms - 3000 + it * 1000
            b.span(r, SpanName.ITERATION, t, t + 500, attrs={Attr.ITERATION: it})
            b.span(r, SpanName.GRAD_SYNC_FINISH, t + 400, t + 500)
    b.write_run_dir(d)
    (d / "slurm-job.json").write_text(json.dumps({"job_id": "42"}))
    settings = {"launch.nproc_per_node": {"value": 1}, w.HANG_TIMEOUT_SETTING: {"value": 300}}
    (d / "resolved.json").write_text(json.dumps({"run_id": "42", "settings": settings}))
    records = [{"iteration": i, "train_iters": train_iters, "loss": 1.0, "step_ms": 500.0,
                "time": time.time() - 2 + i} for i in (1, 2)]  # fmt: skip
    (d / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    (d / "capture-request.json").write_text(json.dumps(
        {"id": "cap-1", "created_ns": time.time_ns(), "run_id": "42", "ranks": None,
         "recorded": True}))  # fmt: skip
    return d


def test_a_slurm_job_id_shows_its_shared_run_directory(tmp_path, monkeypatch):
    d = shared_run_dir(tmp_path)
    monkeypatch.setattr(st, "job_info", lambda job_id: info("RUNNING"))
    state = w.WatchState()
    snap = w.snapshot("42", tmp_path, state)
    assert snap.live and snap.status.state == "running" and snap.status.run_dir == str(d)
    assert [(r.rank, r.iteration) for r in snap.ranks] == [(0, 2), (1, 2)]
    assert snap.ranks[0].step_ms == pytest.approx(500.0)
    assert snap.ranks[0].tokens_per_s == pytest.approx(8 * 32 / 0.5)
    assert snap.iteration == 2 and snap.train_iters == 10
    assert snap.hang_timeout == "300"
    assert snap.capture is not None and snap.capture["id"] == "cap-1"
    assert snap.recorder_writing == [] and snap.recorder_dumps == []
    # A recorder file that grows between refreshes is a dump being written.
    rec = d / "telemetry" / "recorder-rank1.jsonl"
    rec.write_text("{}\n")
    w.snapshot("42", tmp_path, state)
    rec.write_text("{}\n{}\n")
    snap = w.snapshot("42", tmp_path, state)
    assert snap.recorder_writing == [1] and snap.recorder_dumps == [1]
    text = _text(snap)
    assert "job 42 (mlaunch-tiny): running" in text
    assert "hang timeout 300 s" in text
    assert "capture: cap-1 (flight recorders of every rank" in text
    assert "recorder: ranks 1 writing their dumps" in text


def test_a_hang_report_shows_its_verdict_and_where_each_rank_is(tmp_path, monkeypatch):
    shared_run_dir(tmp_path)
    monkeypatch.setattr(st, "job_info", lambda job_id: info("RUNNING"))
    real = st.job_status

    @dataclass
    class WithHang:
        inner: Any

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def as_json(self) -> dict[str, Any]:
            hang = {"detected_at": 1.0, "verdict": "rank 1: in megatron.data.get_batch",
                    "ranks": [{"rank": 1, "span": "megatron.data.get_batch", "iteration": 3,
                               "frame": "data.py:10 batch"}]}  # fmt: skip
            return {**self.inner.as_json(), "hang": hang}

    monkeypatch.setattr(w, "job_status", lambda t, c: WithHang(real(t, c)))
    snap = w.snapshot("42", tmp_path, w.WatchState())
    assert [(r.rank, r.span, r.current) for r in snap.ranks][1] == (
        1,
        "megatron.data.get_batch",
        True,
    )
    text = _text(snap)
    assert "hang detected: rank 1: in megatron.data.get_batch" in text
    assert "in megatron.data.get_batch" in text


def test_the_watch_ends_when_slurm_says_the_job_ended(tmp_path, monkeypatch, capsys):
    shared_run_dir(tmp_path, train_iters=2)
    states = iter(["RUNNING", "RUNNING", "COMPLETED"])
    last = ["RUNNING"]

    def job_info(job_id: str) -> SlurmJobInfo:
        last[0] = next(states, last[0])
        return info(last[0])

    monkeypatch.setattr(st, "job_info", job_info)
    monkeypatch.setattr(w, "REFRESH_S", 0.01)
    assert status_watch.watch("42", tmp_path) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "the run ended: completed"
    assert "job 42 (mlaunch-tiny): completed" in out  # the final view stays


def test_a_scattered_straggler_keeps_the_view_within_the_width(tmp_path, monkeypatch):
    # Rank 1 reaches the all-reduce 50 ms late at every odd one of 200 iterations: listed as
    # runs, its iterations made the straggler line grow with the run (wrapping over many lines).
    d = tmp_path / "runs" / "42"
    b = TraceBuilder(world_size=2, run_id="42")
    now_ms = (time.time_ns() - 1_700_000_000_000_000_000) / 1e6
    for it in range(1, 201):
        t = now_ms - 300_000 + it * 1000
        for r in range(2):
            late = 50 if r == 1 and it % 2 else 0
            b.span(r, SpanName.ITERATION, t, t + 500, attrs={Attr.ITERATION: it})
            b.span(r, SpanName.GRAD_SYNC_FINISH, t + 400 + late, t + 460,
                   attrs={Attr.ITERATION: it})  # fmt: skip
    b.write_run_dir(d)
    (d / "slurm-job.json").write_text(json.dumps({"job_id": "42"}))
    monkeypatch.setattr(st, "job_info", lambda job_id: info("RUNNING"))
    snap = w.snapshot("42", tmp_path, w.WatchState())
    assert snap.straggler is not None and snap.straggler["rank"] == 1
    assert len(snap.straggler["iterations"]) > 50
    for width in (80, 100):
        text = _text(snap, width)
        assert max(map(len, text.splitlines())) <= width, text
        at = next(i for i, ln in enumerate(text.splitlines()) if ln.startswith("straggler:"))
        assert text.splitlines()[at + 1].startswith("  iterations ")
        assert " in 1-" in text.splitlines()[at + 1] and "1, 3, 5, " in text
        assert not text.splitlines()[at + 2].startswith(" "), text  # two lines, whatever the run


def _text(snap: w.Snapshot, width: int = 160) -> str:
    from rich.console import Console

    con = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    con.print(status_watch.render(snap, con.width))
    return con.export_text()
