"""The launcher's job trace on real torchrun runs: ``mlaunch train`` writes
``telemetry/traces-launcher-node0.jsonl`` with one ``mlaunch.job`` root and one
``mlaunch.job.attempt`` per torchrun attempt, and every worker starts with ``TRACEPARENT`` = its
attempt's span (checked in what the workers saw: a small --script that records its environment,
and the real nemo-lens worker)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.launch_runs import TIMEOUT_S, clean_env, finish, free_port, mlaunch

from mlaunch import envcontract as ec
from mlaunch.model.identity import JOB_UUID, RUN_UUID, SLURM_RESOURCE_ATTRS, run_identity
from mlaunch.model.spans import Attr, ResourceAttr, SpanName
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: Records what the worker was started with; rank 1 of attempt 0 SIGKILLs itself when asked to;
#: with SLEEP it waits (for the launcher to be signalled).
WORKER = """
import json, os, signal, time
run_dir, rank = os.environ["MLAUNCH_RUN_DIR"], os.environ["RANK"]
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
seen = {"TRACEPARENT": os.environ.get("TRACEPARENT"), "attempt": attempt, "pid": os.getpid()}
tmp = os.path.join(run_dir, f".env-rank{rank}-attempt{attempt}.tmp")
with open(tmp, "w") as fh:
    json.dump(seen, fh)
