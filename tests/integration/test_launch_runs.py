"""Real ``mlaunch train`` runs on gloo/CPU: the embedded default end to end, pipeline parallel with
OTLP gRPC export, two "nodes" on one machine, two runs at once, a failing rank, and SIGTERM with
checkpoint resume. Tiny models; each run is a few seconds of training."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
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

from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def the_run_dir(cwd: Path) -> Path:
    runs = list((cwd / "runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_no_arguments_runs_tiny_end_to_end(tmp_path):
    # The test hook lowers the trace size from which the run's end writes the span store (64 MiB
    # of JSON; a smaller one is left to the first read), so this tiny run's end writes it.
    code, out = finish(mlaunch(cwd=tmp_path, env=clean_env(MLAUNCH_TEST_STORE_MIN_BYTES="0")))
    assert code == 0, out
    run_dir = the_run_dir(tmp_path)
    records = train_records(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, 31))
    assert "iteration 30/30" in out and "iteration 2/30" not in out  # one line per log interval
    assert f"mlaunch trace summary {run_dir}" in out
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        steps = [s for s in spans if s["name"] == "megatron.train.iteration"]
        assert len(steps) == 30
        assert {s["resource"]["nemo.run.id"] for s in spans} == {run_dir.name}
    env_text = (run_dir / "resolved.env").read_text()
    assert f"export MEGATRON_OTEL_RUN_ID={run_dir.name}" in env_text
    # The launcher wrote the span store from the workers' files once they had exited: it is
    # there, fresh, before any `mlaunch trace` command, and holds what a build afresh holds.
    from support.trace_compare import json_store_rows, store_rows

    from mlaunch.trace.reader import discover
    from mlaunch.trace.store import open_store
    from mlaunch.trace.store_layout import is_fresh, load_manifest

    man = load_manifest(run_dir)
    assert man is not None and is_fresh(run_dir, man, discover(run_dir)), "no store at the end"
    assert "span store" not in out
    assert store_rows(open_store(run_dir)) == json_store_rows(run_dir, tmp_path / "fresh")


def test_pipeline_parallel_run_exports_over_otlp_grpc(tmp_path):
    from support.otlp import GrpcOtlpReceiver

    with GrpcOtlpReceiver() as rx:
        code, out = finish(
            mlaunch(
                "--config", "pp2", "--train-iters", "4", "--otel-exporter", "otlp",
                "--otlp-endpoint", rx.endpoint, "--otlp-headers", "x-api-key=LAUNCHSECRET",
                cwd=tmp_path,
            )
        )  # fmt: skip
        assert code == 0, out
        assert rx.wait_for_spans(1, timeout=10)
        spans = rx.spans
        headers = rx.headers
    names = {s["name"] for s in spans}
    assert {
        "megatron.train.iteration",
        "megatron.p2p.send_forward",
        "megatron.pp.recv_forward.linked",
    } <= names
    linked = [s for s in spans if s["name"] == "megatron.pp.recv_forward.linked"]
    assert all(s["links"] for s in linked)
    run_dir = the_run_dir(tmp_path)
    assert {s["resource"]["nemo.run.id"] for s in spans} == {run_dir.name}
    assert any(h.get("x-api-key") == "LAUNCHSECRET" for h in headers)  # the real secret travelled
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert "LAUNCHSECRET" not in path.read_text(errors="replace"), path
    assert "LAUNCHSECRET" not in out
    assert [r["iteration"] for r in train_records(run_dir)] == [1, 2, 3, 4]


def test_two_nodes_on_one_machine_complete_one_job(tmp_path):
    port = free_port()
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "twonodes", "--train-iters", "4", "--global-batch-size", "4",
    ]  # fmt: skip
    procs = [mlaunch(*common, "--node-rank", str(i), cwd=tmp_path) for i in (0, 1)]
    results = [finish(p) for p in procs]
    for code, out in results:
        assert code == 0, out
    run_dir = tmp_path / "runs" / "twonodes"
    assert [r["iteration"] for r in train_records(run_dir)] == [1, 2, 3, 4]
    assert (run_dir / "logs" / "node0").is_dir() and (run_dir / "logs" / "node1").is_dir()
    spans = read_spans(run_dir / "telemetry" / "traces-rank0.jsonl") + read_spans(
        run_dir / "telemetry" / "traces-rank1.jsonl"
    )
    assert {s["resource"]["dl.world_size"] for s in spans} == {2}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[list[Path], list[str]]:
    """Two 3-iteration runs started at once in one directory, the second with --report: their
    run directories (by name) and outputs (in start order). Also the no-checkpoint rerun test's
    first run: a run that saved no checkpoint is all it needs."""
    cwd = tmp_path_factory.mktemp("two-runs")
    args = ["--train-iters", "3", "--otel-span-groups", "default"]
    procs = [mlaunch(*args, *extra, cwd=cwd) for extra in ([], ["--report"])]
    outputs = []
    for code, out in (finish(p) for p in procs):
        assert code == 0, out
        outputs.append(out)
    return sorted((cwd / "runs").iterdir()), outputs


def test_two_runs_at_once_do_not_collide(two_runs):
    runs, outputs = two_runs
    assert len(runs) == 2
    for run_dir in runs:
        assert [r["iteration"] for r in train_records(run_dir)] == [1, 2, 3]
    reports = [run_dir / "report.html" for run_dir in runs if (run_dir / "report.html").exists()]
    assert len(reports) == 1
    assert f"report:  {reports[0]}" in outputs[1]
    assert "report:  mlaunch trace report" in outputs[0]
    assert "plotly" in reports[0].read_text()[:2_000_000].lower()


def test_failing_rank_is_reported_with_rank_and_exception(tmp_path):
    env = clean_env(MLAUNCH_TEST_FAIL_AT_ITERATION="2")
    code, out = finish(mlaunch("--train-iters", "5", cwd=tmp_path, env=env))
    assert code != 0
    assert (
        "rank 0 (node 0, local rank 0) failed" in out
        or "rank 1 (node 0, local rank 1) failed" in out
    )
    assert "RuntimeError: injected failure at iteration 2" in out
    assert "last lines of" in out and "stderr.log" in out
    assert "<N/A>" not in out
    assert "]:     raise RuntimeError(" in out  # the last lines of the rank's own log


def test_sigterm_stops_workers_flushes_traces_and_leaves_a_resumable_checkpoint(tmp_path):
    run_dir = tmp_path / "r"
    args = ["--run-dir", str(run_dir), "--save-interval", "3", "--log-interval", "1"]
    # Open-ended until the signal: each iteration idles (the test hook) instead of training flat out.
    env = clean_env(MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S)
    proc = mlaunch(*args, "--train-iters", "400", cwd=tmp_path, env=env)
    deadline = time.monotonic() + TIMEOUT_S
    while len(train_records(run_dir)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM, out
    assert "SIGTERM: asking the workers to finish the iteration, save and flush telemetry" in out
    # Something is said between the summary and iteration 1.
    assert (
        out.index("mlaunch train")
        < out.index("starting 2 worker(s)")
        < out.index("iteration 1/400")
    )
    # `mlaunch status` reads the run back as preempted, resumable (before the resume below).
    st = status(run_dir)
    assert st["state"] == "preempted", st
    assert st["launcher"]["signal"] == "SIGTERM" and st["failures"] == []
    assert "resumes from the checkpoint" in status_text(run_dir)
    # train's own closing lines say it too, in the same words (not only `mlaunch status`).
    assert f"--run-dir {run_dir} resumes from the checkpoint" in out, out
    last = train_records(run_dir)[-1]["iteration"]
    assert 5 <= last < 400
    # Workers stopped at the same iteration, saved there and flushed their spans.
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        steps = [
            s["attributes"]["megatron.iteration"]
            for s in spans
            if s["name"] == "megatron.train.iteration"
        ]
        assert max(steps) == last
        # The train block was open when the stop came: ended, and marked truncated.
        truncated = {s["name"] for s in spans if s["attributes"].get("nemo.span.truncated")}
        assert "megatron.train" in truncated, sorted(truncated)
    # The command that resumes it, said by train's closing lines and `mlaunch runs` alike (one
    # source: the launch's record in resolved.json).
    (resume,) = [
        ln.removeprefix("resume:   ") for ln in out.splitlines() if ln.startswith("resume:")
    ]
    assert resume == (
        f"cd {tmp_path} && mlaunch train --save-interval 3 --log-interval 1 --train-iters 400"
        f" --run-dir {run_dir}"
    ), resume
    listed = subprocess.run(
        [sys.executable, "-m", "mlaunch", "runs", str(tmp_path), "--json"],
        env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    (row,) = [r for r in json.loads(listed.stdout) if r["path"] == str(run_dir)]
    assert row["state"] == "preempted" and row["resume"] == resume, row
    assert row["iteration"] == last and row["train_iters"] == 400
    # Resume with that very command (fewer iterations after it: a later flag wins): the same
    # run directory picks the checkpoint up and carries on from there.
    words = shlex.split(resume.split(" && mlaunch train ", 1)[1])
    code, out = finish(mlaunch(*words, "--train-iters", str(last + 2), cwd=tmp_path))
    assert code == 0, out
    # Said before the workers start: where they pick up, not "iteration 1 follows".
    assert f"loading the checkpoint of iteration {last}; iteration {last + 1} follows" in out, out
    assert "iteration 1 follows" not in out and "resumes from the checkpoint" not in out
    resumed = [r["iteration"] for r in train_records(run_dir)]
    assert resumed[-2:] == [last + 1, last + 2]
    assert f"--load {ckpt}" in (run_dir / "command.txt").read_text()
    # A rerun without repeating --save-interval used to start over at iteration 1: it
    # resumes from the checkpoint the runs before saved, says so, and saves at its end.
    # (It shares this test's runs: the run directory already holds a checkpoint.)
    code, out = finish(
        mlaunch(*args[:2], "--log-interval", "1", "--train-iters", str(last + 4), cwd=tmp_path)
    )
    assert code == 0, out
    assert "resuming from" in out  # the summary's checkpoints row (the box may wrap the path)
    assert f"--load {ckpt}" in (run_dir / "command.txt").read_text()
    assert [r["iteration"] for r in train_records(run_dir)][-2:] == [last + 3, last + 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last + 4)


def test_a_rerun_with_no_checkpoint_is_refused_and_changes_nothing(tmp_path, two_runs):
    # A rerun in a --run-dir whose first run saved no checkpoint used to start over at iteration 1
    # and append to that run's progress.jsonl and traces: every reader then counted two
    # runs as one. It is refused before anything starts; the first run's files stay as they were.
    # The first run is a copy of one of two_runs' (shared, and left as they are for their test).
    run_dir = tmp_path / "r"
    shutil.copytree(two_runs[0][0], run_dir)
    args = ["--run-dir", str(run_dir), "--train-iters", "2"]
    assert not (run_dir / "checkpoints").exists()
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    first_id = run_dir.joinpath("resolved.json").read_text()
    code, out = finish(mlaunch(*args, cwd=tmp_path))
    assert code == 2, out
    assert "no checkpoint to resume from" in out and "Give another --run-dir" in out
    assert "Traceback" not in out and "starting 2 worker(s)" not in out
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # The same run id (a SLURM requeue: the run id is the job id) is the same run, not another.
    env = {**clean_env(), "MEGATRON_OTEL_RUN_ID": json.loads(first_id)["run_id"]}
    code, out = finish(mlaunch(*args, cwd=tmp_path, env=env))
    assert code == 0, out


def test_otel_sdk_disabled_is_telemetry_off_named_by_the_variable(tmp_path):
    # The summary said "on, per_step" while nothing was written; trace summary then advised
    # MEGATRON_OTEL_ENABLED=1, already set. The SDK's own switch is resolved as telemetry off.
    env = clean_env(OTEL_SDK_DISABLED="true", MEGATRON_OTEL_ENABLED="1")
    run_dir = tmp_path / "run"
    args = ("--train-iters", "2", "--eval-iters", "0", "--nproc-per-node", "1")
    code, out = finish(mlaunch(*args, "--run-dir", str(run_dir), cwd=tmp_path, env=env))
    assert code == 0, out
    flat = " ".join(out.replace("│", " ").split())
    assert "telemetry off (OTEL_SDK_DISABLED=true, the OpenTelemetry SDK's own switch" in flat
    assert "per_step" not in flat and "spans" not in flat
    setting = json.loads((run_dir / "resolved.json").read_text())["settings"]["telemetry.enabled"]
    assert setting == {"value": False, "source": "OTEL_SDK_DISABLED"}
    assert "export MEGATRON_OTEL_ENABLED=false" in (run_dir / "resolved.env").read_text()
    assert not list((run_dir / "telemetry").glob("*.jsonl"))
    proc = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "summary", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "OTEL_SDK_DISABLED=true" in proc.stderr and "ENABLED=1" not in proc.stderr
