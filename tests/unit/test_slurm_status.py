"""``mlaunch status`` from a run directory and what SLURM says (SLURM faked here; the real one
is in tests/slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mlaunch.slurm import status as st
from mlaunch.slurm.client import SlurmJobInfo, parse_scontrol

ROOT = Path(__file__).resolve().parents[2]


def info(state: str, restarts: int = 0, start: str = "2000-01-01T00:00:00") -> SlurmJobInfo:
    return SlurmJobInfo(
        job_id="42", state=state, reason="None", exit_code="0:0", restarts=restarts,
        nodes="n[1-2]", start=start, end="", elapsed="00:01:00", name="mlaunch-tiny",
        stdout="", work_dir="", source="scontrol",
    )  # fmt: skip


def run_dir(tmp_path: Path, last: int, total: int = 10) -> Path:
    d = tmp_path / "runs" / "42"
    d.mkdir(parents=True)
    (d / "slurm-job.json").write_text(json.dumps({"job_id": "42"}))
    (d / "resolved.json").write_text(
        json.dumps({"run_id": "42", "settings": {"launch.nproc_per_node": {"value": 1}}})
    )
    records = [{"iteration": i, "train_iters": total, "loss": 1.0, "time": time.time()}
               for i in range(1, last + 1)]  # fmt: skip
    (d / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_a_stop_before_the_last_iteration_without_errors_is_preempted(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=4)
    monkeypatch.setattr(st, "job_info", lambda job_id: info("FAILED"))
    s = st.job_status(str(d), tmp_path)
    assert (s.job_id, s.state, s.incarnation) == ("42", "preempted", 1)
    assert "[SLURM: FAILED]" in st.status_text(s) and "scontrol requeue 42" in st.status_text(s)


def test_the_first_failed_rank_is_the_root_cause_found_in_its_nodes_logs(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=2)
    now = time.time()
    for rank, when, msg in ((0, now + 1, "Connection closed by peer"), (1, now, "injected")):
        (d / f"error-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "exception_type": "RuntimeError", "message": msg, "iteration": 3,
             "time": when}))  # fmt: skip
    # torchrun's rendezvous put rank 1 on SLURM's node 0: its log says so.
    for node, rank in ((0, 1), (1, 0)):
        log = d / "logs" / f"node{node}" / "x" / "attempt_0" / "0" / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(f"[rank{rank}]: RuntimeError: boom\n")
    monkeypatch.setattr(st, "job_info", lambda job_id: info("FAILED"))
    s = st.job_status("42", tmp_path)  # by job id: runs/42 under the current directory
    assert s.state == "failed"
    assert [(f.rank, f.node) for f in s.failures] == [(1, 0), (0, 1)]
    assert "failed:   rank 1 (node 0) at iteration 3: RuntimeError: injected" in st.status_text(s)


def test_without_slurm_the_run_directory_tells(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=10)
    monkeypatch.setattr(st, "job_info", lambda job_id: None)
    assert st.job_status(str(d), tmp_path).state == "completed"
    monkeypatch.setattr(st, "job_info", lambda job_id: info("PENDING", restarts=1))
    s = st.job_status(str(d), tmp_path)
    assert (s.state, s.incarnation) == ("queued", 2)


def test_neither_a_run_directory_nor_a_job_is_exit_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "status", "no/such/dir"], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith("RUN_DIR|JOB_ID: ")
    assert "Traceback" not in out.stderr


def test_scontrol_values_may_hold_spaces():
    line = "JobId=7 JobName=a b JobState=RUNNING Reason=None Comment=two words StdOut=/x y/o.out"
    f = parse_scontrol(line)
    assert f["JobName"] == "a b" and f["Comment"] == "two words" and f["StdOut"] == "/x y/o.out"


def test_status_imports_no_settings_layer_or_torch():
    code = (
        "import sys, mlaunch.cli.status, mlaunch.slurm.status;"
        "print([m for m in sys.modules if m.split('.')[0] in ('pydantic', 'torch')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def _stop_request(d: Path, at: float, now: bool = False) -> None:
    body = {"requested_at": at, "now": now, "uid": 0, "user": "alice", "host": "h", "pid": 1,
            "job_id": "42"}  # fmt: skip
    (d / "stop-request.json").write_text(json.dumps(body))


def _checkpoint(d: Path, iteration: int) -> None:
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def test_a_stop_the_user_asked_for_is_stopped_not_preempted(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=4)
    _checkpoint(d, 4)
    _stop_request(d, time.time())
    monkeypatch.setattr(st, "job_info", lambda job_id: info("FAILED"))
    s = st.job_status(str(d), tmp_path)
    assert (s.state, s.resume_from, s.stop["user"]) == ("stopped", 4, "alice")
    text = st.status_text(s)
    assert "stopped:  mlaunch stop by alice at" in text
    assert "resumable: requeued (scontrol requeue 42), the job resumes from the checkpoint of" \
        " iteration 4" in text  # fmt: skip
    assert "stopped on a signal" not in text  # not the preemption's words


def test_an_earlier_incarnations_stop_request_is_not_this_ones(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=4)
    _checkpoint(d, 4)
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 60))
    _stop_request(d, time.time() - 3600)  # a stop, then a requeue an hour ago
    monkeypatch.setattr(st, "job_info", lambda job_id: info("FAILED", start=started))
    s = st.job_status(str(d), tmp_path)
    assert (s.state, s.stop, s.resume_from) == ("preempted", None, None)


def test_a_running_job_with_a_stop_request_is_stopping(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=2)
    _stop_request(d, time.time(), now=True)
    monkeypatch.setattr(st, "job_info", lambda job_id: info("RUNNING"))
    s = st.job_status(str(d), tmp_path)
    assert s.state == "running"
    assert "stopping: mlaunch stop --now by alice at" in st.status_text(s)


def test_a_stop_with_no_checkpoint_is_not_resumable(tmp_path, monkeypatch):
    d = run_dir(tmp_path, last=4)
    _stop_request(d, time.time(), now=True)
    monkeypatch.setattr(st, "job_info", lambda job_id: info("FAILED"))
    s = st.job_status(str(d), tmp_path)
    assert (s.state, s.resume_from) == ("stopped", None)
    assert "not resumable: no checkpoint was saved (--now)" in st.status_text(s)


def test_stop_refuses_a_queued_job_and_another_users_job_writing_nothing(tmp_path, monkeypatch):
    from dataclasses import replace

    from mlaunch.launcher.stop import StopRefused
    from mlaunch.slurm import stop as sstop

    d = run_dir(tmp_path, last=2)
    before = sorted(p.name for p in d.iterdir())
    sent: list[str] = []
    monkeypatch.setattr(sstop, "signal_batch", lambda job_id, sig: sent.append(job_id))
    for job, why in (
        (info("PENDING"), "job 42 is queued, not running: there is nothing to save"),
        (replace(info("RUNNING"), user_id=os.getuid() + 1), "job 42 belongs to"),
        (info("COMPLETED"), "job 42 is completed, not running: nothing to stop"),
    ):
        monkeypatch.setattr(st, "job_info", lambda job_id, job=job: job)
        try:
            sstop.stop("42", tmp_path, now=False, timeout_s=1, say=lambda _: None)
        except StopRefused as exc:
            assert why in str(exc), exc
        else:
            raise AssertionError(f"{job.state}: not refused")
    assert sent == [] and sorted(p.name for p in d.iterdir()) == before