os.replace(tmp, os.path.join(run_dir, f"env-rank{rank}-attempt{attempt}.json"))
if os.environ.get("KILL") and attempt == "0" and rank == "1":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(os.environ.get("SLEEP", "0.5")))
"""


def by_name(run_dir: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for span in read_spans(lay.launcher_traces_file(run_dir, 0)):
        out.setdefault(span["name"], []).append(span)
    for spans in out.values():
        spans.sort(key=lambda s: s["start_ns"])
    return out


def seen(run_dir: Path, rank: int, attempt: int) -> dict:
    return json.loads((run_dir / f"env-rank{rank}-attempt{attempt}.json").read_text())


def traceparent(span: dict) -> str:
    return f"00-{span['trace_id']}-{span['span_id']}-01"


def script_run(tmp_path: Path, *args: str, **env: str):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(script), "--no-megatron-args", "--run-dir", str(run_dir), *args,
        cwd=tmp_path, env=clean_env(COLUMNS="200", **env),
    )  # fmt: skip
    return proc, run_dir


#: Every variable of the SLURM resource table, as a one-node SLURM job (an array element, under
#: NVRx) has them: the run's traces must carry exactly the table's attributes, once each.
SLURM_ENV = {
    "SLURM_JOB_ID": "4242", "LENS_SLURM_SLUID": "sluid-4242", "SLURM_CLUSTER_NAME": "lab",
    "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2", "LENS_SLURM_ARRAY_SLUID": "sluid-4240",
    "SLURM_RESTART_COUNT": "3", "NVRX_CYCLE": "1", "NVRX_INFRA_RANK": "0", "NVRX_MEMBERSHIP": "m1",
    "SLURM_JOB_NAME": "tiny", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_PARTITION": "gpu",
}  # fmt: skip

#: Megatron-LM's names for them (MEGATRON.md section 4), written out rather than read from the
#: table, so a renamed entry fails here.
MEGATRON_SLURM_ATTRS = {
    "slurm.job.id", "slurm.sluid", "slurm.cluster", "slurm.array.job_id", "slurm.array.task_id",
    "slurm.array.sluid", "slurm.restart_count", "nvrx.cycle", "nvrx.infra_rank",
    "nvrx.membership", "slurm.torchelastic.restart_count",
}  # fmt: skip


@dataclass
class WrappedRun:
    """A 2-iteration trainer run under ``bash -c 'sleep 5; exec mlaunch train ...'``."""

    run_dir: Path
    pid: int
    before_ns: int  # before bash started
    after_ns: int  # after it exited


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> WrappedRun:
    """One trainer run (as a one-node SLURM job: :data:`SLURM_ENV`) for the tests of what a
    clean trainer run's job trace holds. It runs in a wrapper process that sleeps 5 s before it
    execs mlaunch (the job span starts when mlaunch did): every trainer run is started that way
    somewhere (a shell, srun), and it spares a second run of the same kind."""
    import shlex
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("job-trace")
    run_dir = tmp_path / "run"
    train = [sys.executable, "-m", "mlaunch", "train", "--run-dir", str(run_dir),
             "--train-iters", "2", "--eval-interval", "0"]  # fmt: skip
    env = clean_env(**SLURM_ENV, MASTER_PORT=str(free_port()))
    before_ns = time.time_ns()
    proc = subprocess.Popen(
        ["bash", "-c", f"sleep 5; exec {shlex.join(train)}"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    code, out = finish(proc)
    after_ns = time.time_ns()
    assert code == 0, out
    return WrappedRun(run_dir, proc.pid, before_ns, after_ns)


def test_a_trainer_run_has_one_job_and_one_clean_attempt_with_the_run_identity(real_run):
    run_dir = real_run.run_dir
    spans = by_name(run_dir)
    (job,) = spans[SpanName.JOB]
    (attempt,) = spans[SpanName.JOB_ATTEMPT]
    assert job["parent_span_id"] == "" and attempt["parent_span_id"] == job["span_id"]
    assert attempt["trace_id"] == job["trace_id"]
    assert attempt["attributes"][Attr.ATTEMPT] == 0
    assert attempt["attributes"][Attr.EXIT_CODE] == 0 and job["attributes"][Attr.EXIT_CODE] == 0
    assert job["status_code"] == attempt["status_code"] == 0
    assert job["start_ns"] < attempt["start_ns"] < attempt["end_ns"] <= job["end_ns"]
    resolved = json.loads((run_dir / "resolved.json").read_text())
    identity = run_identity(SLURM_ENV)
    for span in (job, attempt):
        res = span["resource"]
        assert res[JOB_UUID] == identity[JOB_UUID] and res[RUN_UUID] == identity[RUN_UUID]
        assert res["slurm.cluster"] == "lab" and res["slurm.restart_count"] == "3"
        assert res[ResourceAttr.SERVICE_NAME] == "mlaunch-tiny"
        assert res[ResourceAttr.RUN_ID] == resolved["run_id"]
        assert res[ResourceAttr.NODE_RANK] == 0 and res[ResourceAttr.HOST_NAME]
        assert res[ResourceAttr.PROCESS_PID] == real_run.pid
    workers = run_identity({**SLURM_ENV, ec.RESTART_COUNT: "0"})
    assert attempt["attributes"][RUN_UUID] == workers[RUN_UUID]
    # The trainer ran under the wrapper and still wrote its own traces.
    assert (run_dir / "telemetry" / "traces-rank0.jsonl").exists()


def test_every_span_of_a_slurm_run_carries_exactly_the_one_table_of_slurm_attributes(real_run):
    """The launcher's job trace and every rank's spans and metrics carry the SLURM table's
    attributes under Megatron-LM's names, each once: no second name for the same variable (the
    rank's old ``slurm.cluster.name`` beside ``slurm.cluster``)."""
    assert set(SLURM_RESOURCE_ATTRS.values()) >= MEGATRON_SLURM_ATTRS
    table = {SLURM_RESOURCE_ATTRS[var]: value for var, value in SLURM_ENV.items()
             if var in SLURM_RESOURCE_ATTRS}  # fmt: skip
    telemetry = real_run.run_dir / "telemetry"
    files = {"launcher": lay.launcher_traces_file(real_run.run_dir, 0)}
    files |= {f"rank{r}": telemetry / f"traces-rank{r}.jsonl" for r in (0, 1)}
    for who, path in files.items():
        spans = read_spans(path)
        assert spans, who
        # the workers also carry their torchelastic attempt; the launcher spans every attempt
        want = table if who == "launcher" else {**table, "slurm.torchelastic.restart_count": "0"}
        for span in spans:
            got = {k: v for k, v in span["resource"].items() if k.startswith(("slurm.", "nvrx."))}
            assert got == want, (who, span["name"])
    for rank in (0, 1):
        for line in (telemetry / f"metrics-rank{rank}.jsonl").read_text().splitlines():
            for block in json.loads(line)["resourceMetrics"]:
                keys = [a["key"] for a in block["resource"]["attributes"]]
                slurm = [k for k in keys if k.startswith(("slurm.", "nvrx."))]
                assert sorted(slurm) == sorted({**table, "slurm.torchelastic.restart_count": "0"})


def test_a_sigkilled_worker_ends_attempt_0_and_the_restart_sees_attempt_1(tmp_path):
    proc, run_dir = script_run(tmp_path, "--max-restarts", "1", KILL="1")
    code, out = finish(proc)
    assert code == 0, out
    spans = by_name(run_dir)
    a0, a1 = spans[SpanName.JOB_ATTEMPT]
    (job,) = spans[SpanName.JOB]
    assert a0["attributes"][Attr.ATTEMPT] == 0 and a1["attributes"][Attr.ATTEMPT] == 1
    assert a0["attributes"][Attr.SIGNAL] == "SIGKILL" and Attr.EXIT_CODE not in a0["attributes"]
    assert a0["attributes"][Attr.FAILED_RANK] == 1 and a0["status_code"] == 2
    assert a1["attributes"][Attr.EXIT_CODE] == 0 and a1["status_code"] == 0
    assert a0["end_ns"] <= a1["start_ns"] and a1["span_id"] != a0["span_id"]
    assert job["attributes"][Attr.ATTEMPT] == 1 and job["attributes"][Attr.EXIT_CODE] == 0
    # every worker of every attempt was handed exactly its attempt's span context
    for n, attempt in enumerate((a0, a1)):
        for rank in (0, 1):
            got = seen(run_dir, rank, n)
            assert got["attempt"] == str(n)
            assert got["TRACEPARENT"] == traceparent(attempt)


