"""The hang watchdog on real torchrun jobs over gloo.

``support/hang_worker.py``: 2 ranks using ``mlaunch.telemetry``; rank 1 sleeps for an hour inside
``megatron.data.get_batch`` at iteration 5 while rank 0 waits in the all-reduce of
``megatron.grad_sync.finish``. ``--hang-timeout 10``: the watchdog reads both ranks' progress
beats, declares the hang, reads every worker's stacks with py-spy and their open spans through
the capture request, and names rank 1 as the rank the others wait for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, free_port, mlaunch

from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).resolve().parents[1] / "support" / "hang_worker.py"


def _hang_run(tmp_path: Path, *args: str, **env: str) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(WORKER), "--nproc-per-node", "2", "--device", "cpu",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-span-groups", "per_step",
        "--otel-export-strategy", "all_ranks", "--hang-timeout", "10", *args,
        cwd=tmp_path, env=clean_env(**env),
    )  # fmt: skip
    code, out = finish(proc)
    return code, out, run_dir


def _status(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "status", str(run_dir), "--json"],
        capture_output=True, text=True, env=clean_env(), timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def _attempt_spans(run_dir: Path) -> list[dict]:
    from mlaunch.otlp.otlp_json import read_spans

    spans = read_spans(run_dir / "telemetry" / "traces-launcher-node0.jsonl")
    return sorted(
        (s for s in spans if s["name"] == "mlaunch.job.attempt"),
        key=lambda s: s["attributes"]["mlaunch.attempt"],
    )


def test_the_hung_rank_is_named_with_its_span_and_frame_and_the_run_ends_on_the_hang(
    tmp_path: Path,
) -> None:
    code, out, run_dir = _hang_run(tmp_path)
    assert code != 0, out[-3000:]
    report = json.loads((run_dir / "hang" / "report.json").read_text())
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[1]["span"] == "megatron.data.get_batch" and ranks[1]["iteration"] == 5
    assert "hang_worker.py:" in ranks[1]["frame"] and ranks[1]["frame"].endswith(" main")
    assert ranks[1]["in_collective"] is False
    assert ranks[0]["span"] == "megatron.grad_sync.finish" and ranks[0]["iteration"] == 5
    assert ranks[0]["in_collective"] is True and ranks[0]["frame"].endswith(" all_reduce")
    verdict = report["verdict"]
    assert verdict.startswith(
        "rank 0: in megatron.grad_sync.finish (iteration 5), waiting in a collective; rank 1: in"
        " megatron.data.get_batch (iteration 5) for "
    ), verdict
    assert verdict.endswith(" main \N{EM DASH} the rank the others wait for"), verdict
    # Declared after the timeout, not before; from the progress beats of both ranks.
    node = json.loads((run_dir / "hang" / "report-node0.json").read_text())
    assert node["silent_s"] >= node["timeout_s"] == 10
    assert node["source"].startswith("mlaunch.telemetry progress beats")
    assert node["nccl"]["available"] is False and "gloo" in node["nccl"]["note"]
    for rank in (0, 1):  # one stack file per rank, every thread, and the open-span stack
        stacks = (run_dir / "hang" / f"stacks-rank{rank}.txt").read_text()
        assert '"MainThread"' in stacks and '"mlaunch-capture-watch"' in stacks, stacks
        spans = json.loads((run_dir / "hang" / f"spans-rank{rank}.json").read_text())
        main = next(t for t in spans["threads"] if t["thread"] == "MainThread")
        assert [s["name"] for s in main["spans"]][:2] == [
            "megatron.train", "megatron.train.iteration"
        ]  # fmt: skip
    assert "all_reduce" in (run_dir / "hang" / "stacks-rank0.txt").read_text()
    # The terminal: the verdict while it runs, and the run's end names the hang.
    assert "hang: no progress for " in out and "  rank 1: in megatron.data.get_batch" in out
    assert "hung (attempt 0, no restart left): rank 0: in megatron.grad_sync.finish" in out
    attempts = _attempt_spans(run_dir)
    assert attempts[-1]["attributes"].get("mlaunch.hang") is True
    st = _status(run_dir)
    assert st["state"] == "failed" and st["cause"].startswith("hang: rank 0: in "), st
    assert st["hang"]["verdict"] == verdict and st["hang"]["attempt"] == 0
    assert st["hang"]["ranks"] == [
        {k: ranks[r][k] for k in ("rank", "span", "iteration", "frame")} for r in (0, 1)
    ]
    assert isinstance(st["hang"]["detected_at"], float)


def test_a_hang_in_the_first_attempt_is_stopped_and_the_restart_resumes_and_finishes(
    tmp_path: Path,
) -> None:
    code, out, run_dir = _hang_run(tmp_path, "--max-restarts", "1", HANG_WORKER_ATTEMPTS="1")
    assert code == 0, out[-3000:]
    logs = {
        p.parent.name: p.read_text() for p in run_dir.glob("logs/node0/*/attempt_1/*/stdout.log")
    }
    for rank in ("0", "1"):
        assert f"rank {rank}: resumed after iteration 4" in logs[rank], logs
        assert f"rank {rank}: finished" in logs[rank], logs
    assert "restart 1 of 1: the hang watchdog stopped the hung workers" in out, out[-3000:]
    attempts = _attempt_spans(run_dir)
    assert [a["attributes"].get("mlaunch.hang") for a in attempts] == [True, None]
    st = _status(run_dir)
    assert st["state"] == "completed", st
    assert (
        st["hang"]["attempt"] == 0 and "rank 1: in megatron.data.get_batch" in st["hang"]["verdict"]
    )
    assert st["restarts"][0]["cause"] == "the hang watchdog stopped the hung workers"


def test_with_report_the_verdict_is_written_and_the_job_is_left_running(tmp_path: Path) -> None:
    """``--on-hang report``: the report, no stop (the run is then stopped by the test: SIGTERM
    to the launcher, which forwards it)."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(WORKER), "--nproc-per-node", "2", "--device", "cpu",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-export-strategy", "all_ranks",
        "--hang-timeout", "10", "--on-hang", "report", cwd=tmp_path, env=clean_env(),
    )  # fmt: skip
    report = run_dir / "hang" / "report.json"
    deadline = time.monotonic() + 120
    while not report.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert report.exists() and proc.poll() is None, "no report, or the job stopped"
    st = _status(run_dir)
    assert st["state"] == "running" and st["hang"]["action"] == "report", st
    proc.send_signal(signal.SIGINT)  # forwarded as SIGTERM: the hung workers die of it
    code, out = finish(proc)
    assert code != 0
    assert "stopping the workers" not in out


