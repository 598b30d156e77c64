"""``mlaunch status RUN_DIR`` outside SLURM, and what ``mlaunch train`` says while it runs: real
torchrun runs ended each way a run ends (completed after a restart, still running, preempted by
SIGTERM without a save, a failed script, a launcher killed by SIGKILL), each read back with
``mlaunch status --json`` from the launcher's record and job trace. (Preempted by SIGTERM with a
checkpoint: test_launch_runs.py's SIGTERM test reads its run's status.)"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from support.launch_runs import (
    TIMEOUT_S,
    clean_env,
    finish,
    mlaunch,
    status,
    status_text,
    train_records,
)
from support.trainer_runs import IDLE_PAUSE_S

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: Rank 1 of attempt 0 SIGKILLs itself; every worker of attempt 1 waits for the test's GO file
#: (so the test sees the run going on after the restart); FAIL: rank 1 raises.
WORKER = """
import os, signal, sys, time
run_dir, rank = os.environ["MLAUNCH_RUN_DIR"], os.environ["RANK"]
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
if os.environ.get("FAIL") and rank == "1":
    raise RuntimeError("boom from the script")
if os.environ.get("KILL") and attempt == "0" and rank == "1":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
if attempt == "1":
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(run_dir, "GO")) and time.monotonic() < deadline:
        time.sleep(0.05)
open(os.path.join(run_dir, f"started-rank{rank}"), "w").close()
time.sleep(float(os.environ.get("SLEEP", "0.3")))
"""


def script(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(path), "--no-megatron-args", "--run-dir", str(run_dir), *args,
        cwd=tmp_path, env=clean_env(COLUMNS="200", **env),
    )  # fmt: skip
    return proc, run_dir


def open_ended_env() -> dict[str, str]:
    """A 400-iteration run the test stops with SIGTERM: each iteration idles (the test hook)
    instead of training flat out on both cores until the signal."""
    return clean_env(MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S)


def wait_for(predicate, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_restart_is_announced_while_running_and_status_says_running_then_completed(tmp_path):
    proc, run_dir = script(tmp_path, "--max-restarts", "1", KILL="1")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    # Attempt 1's workers wait for GO: the run is going on when the restart is announced.
    wait_for(lambda: any("restart 1 of 1" in ln for ln in lines), proc)
    announced = next(ln for ln in lines if "restart 1 of 1" in ln)
    assert "rank 1 killed by SIGKILL" in announced and "torchrun started the workers" in announced
    st = status(run_dir)
    assert st["state"] == "running" and st["attempt"] == 1, st
    assert st["launcher"]["pid"] == proc.pid and st["launcher"]["alive"] is True
    assert [(r["attempt"], r["rank"]) for r in st["restarts"]] == [(1, 1)]
    (run_dir / "GO").touch()
    assert proc.wait(timeout=TIMEOUT_S) == 0
    reader.join(timeout=10)
    out = "".join(lines)
    assert out.index("starting 2 worker(s)") < out.index("restart 1 of 1")
    st = status(run_dir)
    assert st["state"] == "completed", st
    assert st["failures"] == [] and st["failed_rank"] is None  # attempt 0's failure was survived
    (restart,) = st["restarts"]
    assert restart["attempt"] == 1 and restart["rank"] == 1
    assert restart["cause"] == "rank 1 killed by SIGKILL"
    assert st["launcher"]["exit_code"] == 0 and st["launcher"]["alive"] is None
    text = status_text(run_dir)
    assert text.startswith("run: completed; 1 restart(s)")
    assert "restart:  attempt 1 after rank 1 killed by SIGKILL" in text


def test_sigterm_without_a_save_does_not_promise_one(tmp_path):
    run_dir = tmp_path / "r"
    proc = mlaunch(
        "--run-dir", str(run_dir), "--log-interval", "1", "--train-iters", "400",
        "--eval-interval", "0", cwd=tmp_path, env=open_ended_env(),
    )  # fmt: skip
    wait_for(lambda: len(train_records(run_dir)) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM, out
    assert "SIGTERM: asking the workers to finish the iteration and flush telemetry;" in out
    assert "save" not in out.split("SIGTERM: ", 1)[1].splitlines()[0]
    assert status(run_dir)["state"] == "interrupted"  # no checkpoint: not resumable


def test_a_failed_script_is_failed_with_the_rank_and_cause(tmp_path):
    proc, run_dir = script(tmp_path, FAIL="1")
    code, out = finish(proc)
    assert code != 0, out
    st = status(run_dir)
    assert st["state"] == "failed", st
    assert st["failed_rank"] == 1
    assert "RuntimeError: boom from the script" in st["cause"]
    assert st["restarts"] == []
    assert "rank 1" in status_text(run_dir) and "boom from the script" in status_text(run_dir)


def test_a_launcher_killed_by_sigkill_is_launcher_died(tmp_path):
    proc, run_dir = script(tmp_path, SLEEP="120")
    wait_for(lambda: all((run_dir / f"started-rank{r}").exists() for r in (0, 1)), proc)
    assert status(run_dir)["state"] == "running"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    st = status(run_dir)
    assert st["state"] == "launcher_died", st
    assert st["launcher"]["pid"] == proc.pid and st["launcher"]["alive"] is False
    text = status_text(run_dir)
    assert text.startswith("run: launcher died") and "is gone without ending the run" in text
    # the orphan guard stops the workers; let them go before the next test (bounded)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        f"MLAUNCH_RUN_DIR={run_dir}".encode() in _environ(p) for p in _pids()
    ):
        time.sleep(0.2)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes() if pid != os.getpid() else b""
    except OSError:
        return b""