def test_sigterm_to_the_launcher_ends_and_writes_the_spans_truncated(tmp_path):
    proc, run_dir = script_run(tmp_path, SLEEP="120")
    deadline = time.monotonic() + TIMEOUT_S
    while not all((run_dir / f"env-rank{r}-attempt0.json").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM, out
    spans = by_name(run_dir)
    (job,) = spans[SpanName.JOB]
    (attempt,) = spans[SpanName.JOB_ATTEMPT]
    assert seen(run_dir, 0, 0)["TRACEPARENT"] == traceparent(attempt)
    for span in (job, attempt):
        assert span["attributes"][Attr.TRUNCATED] is True
        assert span["attributes"][Attr.SIGNAL] == "SIGTERM"
        assert span["status_code"] == 2 and "SIGTERM" in span["status_message"]
    assert attempt["end_ns"] <= job["end_ns"]


def test_two_nodes_write_one_trace_with_one_root(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_dir = tmp_path / "run"
    common = [
        "--script", str(script), "--no-megatron-args", "--run-dir", str(run_dir),
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-id", "twonodes",
    ]  # fmt: skip
    procs = [mlaunch(*common, "--node-rank", str(i), cwd=tmp_path) for i in (0, 1)]
    for code, out in [finish(p) for p in procs]:
        assert code == 0, out
    node0 = read_spans(lay.launcher_traces_file(run_dir, 0))
    node1 = read_spans(lay.launcher_traces_file(run_dir, 1))
    (root,) = [s for s in node0 if s["name"] == SpanName.JOB]
    assert not [s for s in node1 if s["name"] == SpanName.JOB]  # one root: node 0's
    attempts = [s for s in node0 + node1 if s["name"] == SpanName.JOB_ATTEMPT]
    assert len(attempts) == 2 and len({s["span_id"] for s in attempts}) == 2
    assert {s["trace_id"] for s in attempts} == {root["trace_id"]}
    assert {s["parent_span_id"] for s in attempts} == {root["span_id"]}
    assert sorted(s["resource"][ResourceAttr.NODE_RANK] for s in attempts) == [0, 1]
    # each node's worker saw its own node's attempt span
    seen_tp = {seen(run_dir, rank, 0)["TRACEPARENT"] for rank in (0, 1)}
    assert seen_tp == {traceparent(s) for s in attempts}


@pytest.mark.nemo_lens
def test_the_nemo_lens_worker_sees_each_attempts_span_and_the_same_identity(
    tmp_path, lens_worker_script
):
    run_dir = tmp_path / "run"
    env = clean_env(LENS_WORKER_KILL_AT="3", LENS_WORKER_KILL_RANK="1", SLURM_CLUSTER_NAME="lab")
    proc = mlaunch(
        "--script", str(lens_worker_script), "--otel-exporter", "console", "--run-dir",
        str(run_dir), "--max-restarts", "1", "--train-iters", "6", cwd=tmp_path, env=env,
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out
    spans = by_name(run_dir)
    a0, a1 = spans[SpanName.JOB_ATTEMPT]
    (job,) = spans[SpanName.JOB]
    assert a0["attributes"][Attr.SIGNAL] == "SIGKILL" and a0["attributes"][Attr.FAILED_RANK] == 1
    for n, attempt in enumerate((a0, a1)):
        for rank in (0, 1):
            report = json.loads((run_dir / f"lens-worker-rank{rank}-attempt{n}.json").read_text())
            assert report.get("error") is None, report
            assert report["traceparent"] == traceparent(attempt)
            # nemo-lens's resource (Megatron's identity rule) names the attempt's incarnation
            assert report["resource"][RUN_UUID] == attempt["attributes"][RUN_UUID]
            assert report["resource"][JOB_UUID] == job["resource"][JOB_UUID]
            # Megatron-LM's start-up is backdated to the launch in attempt 0 only: a restarted
            # worker gets no launch stamps (its start-up began when torchrun restarted it)
            stamps = report["launch_stamps"]
            if n == 0:
                assert abs(stamps["launch_script_start"] * 1e9 - job["start_ns"]) < 1_000
            else:
                assert stamps["launch_script_start"] is stamps["launch_script_presrun"] is None
    assert os.path.exists(run_dir / "lens-worker-rank0-attempt1.json")


def test_the_job_span_starts_when_mlaunch_did_not_when_its_wrapper_process_was_created(real_run):
    """``bash -c 'sleep 5; exec mlaunch train ...'``: the process is bash's, created 5 s before
    mlaunch ran in it; none of those 5 s are the job's (goodput's wall is the job span)."""
    from support.trace_cli import trace_cli

    run_dir, before_ns, after_ns = real_run.run_dir, real_run.before_ns, real_run.after_ns
    (job,) = by_name(run_dir)[SpanName.JOB]
    assert job["resource"][ResourceAttr.PROCESS_PID] == real_run.pid  # the very process bash was
    assert job["start_ns"] >= before_ns + 5 * 10**9  # after the sleep: when mlaunch started
    code, text = trace_cli("goodput", run_dir, "--json")
    assert code == 0, text
    wall_ms = json.loads(text)["overall"]["job_wall_ms"]
    assert 0 < wall_ms <= (after_ns - before_ns) / 1e6 - 5000


def test_after_a_collector_outage_replay_delivers_the_launchers_job_trace(tmp_path):
    """A collector that is down for the whole run (nothing listens on the port): the launcher
    spools the job trace it could not send, says so once, and ``mlaunch trace replay`` delivers
    it with the workers' spans to a collector started afterwards."""
    from support.otlp import GrpcOtlpReceiver, closed_port_endpoint
    from support.trace_cli import trace_cli

    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--run-dir", str(run_dir), "--train-iters", "2", "--eval-interval", "0",
        "--otel-exporter", "otlp", "--otlp-endpoint", closed_port_endpoint(), cwd=tmp_path,
        env=clean_env(OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_TIMEOUT="2"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out
    assert out.count("job trace: cannot deliver") == 1, out  # once, at warning level
    launcher = read_spans(lay.launcher_traces_file(run_dir, 0))
    spool = lay.spooled(lay.launcher_traces_file(run_dir, 0))
    assert {s["span_id"] for s in read_spans(spool)} == {s["span_id"] for s in launcher}
    assert sorted(s["name"] for s in launcher) == [SpanName.JOB, SpanName.JOB_ATTEMPT]
    with GrpcOtlpReceiver() as rx:  # the collector is back
        code, text = trace_cli("replay", run_dir, "--endpoint", rx.endpoint, "--json")
        assert code == 0, text
        got = {s["span_id"]: s for s in rx.spans}
        for span in launcher:
            assert got[span["span_id"]]["name"] == span["name"]
            assert got[span["span_id"]]["trace_id"] == span["trace_id"]
        assert any(s["name"] == SpanName.ITERATION for s in rx.spans)  # the workers' too
        # and a second replay sends nothing twice
        assert "sent 0 spans" in trace_cli("replay", run_dir, "--endpoint", rx.endpoint)[1]


def test_a_run_whose_workers_export_nothing_has_one_trace_every_command_reads(tmp_path):
    # `--module` with no telemetry in it: the launcher's job trace is the run's only trace. Train
    # counts it, and summary, goodput and report all read it (the run directory: its store; the
    # file: the JSON), instead of "0 file(s)" beside a summary of 2 spans and exit 2 elsewhere.
    # Stragglers, which needs the workers' spans, names what is missing.
    from support.trace_cli import trace_cli

    (tmp_path / "quiet.py").write_text("import time\ntime.sleep(0.3)\n")
    run_dir = tmp_path / "run"
    code, out = finish(
        mlaunch("--module", "quiet", "--nproc-per-node", "1", "--run-dir", str(run_dir),
                cwd=tmp_path, env=clean_env(COLUMNS="200"))
    )  # fmt: skip
    assert code == 0, out
    assert "(1 file(s): the launcher's job trace only; the workers exported no spans)" in out
    job_file = lay.launcher_traces_file(run_dir, 0)
    for target in (run_dir, job_file):
        code, text = trace_cli("summary", target)
        assert code == 0 and "read 2 spans from 1 file(s)" in text, text
        code, text = trace_cli("goodput", target, "--json")
        assert code == 0, text
        report = json.loads(text)
        assert report["ranks"] == [] and report["overall"]["job_wall_ms"] > 0
        assert report["overall"]["unaccounted_ms"] == report["overall"]["wall_ms"]
        code, text = trace_cli("goodput", target)
        assert code == 0 and "only the launcher's job trace" in text, text
        code, text = trace_cli("report", target, "-o", tmp_path / "report.html")
        assert code == 0, text
        assert "note: only the launcher's job trace" in text, text
        # Stragglers compares the workers' spans: it says that is what is missing, not "no spans".
        code, text = trace_cli("stragglers", target)
        assert code == 2 and "only the launcher's job trace (2 spans" in text, text
        assert "no spans in" not in text