@pytest.mark.nemo_lens
def test_a_nemo_lens_worker_that_hangs_gets_a_verdict_from_its_stacks(
    lens_worker_script: Path, tmp_path: Path
) -> None:
    """A Megatron-LM-like worker (real nemo-lens, no mlaunch inside): progress comes from the
    iteration spans the embedded receiver gets, the verdict from py-spy's stacks alone."""
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(lens_worker_script), "--nproc-per-node", "2", "--device", "cpu",
        "--train-iters", "6", "--eval-interval", "0", "--run-dir", str(run_dir),
        "--otel-enabled", "--otel-span-groups", "per_step", "--otel-export-strategy", "all_ranks",
        "--hang-timeout", "10", cwd=tmp_path,
        env=clean_env(LENS_WORKER_HANG_AT="3", LENS_WORKER_HANG_RANK="1"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code != 0, out[-3000:]
    node = json.loads((run_dir / "hang" / "report-node0.json").read_text())
    assert "megatron.train.iteration spans (embedded receiver)" in node["source"], node
    ranks = {r["rank"]: r for r in node["ranks"]}
    assert ranks[1]["span"] is None  # no mlaunch runtime in the worker: stacks only
    assert "lens_worker.py:" in ranks[1]["frame"] and ranks[1]["frame"].endswith(" main")
    assert (run_dir / "hang" / "stacks-rank1.txt").read_text().count("lens_worker.py") >= 1
    assert node["verdict"].startswith(f"rank 1: at {ranks[1]['frame']}"), node["verdict"]
    assert "hung (attempt 0, no restart left): rank 1: at " in out


def test_a_trainer_rank_stopped_by_sigstop_is_named_by_the_watchdog(tmp_path: Path) -> None:
    """mlaunch's own trainer: progress from its beats and progress.jsonl; rank 1 is frozen for
    real (SIGSTOP) once it has trained a few iterations; py-spy reads the frozen process without
    pausing it, and the watchdog's SIGKILL ends it."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--run-dir", str(run_dir), "--train-iters", "100000", "--eval-interval", "0",
        "--hang-timeout", "10", cwd=tmp_path, env=clean_env(),
    )  # fmt: skip
    beat = lay.heartbeat_file(run_dir, 1)
    deadline = time.monotonic() + 120
    pid = None
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            body = json.loads(beat.read_bytes())
        except (OSError, ValueError):
            body = {}
        if body.get("iteration", 0) >= 3:
            pid = body["pid"]
            break
        time.sleep(0.2)
    assert pid is not None, "rank 1 never reached iteration 3"
    os.kill(pid, signal.SIGSTOP)
    code, out = finish(proc)
    assert code != 0, out[-3000:]
    node = json.loads((run_dir / "hang" / "report-node0.json").read_text())
    assert {"mlaunch.telemetry progress beats", "progress.jsonl"} <= set(node["source"].split(", "))
    ranks = {r["rank"]: r for r in node["ranks"]}
    assert ranks[1]["process"] == "stopped" and ranks[1]["frame"], ranks[1]
    assert node["verdict"].startswith("rank 0: in "), node["verdict"]
    assert "; rank 1: stopped, " in node["verdict"]
    assert node["verdict"].endswith("\N{EM DASH} the rank the others wait for")


def test_two_nodes_each_report_their_rank_and_status_merges_them(tmp_path: Path) -> None:
    """Two launchers (two "nodes" of one process each) sharing one run directory: each writes its
    own rank's report, waits for the other's before stopping, and status judges both together."""
    run_dir = tmp_path / "run"
    common = [
        "--script", str(WORKER), "--nnodes", "2", "--nproc-per-node", "1", "--device", "cpu",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hangnodes",
        "--otel-run-id", "hangnodes", "--run-dir", str(run_dir), "--otel-enabled",
        "--otel-export-strategy", "all_ranks", "--hang-timeout", "10",
    ]  # fmt: skip
    procs = [mlaunch(*common, "--node-rank", str(n), cwd=tmp_path) for n in (0, 1)]
    results = [finish(p) for p in procs]
    for code, out in results:
        assert code != 0, out[-3000:]
    nodes = [json.loads((run_dir / "hang" / f"report-node{n}.json").read_text()) for n in (0, 1)]
    assert sorted(r["rank"] for n in nodes for r in n["ranks"]) == [0, 1]
    assert all(len(n["ranks"]) == 1 for n in nodes)
    st = _status(run_dir)
    verdict = st["hang"]["verdict"]
    assert verdict.startswith("rank 0: in megatron.grad_sync.finish (iteration 5), waiting in a")
    assert "; rank 1: in megatron.data.get_batch (iteration 5) for " in verdict
    assert verdict.endswith("\N{EM DASH} the rank the others wait for")
    assert [r["rank"] for r in st["hang"]["ranks"]] == [0, 1]
    merged = json.loads((run_dir / "hang" / "report.json").read_text())
    assert merged["verdict"] == verdict and sorted(merged["nodes"]) == [0, 1]
