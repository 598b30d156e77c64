"""The launcher's death stops its job: SIGKILL of ``mlaunch train`` leaves no torchrun or worker
running, and the workers take the graceful SIGTERM path (save, end spans truncated, flush)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from support.launch_runs import TIMEOUT_S, mlaunch, train_records

from mlaunch.otlp.otlp_json import read_spans
from mlaunch.trainer.checkpoint import committed_iterations, iter_dir_name, verify

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: The issue's bound: nothing the launcher started is alive this long after its death.
STOP_BOUND_S = 30


def _alive(pid: int) -> bool:
    """Running (a zombie has already exited: only its parent has not read its status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _job_processes(run_dir: Path) -> set[int]:
    """Every process whose environment names this run directory: torchrun and its workers."""
    needle = f"MLAUNCH_RUN_DIR={run_dir}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process environments from /proc")
def test_sigkill_of_the_launcher_stops_torchrun_and_workers_gracefully(tmp_path):
    run_dir = tmp_path / "r"
    proc = mlaunch(
        "--run-dir", str(run_dir), "--save-interval", "3", "--log-interval", "1",
        "--train-iters", "400", cwd=tmp_path,
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    while len(train_records(run_dir)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0]
    started = _job_processes(run_dir)
    assert len(started) >= 3, started  # torchrun and two workers

    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    deadline = time.monotonic() + STOP_BOUND_S
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted(p for p in started if _alive(p))
    for pid in left:  # never leave strays behind a failing test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {STOP_BOUND_S} s after the launcher died: {left}"

    # The workers stopped as on SIGTERM: the iteration they reached was saved, intact.
    last = train_records(run_dir)[-1]["iteration"]
    ckpt = run_dir / "checkpoints"
    assert committed_iterations(ckpt)[-1] == last
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    assert verify(ckpt / iter_dir_name(last)) is None
    # ... and ended their open block span as truncated, flushed to the run directory.
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        truncated = {
            s["name"]
            for s in spans
            if s["attributes"].get("nemo.span.truncated")
            or s["attributes"].get("mlaunch.span.truncated")
        }
        assert "megatron.train" in truncated, sorted(truncated)
