"""``mlaunch stop`` against real ``mlaunch train`` runs (torchrun on gloo, the built-in trainer): the
graceful stop saves the iteration reached and status says stopped and resumable, the resume
continues from it, ``--now`` saves nothing, two nodes on one machine stop with one command, and
refusals (another user, a finished run, an unknown target) change nothing."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch_runs import (
    TIMEOUT_S,
    clean_env,
    finish,
    free_port,
    mlaunch,
    status,
    status_text,
    train_records,
)
from support.trainer_runs import IDLE_PAUSE_S

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: The exit code docs/train.md gives a launcher stopped by SIGTERM (128 + 15).
SIGTERM_EXIT = 128 + signal.SIGTERM


def stop(*args: str, cwd: Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``mlaunch stop ARGS`` (``prefix``: a command that runs it, e.g. as another user)."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "mlaunch", "stop", *args], cwd=cwd, env=clean_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def wait_records(run_dir: Path, n: int, proc: subprocess.Popen) -> int:
    """Wait until the run has ``n`` training records (or more); the newest iteration."""
    deadline = time.monotonic() + TIMEOUT_S
    while len(train_records(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.1)
    return train_records(run_dir)[-1]["iteration"]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))


def test_stop_saves_and_resumes_then_stop_now_saves_nothing_and_refusals_change_nothing(tmp_path):
    run_dir = tmp_path / "r"
    # Saves only when stopped (the interval is past the end); each iteration idles (test hook).
    args = ["--run-dir", str(run_dir), "--save-interval", "1000", "--log-interval", "1",
            "--train-iters", "400"]  # fmt: skip
    env = clean_env(MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S)
    proc = mlaunch(*args, cwd=tmp_path, env=env)
    reached = wait_records(run_dir, 3, proc)

    # Another user (real uid nobody; effective uid still root, so only mlaunch's check refuses):
    # exit 2, no request written, no signal: the run goes on.
    other = stop(str(run_dir), cwd=tmp_path, prefix=("setpriv", "--ruid=nobody"))
    assert other.returncode == 2, other.stdout + other.stderr
    assert "belongs to user root (uid 0)" in other.stderr and "only the user" in other.stderr
    assert "Traceback" not in other.stderr
    assert not (run_dir / "stop-request.json").exists()
    wait_records(run_dir, reached + 2, proc)  # still training

    out = stop(str(run_dir), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGTERM to node 0's launcher" in out.stdout
    assert "waiting for 1 launcher(s) to finish the iteration, save and exit" in out.stdout
    assert proc.poll() is not None  # stop returned once the launcher had exited
    code, output = finish(proc)
    assert code == SIGTERM_EXIT, output
    assert (
        "SIGTERM from mlaunch stop by root: asking the workers to finish the iteration, save"
        in output
    )
    last = train_records(run_dir)[-1]["iteration"]
    assert checkpoints(run_dir) == [f"iter_{last:07d}"]
    assert (
        run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    ).read_text().strip() == str(last)
    st = status(run_dir)
    assert st["state"] == "stopped", st
    assert st["resume_from"] == last and st["stop"]["now"] is False and st["failures"] == []
    text = status_text(run_dir)
    assert "stopped:  mlaunch stop by root" in text
    assert f"--run-dir {run_dir} resumes from the checkpoint of iteration {last}" in text
    assert "stopped" in out.stdout and "resumable" in out.stdout  # stop's own closing status

    # Resume: the same run directory continues from the checkpoint the stop saved.
    proc = mlaunch(*args, cwd=tmp_path, env=env)
    wait_records(run_dir, last + 3, proc)
    its = [r["iteration"] for r in train_records(run_dir)]
    assert its[last : last + 3] == [last + 1, last + 2, last + 3], its
    assert status(run_dir)["state"] == "running"  # the first stop's request is not this launch's

    # --now: the workers are killed, nothing saved; status says so and names the older one.
    out = stop(str(run_dir), "--now", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "to kill the workers, nothing saved" in out.stdout
    code, output = finish(proc)
    assert code == SIGTERM_EXIT, output
    assert (
        "SIGTERM from mlaunch stop --now by root: killing the workers (SIGKILL); nothing is saved"
        in output
    )
    reached = train_records(run_dir)[-1]["iteration"]
    assert reached > last + 2
    assert checkpoints(run_dir) == [f"iter_{last:07d}"]  # no new save
    st = status(run_dir)
    assert st["state"] == "stopped" and st["stop"]["now"] is True and st["resume_from"] == last, st
    text = status_text(run_dir)
    assert "stopped:  mlaunch stop --now by root" in text
    assert "resumable from an older checkpoint: --now saved nothing" in text
    assert f"from iteration {last}, saved before the stop (iterations {last + 1}-{reached}" in text

    # A finished run: exit 2 with the reason, nothing written.
    before = {p: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    again = stop(str(run_dir), cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"run {run_dir} is stopped, not running: nothing to stop" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before


def test_an_unknown_target_is_refused_and_nothing_is_written(tmp_path):
    for target, why in (
        (str(tmp_path / "nope"), "is neither a run directory nor a SLURM job id"),
        ("987654", "job 987654: SLURM does not know it and there is no runs/987654 here"),
    ):
        out = stop(target, cwd=tmp_path)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.startswith("RUN_DIR|JOB_ID: ") and why in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_two_nodes_on_one_machine_stop_with_one_command(tmp_path):
    port = free_port()
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "twonodes", "--train-iters", "400", "--global-batch-size", "4",
        "--save-interval", "1000", "--log-interval", "1",
    ]  # fmt: skip
    env = clean_env(MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S)
    procs = [mlaunch(*common, "--node-rank", str(i), cwd=tmp_path, env=env) for i in (0, 1)]
    run_dir = tmp_path / "runs" / "twonodes"
    wait_records(run_dir, 3, procs[0])
    out = stop(str(run_dir), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "node 0's launcher" in out.stdout and "node 1's launcher" in out.stdout
    assert "waiting for 2 launcher(s)" in out.stdout
    for proc in procs:
        code, output = finish(proc)
        assert code == SIGTERM_EXIT, output
    last = train_records(run_dir)[-1]["iteration"]
    assert checkpoints(run_dir) == [f"iter_{last:07d}"]
    st = status(run_dir)
    assert st["state"] == "stopped" and st["resume_from"] == last, st


def test_a_run_that_does_not_end_in_time_is_exit_1_naming_what_still_runs(tmp_path):
    # A launcher that takes SIGTERM and carries on (a worker stuck in its save, say): a real
    # process that handles SIGTERM and ignores it, with the record a launcher writes.
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: None);"
        "open(sys.argv[1], 'w').close(); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready), "mlaunch"])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        record = {"pid": proc.pid, "host": socket.gethostname(), "node": 0,
                  "started": time.time(), "ended": None}  # fmt: skip
        (run_dir / "launcher-node0.json").write_text(json.dumps(record))
        out = stop(str(run_dir), "--timeout", "2", cwd=tmp_path)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"SIGTERM to node 0's launcher (pid {proc.pid}" in out.stdout
        assert (
            f"error: run {run_dir} has not ended after 2 s (still running: node 0's launcher"
            f" (pid {proc.pid}" in out.stderr
        ), out.stderr
        assert f"`mlaunch stop --now {run_dir}`" in out.stderr and "Traceback" not in out.stderr
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
