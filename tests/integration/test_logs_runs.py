"""``mlaunch logs`` and ``mlaunch runs`` on real torchrun runs: a ``--script`` whose rank 1 fails
attempt 0 and is restarted (logs of each attempt, ranks, nodes, tails, a copied run directory,
bad input, a reader that goes away), ``--follow`` across that restart while it happens, and a
listing of 1,000 run directories shaped like a real trainer run's, with foreign and corrupt
folders among them. (The resume command of a run stopped with a checkpoint: test_launch_runs.py's
SIGTERM test runs it.)"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support.launch_runs import TIMEOUT_S, clean_env, finish, mlaunch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]

#: Each worker says who it is on stdout and stderr. Attempt 0's rank 1 fails (exit 3) once the
#: test's FAIL file is there (rank 0 waits until torchrun stops it); attempt 1's workers wait for
#: GO, then say they are done. ``PRINT_LINES``: rank 0 prints that many numbered lines first.
WORKER = """
import os, sys, time
run_dir, rank = os.environ["MLAUNCH_RUN_DIR"], os.environ["RANK"]
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
def wait(name):
    deadline = time.monotonic() + 150
    while not os.path.exists(os.path.join(run_dir, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
if rank == "0":
    for i in range(int(os.environ.get("PRINT_LINES", "0"))):
        print(f"line {i}")
print(f"hello rank {rank} attempt {attempt}", flush=True)
print(f"err rank {rank} attempt {attempt}", file=sys.stderr, flush=True)
open(os.path.join(run_dir, f"printed-rank{rank}-attempt{attempt}"), "w").close()
if attempt == "0":
    wait("FAIL")
    if rank == "1":
        wait("printed-rank0-attempt0")  # every line of rank 0 is written before the restart
        sys.exit(3)
    time.sleep(150)
wait("GO")
print(f"done rank {rank} attempt {attempt}", flush=True)
"""


def start(tmp_path: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "worker.py").write_text(WORKER)
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", "worker.py", "--no-megatron-args", "--run-dir", str(run_dir),
        "--max-restarts", "1", cwd=tmp_path, env=clean_env(**env),
    )  # fmt: skip
    return proc, run_dir


def logs(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", "logs", *args], cwd=cwd, env=clean_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended first")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-rank script run whose attempt 0 failed (rank 1) and attempt 1 completed."""
    tmp = tmp_path_factory.mktemp("restarted")
    proc, run_dir = start(tmp, PRINT_LINES="20000")
    wait_for(lambda: (run_dir / "launcher-node0.json").is_file(), "the launch", proc)
    (run_dir / "FAIL").touch()
    (run_dir / "GO").touch()
    code, out = finish(proc)
    assert code == 0 and "restart 1 of 1" in out, out
    return run_dir


def test_logs_shows_the_last_attempt_of_every_rank_prefixed_and_any_attempt_or_rank(restarted):
    cwd = restarted.parent
    out = logs("run", cwd=cwd)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # Attempt 1 of both ranks, each line under its rank; stdout then stderr of each rank.
    assert "[rank 0] hello rank 0 attempt 1" in lines and "[rank 1] done rank 1 attempt 1" in lines
    assert lines.index("[rank 1] hello rank 1 attempt 1") < lines.index(
        "[rank 1] err rank 1 attempt 1"
    )
    assert not any("attempt 0" in ln for ln in lines)
    assert all(ln.startswith(("[rank 0] ", "[rank 1] ")) for ln in lines)
    assert out.stderr.strip() == "== attempt 1 (launch 1 of 1, torchrun restart 1) =="
    # One rank: its lines as written, no prefix; attempt 0 is the restart's cause.
    one = logs("run", "--attempt", "0", "--rank", "1", cwd=cwd)
    assert one.returncode == 0, one.stderr
    assert one.stdout.splitlines() == ["hello rank 1 attempt 0", "err rank 1 attempt 0"]
    tail = logs("run", "--rank", "0", "--tail", "2", cwd=cwd)
    assert tail.stdout.splitlines() == [  # the last 2 lines of each file
        "hello rank 0 attempt 1", "done rank 0 attempt 1", "err rank 0 attempt 1",
    ]  # fmt: skip
    node = logs("run", "--node", "0", "--tail", "1", cwd=cwd)
    assert node.stdout.splitlines()[0] == "[rank 0] done rank 0 attempt 1"


@pytest.mark.parametrize(
    ("args", "field", "says"),
    [
        (["--rank", "2"], "--rank", "2: the run has rank(s) 0-1"),
        (["--attempt", "2"], "--attempt", "2: the run has attempt(s) 0-1"),
        (["--node", "1"], "--node", "1: the run has node(s) 0"),
        (["--tail", "-1"], "--tail", "-1: give a number of lines"),
        (["--follow", "--attempt", "0"], "--attempt", "--follow follows the newest attempt"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(restarted, args, field, says):
    out = logs("run", *args, cwd=restarted.parent)
    assert out.returncode == 2, out
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"{field}: {says}"), out.stderr


def test_a_folder_that_is_no_run_and_a_missing_target_are_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    for target, says in (("notes", "is not a run directory"), ("nope", "is neither a run")):
        out = logs(target, cwd=tmp_path)
        assert out.returncode == 2 and out.stdout == "", out
        assert len(out.stderr.splitlines()) == 1 and says in out.stderr, out.stderr


def test_a_copied_run_directory_reads_the_same(restarted, tmp_path):
    # Elsewhere, under another name, the original gone from where it was written: no absolute
    # path and no live process is needed.
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(restarted, copy)
    moved = restarted.with_name("moved-away")
    restarted.rename(moved)
    try:
        here = logs(str(copy), cwd=tmp_path)
        assert here.returncode == 0, here.stderr
        assert "[rank 1] done rank 1 attempt 1" in here.stdout.splitlines()
        assert logs(str(copy), "--attempt", "0", "--rank", "0", "--tail", "1", cwd=tmp_path)\
            .stdout.splitlines() == ["hello rank 0 attempt 0", "err rank 0 attempt 0"]  # fmt: skip
    finally:
        moved.rename(restarted)


def test_a_reader_that_goes_away_ends_it_quietly(restarted):
    # `mlaunch logs run | head -1`: rank 0 printed 20,000 lines (200 KB), more than a pipe holds.
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlaunch", "logs", "run", "--attempt", "0"],
        cwd=restarted.parent, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == b"[rank 0] line 0\n"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT_S) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_follow_goes_on_across_a_restart_and_ends_with_the_run(tmp_path):
    proc, run_dir = start(tmp_path)
    try:
        wait_for(lambda: (run_dir / "launcher-node0.json").is_file(), "the launch", proc)
        follow = subprocess.Popen(
            [sys.executable, "-m", "mlaunch", "logs", "run", "--follow"], cwd=tmp_path,
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(follow.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        wait_for(lambda: "[rank 1] hello rank 1 attempt 0\n" in lines, "attempt 0", follow)
        (run_dir / "FAIL").touch()  # rank 1 fails: torchrun restarts the group
        wait_for(lambda: "[rank 1] hello rank 1 attempt 1\n" in lines, "attempt 1", follow)
        assert follow.poll() is None  # the run goes on: so does the follower
        (run_dir / "GO").touch()
        # Nobody stops it: it ends by itself once the run has ended, with every last line.
        assert follow.wait(timeout=TIMEOUT_S) == 0
        reader.join(timeout=10)
        err = follow.stderr.read()  # type: ignore[union-attr]
    finally:
        code, out = finish(proc)
    assert code == 0, out
    assert (
        "[rank 0] done rank 0 attempt 1\n" in lines and "[rank 1] done rank 1 attempt 1\n" in lines
    )
    assert lines.index("[rank 1] hello rank 1 attempt 0\n") < lines.index(
        "[rank 1] hello rank 1 attempt 1\n"
    )
    assert len(lines) == len(set(lines))  # nothing shown twice
    assert err.splitlines() == [
        "== attempt 0 (launch 1 of 1, torchrun restart 0) ==",
        "== attempt 1 (launch 1 of 1, torchrun restart 1) ==",
    ], err


# --------------------------------------------------------------------------------------------
# mlaunch runs


def _benchmark():  # type: ignore[no-untyped-def]
    """benchmarks/runs_listing.py: the one builder of many run directories from a real one."""
    spec = importlib.util.spec_from_file_location(
        "runs_listing", ROOT / "benchmarks" / "runs_listing.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_lists_1000_run_directories_with_foreign_and_corrupt_ones(tmp_path, restarted):
    bench = _benchmark()
    template = bench.make_template(tmp_path)  # a real trainer run
    folder = tmp_path / "many"
    folder.mkdir()
    expected = bench.build(template, folder, 1000)
    shutil.copytree(restarted, folder / "script-run")  # a script run, as written
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "runs", str(folder), "--json"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0 and out.stderr == "", out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1021
    expected["completed"] += 1
    assert Counter(r["state"] for r in rows) == expected
    for key in ("run_id", "state", "path", "iteration", "train_iters", "started", "resume"):
        assert all(key in r for r in rows), key
    starts = [r["started"] for r in rows if r["started"] is not None]
    assert starts == sorted(starts, reverse=True)  # newest first
    by_path = {Path(r["path"]).name: r for r in rows}
    assert by_path["script-run"]["entry"] == "worker.py"
    assert by_path["run0000"]["entry"] == "trainer" and by_path["run0000"]["train_iters"] == 20
    # The state is status's, word for word, for each kind of run.
    for name in ("run0000", "run0001", "run0002", "run0003", "script-run"):
        st = subprocess.run(
            [sys.executable, "-m", "mlaunch", "status", str(folder / name), "--json"],
            env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert json.loads(st.stdout)["state"] == by_path[name]["state"], name
    preempted = by_path["run0002"]
    assert preempted["state"] == "preempted" and preempted["resume"].startswith("cd ")
    assert f"--run-dir {folder / 'run0002'}" in preempted["resume"]
    assert by_path["corrupt0"]["note"] and by_path["foreign0"]["state"] == "not a run"
    text = subprocess.run(
        [sys.executable, "-m", "mlaunch", "runs", str(folder)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert text.returncode == 0 and "Traceback" not in text.stderr
    head = text.stdout.splitlines()[0].split()
    assert head == ["RUN", "STATE", "STARTED", "ITERATIONS", "ENTRY", "PATH"]
    assert f"  resume: {preempted['resume']}" in text.stdout.splitlines()


def test_runs_of_a_missing_folder_is_refused(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "runs"], cwd=tmp_path, env=clean_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == ""
    assert (
        out.stderr.startswith("DIR: runs: no such directory") and len(out.stderr.splitlines()) == 1
    )


@pytest.mark.parametrize(
    ("squeue", "state", "note"),
    [
        ("echo '77|PENDING'; echo '78|RUNNING'", "queued", None),
        ("echo 'squeue: error: Unable to contact slurm controller' >&2; exit 1", "unknown",
         "SLURM could not be asked (squeue: squeue: error: Unable to contact slurm controller)"),
    ],
)  # fmt: skip
def test_runs_asks_slurms_queue_once_for_its_jobs(tmp_path, squeue, state, note):
    """A SLURM job's run directory that has not started yet: its state is SLURM's queue's (one
    ``squeue`` for every row; here a stand-in on PATH, the real one in tests/slurm), and where
    SLURM cannot be asked the listing says so on stderr and keeps the run directory's word."""
    run = tmp_path / "runs" / "77"
    run.mkdir(parents=True)
    (run / "slurm-job.json").write_text(json.dumps({"job_id": "77", "submitted": time.time()}))
    (run / "resolved.json").write_text(json.dumps({"run_id": "77", "environment": {"A": "1"}}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "squeue").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n{squeue}\n')
    (bin_dir / "squeue").chmod(0o755)
    env = {**clean_env(), "PATH": f"{bin_dir}:{clean_env()['PATH']}"}
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "runs", "--json"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["job_id"] == "77" and row["state"] == state, row
    assert len(calls.read_text().splitlines()) == 1  # one query, whatever the rows
    if note is None:
        assert out.stderr == ""
    else:
        assert out.stderr.startswith(f"note: {note}"), out.stderr
