"""The launcher's job trace without torchrun: the command wrapping, the attempt ids the worker-side
wrapper derives, how torchrun's log lines and attempt folders become spans, the sinks (a real
in-process OTLP receiver over gRPC and HTTP) and the stdlib OTLP/JSON encoding."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.otlp import GrpcOtlpReceiver, HangingServer, HttpOtlpReceiver, closed_port_endpoint

from mlaunch import envcontract as ec
from mlaunch.launcher import attempt_entry, jobtrace
from mlaunch.launcher import plan as lp
from mlaunch.model.identity import JOB_UUID, RUN_UUID, run_identity
from mlaunch.model.spans import Attr, ResourceAttr, SpanName
from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay

CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
REPO = Path(__file__).resolve().parents[2]


def build(tmp_path: Path, flags: dict | None = None, env: dict | None = None) -> lp.LaunchPlan:
    return lp.build_plan(
        flags={"launch.run_dir": str(tmp_path / "run"), **(flags or {})},
        environ={**CLEAN, **(env or {})},
        cwd=tmp_path,
    )


def spans_of(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for span in otlp_json.read_spans(path):
        out.setdefault(span["name"], []).append(span)
    return out


class Torchrun:
    """What torchrun leaves for the launcher: its log and per-attempt folders."""

    def __init__(self, plan: lp.LaunchPlan) -> None:
        self.log_dir = plan.log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.log_dir / lay.TORCHRUN_LOG

    def attempt(self, n: int) -> None:
        (self.log_dir / "rdzv_abc" / f"attempt_{n}" / "0").mkdir(parents=True)

    def failed(self, code: int, local_rank: int) -> None:
        with self.log.open("a") as fh:
            fh.write(
                f"E1201 00:57:33.250000 5822 torch/distributed/elastic/multiprocessing/api.py:1002]"
                f" failed (exitcode: {code}) local_rank: {local_rank} (pid: 5868) of binary: py\n"
            )


# ---- the command -----------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["trainer", "script", "module"])
def test_wrap_puts_the_entry_wrapper_where_torchrun_reads_its_entry(tmp_path, entry):
    from torch.distributed.run import get_args_parser

    (tmp_path / "train.py").write_text("")
    flags = {
        "script": {"launch.script": str(tmp_path / "train.py")},
        "module": {"launch.module": "json.tool"},  # one python -m finds (it is checked)
    }
    plan = build(tmp_path, flags.get(entry, {}) | {"launch.max_restarts": 2})
    job = jobtrace.JobTrace(plan, environ=CLEAN, sinks=[])
    argv, env = job.wrap(plan.argv, plan.child_env)
    before = get_args_parser().parse_args(plan.argv[3:])
    after = get_args_parser().parse_args(argv[3:])
    # torchrun runs `python -S -u attempt_entry.py` + exactly what it would have started
    assert after.no_python and not after.module and after.training_script == sys.executable
    original = (["-m"] if before.module else []) + [before.training_script]
    wrapper = ["-S", "-u", attempt_entry.__file__]
    assert after.training_script_args == wrapper + original + before.training_script_args
    assert (after.max_restarts, after.log_dir) == (before.max_restarts, before.log_dir)
    trace_id, key = env[ec.ATTEMPT_TRACE].split(":")
    assert trace_id == job.trace_id and ec.ATTEMPT_TRACE not in plan.child_env


def test_wrap_hands_the_workers_the_launch_stamps_megatron_backdates_its_start_up_from(tmp_path):
    plan = build(tmp_path)
    job = jobtrace.JobTrace(plan, environ=CLEAN, sinks=[])
    before = time.time_ns()
    _, env = job.wrap(plan.argv, plan.child_env)
    after = time.time_ns()
    start, presrun = env[ec.LAUNCH_SCRIPT_START_TIME], env[ec.LAUNCH_SCRIPT_PRESRUN_TIME]
    # Unix seconds as Megatron-LM's float() reads them, to the nanosecond in the text
    assert start == f"{job.job.start_ns // 10**9}.{job.job.start_ns % 10**9:09d}"
    assert int(presrun.replace(".", "")) in range(before, after + 1)
    assert float(start) <= float(presrun)
    # a stamp the user's own launch script set is kept (it began earlier); the other is added
    _, env = job.wrap(plan.argv, {**plan.child_env, ec.LAUNCH_SCRIPT_START_TIME: "12.5"})
    assert env[ec.LAUNCH_SCRIPT_START_TIME] == "12.5" and ec.LAUNCH_SCRIPT_PRESRUN_TIME in env


def test_entry_index_skips_valued_and_flag_options():
    argv = ["py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--rdzv-id=x"]
    assert jobtrace.entry_index([*argv, "train.py", "--lr", "1"]) == len(argv)
    assert jobtrace.entry_index([*argv, "-m", "pkg", "-m"]) == len(argv)


@pytest.mark.parametrize("attempt", [0, 3])
def test_the_worker_wrapper_sets_the_attempts_traceparent_and_execs_the_entry(tmp_path, attempt):
    job = jobtrace.JobTrace(build(tmp_path), environ=CLEAN, sinks=[])
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        ec.ATTEMPT_TRACE: f"{job.trace_id}:{job.key}",
        ec.RESTART_COUNT: str(attempt),
        "TRACESTATE": "vendor=stale",
    }
    env[ec.LAUNCH_SCRIPT_START_TIME] = env[ec.LAUNCH_SCRIPT_PRESRUN_TIME] = "12.5"
    code = "import os, json; print(json.dumps([os.getpid(), os.environ.get('TRACEPARENT'),"
    code += " os.environ.get('TRACESTATE'), os.environ.get('LENS_LAUNCH_SCRIPT_START_TIME'),"
    code += " os.environ.get('LENS_LAUNCH_SCRIPT_PRESRUN_TIME')]))"
    proc = subprocess.Popen(
        [*jobtrace.wrapper_argv()[1:], "-c", code],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=60)
    pid, seen, state, *stamps = json.loads(out)
    assert pid == proc.pid  # exec: torchrun's signals and exit codes are the real worker's
    assert seen == job.traceparent(attempt)
    assert attempt_entry.traceparent(job.trace_id, attempt_entry.attempt_span_id(job.key, attempt))
    assert state is None
    assert job.traceparent(0) != job.traceparent(1)
    # the launch stamps are the first attempt's: a restarted worker's start-up is not the launch
    assert stamps == (["12.5", "12.5"] if attempt == 0 else [None, None])


def test_a_malformed_attempt_trace_loses_only_the_link():
    env = {**os.environ, "PYTHONPATH": str(REPO), ec.ATTEMPT_TRACE: "nonsense"}
    env.pop(ec.TRACEPARENT, None)
    code = "import os; print(os.environ.get('TRACEPARENT'))"
    out = subprocess.run(
        [*jobtrace.wrapper_argv()[1:], "-c", code],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "None"


def test_the_wrappers_copies_of_the_variable_names_are_envcontracts():
    assert attempt_entry.ATTEMPT_TRACE == ec.ATTEMPT_TRACE
    assert attempt_entry.RESTART_COUNT == ec.RESTART_COUNT
    assert attempt_entry.TRACEPARENT == ec.TRACEPARENT
    assert attempt_entry.LAUNCH_TIMES == (
        ec.LAUNCH_SCRIPT_START_TIME,
        ec.LAUNCH_SCRIPT_PRESRUN_TIME,
    )
    assert attempt_entry.WORKER_RANK_FILE == lay.WORKER_RANK_FILE


def test_attempt_span_ids_are_distinct_and_never_zero():
    assert attempt_entry.attempt_span_id("ffffffffffffffff", 1) == "0000000000000001"
    assert attempt_entry.attempt_span_id("ffffffffffffffff", 0) == "ffffffffffffffff"
    ids = {attempt_entry.attempt_span_id("00000000000000ff", n) for n in range(100)}
    assert len(ids) == 100 and all(len(i) == 16 for i in ids)
    assert attempt_entry.attempt_traceparent("ab" * 16 + ":" + "XY" * 8, 0) is None
    assert attempt_entry.attempt_traceparent("ab" * 16, 0) is None


def _imported(probe: str, *flags: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, *flags, "-c", probe + "; print(sorted(sys.modules))"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    return set(eval(out.stdout))  # a printed list of module names


def test_the_wrapper_and_the_launcher_path_import_nothing_heavy():
    # every worker pays for the wrapper's start-up: no site, only os and sys
    folder = Path(attempt_entry.__file__).parent
    bare = _imported("import sys, os", "-S")
    wrapper = _imported(
        f"import sys; sys.path.insert(0, {str(folder)!r}); import attempt_entry", "-S"
    )
    assert wrapper - bare == {"attempt_entry"}
    # the launcher's start-up path: no protobuf, SDK or gRPC before torchrun is running
    launcher = _imported("import sys, mlaunch.launcher.jobtrace")
    heavy = ("torch", "opentelemetry", "grpc", "google")
    assert not {m for m in launcher if m.split(".")[0] in heavy}


# ---- spans from torchrun's traces ------------------------------------------------------------


def test_a_clean_attempt_and_the_job_with_identity(tmp_path):
    env = {"SLURM_CLUSTER_NAME": "c1", "SLURM_RESTART_COUNT": "2", ec.RESTART_COUNT: "7"}
    plan = build(tmp_path)
    job = jobtrace.JobTrace(plan, environ={**CLEAN, **env})
    Torchrun(plan).attempt(0)
    job.spawned()
    job.poll()
    job.finish(0)
    spans = spans_of(lay.launcher_traces_file(plan.run_dir, 0))
    (root,) = spans[SpanName.JOB]
    (attempt,) = spans[SpanName.JOB_ATTEMPT]
    assert attempt["parent_span_id"] == root["span_id"] and root["parent_span_id"] == ""
    assert attempt["trace_id"] == root["trace_id"] == job.trace_id
    assert attempt["span_id"] == job.traceparent(0).split("-")[2]
    assert attempt["attributes"][Attr.EXIT_CODE] == 0 and attempt["status_code"] == 0
    assert root["attributes"][Attr.EXIT_CODE] == 0 and Attr.TRUNCATED not in root["attributes"]
    assert root["start_ns"] <= attempt["start_ns"] <= attempt["end_ns"] <= root["end_ns"]
    # the launcher's resource: its own incarnation (no te<N>); the attempt names its workers'
    want = run_identity({"SLURM_CLUSTER_NAME": "c1", "SLURM_RESTART_COUNT": "2"})
    res = root["resource"]
    assert res[JOB_UUID] == want[JOB_UUID] and res[RUN_UUID] == want[RUN_UUID]
    assert res["slurm.cluster"] == "c1" and res["slurm.restart_count"] == "2"
    worker = run_identity(
        {"SLURM_CLUSTER_NAME": "c1", "SLURM_RESTART_COUNT": "2", ec.RESTART_COUNT: "0"}
    )
    assert attempt["attributes"][RUN_UUID] == worker[RUN_UUID]
    assert res[ResourceAttr.SERVICE_NAME] == plan.settings.telemetry.service_name
    assert res[ResourceAttr.RUN_ID] == plan.run_id
    assert res[ResourceAttr.PROCESS_PID] == os.getpid() and res[ResourceAttr.NODE_RANK] == 0
    assert res[ResourceAttr.HOST_NAME]


def test_a_killed_worker_ends_its_attempt_and_the_restart_opens_the_next(tmp_path):
    plan = build(tmp_path, {"launch.max_restarts": 1})
    tr = Torchrun(plan)
    path = lay.launcher_traces_file(plan.run_dir, 0)
    job = jobtrace.JobTrace(plan, environ=CLEAN)
    job.spawned()
    tr.attempt(0)
    job.poll()
    tr.failed(-9, 1)
    job.poll()
    # written at once: a SIGKILL of the launcher now would not lose attempt 0
    (first,) = spans_of(path)[SpanName.JOB_ATTEMPT]
    assert first["attributes"][Attr.SIGNAL] == "SIGKILL"
    assert first["attributes"][Attr.FAILED_RANK] == 1
    assert Attr.EXIT_CODE not in first["attributes"]
    assert first["status_code"] == 2 and "SIGKILL" in first["status_message"]
    tr.attempt(1)
    job.poll()
    job.finish(0)
    spans = spans_of(path)
    a0, a1 = spans[SpanName.JOB_ATTEMPT]
    assert a1["attributes"][Attr.ATTEMPT] == 1 and a1["attributes"][Attr.EXIT_CODE] == 0
    assert a1["span_id"] != a0["span_id"] and a1["span_id"] == job.traceparent(1).split("-")[2]
    assert a1["start_ns"] == a0["end_ns"]  # the restart (rendezvous) is the next attempt's
    (root,) = spans[SpanName.JOB]
    assert root["attributes"][Attr.ATTEMPT] == 1 and root["status_code"] == 0


def test_a_failure_on_the_last_attempt_fails_the_job(tmp_path):
    plan = build(tmp_path)
    tr = Torchrun(plan)
    job = jobtrace.JobTrace(plan, environ=CLEAN)
    job.spawned()
    tr.attempt(0)
    tr.failed(1, 0)
    job.finish(1)
    spans = spans_of(lay.launcher_traces_file(plan.run_dir, 0))
    (attempt,) = spans[SpanName.JOB_ATTEMPT]
    (root,) = spans[SpanName.JOB]
    assert attempt["attributes"][Attr.EXIT_CODE] == 1 and attempt["status_code"] == 2
    assert root["attributes"][Attr.EXIT_CODE] == 1 and root["attributes"][Attr.FAILED_RANK] == 0
    assert root["status_code"] == 2


def test_on_several_nodes_the_failed_rank_comes_from_the_trainers_error_file(tmp_path):
    flags = {"launch.nnodes": 2, "launch.node_rank": 1, "launch.rdzv_endpoint": "h:29500"}
    plan = build(tmp_path, flags | {"telemetry.run_id": "r1"})
    tr = Torchrun(plan)
    job = jobtrace.JobTrace(plan, environ=CLEAN)
    job.spawned()
    tr.attempt(0)
    (plan.run_dir / "error-rank3.json").write_text('{"rank": 3}')  # local rank 1 of 2 per node
    tr.failed(1, 1)
    job.finish(1)
    (attempt,) = spans_of(lay.launcher_traces_file(plan.run_dir, 1))[SpanName.JOB_ATTEMPT]
    assert attempt["attributes"][Attr.FAILED_RANK] == 3
    assert attempt["status_message"] == "rank 3 exited with code 1"


def test_an_interrupt_truncates_the_open_attempt_and_the_job(tmp_path):
    plan = build(tmp_path, {"launch.max_restarts": 3})
    tr = Torchrun(plan)
    job = jobtrace.JobTrace(plan, environ=CLEAN)
    job.spawned()
    tr.attempt(0)
    job.interrupted(signal.SIGTERM)
    tr.failed(-15, 0)  # the forwarded SIGTERM, not a failure of the job
    tr.attempt(1)  # nothing starts after an interrupt
    job.finish(128 + signal.SIGTERM, interrupted=signal.SIGTERM)
    spans = spans_of(lay.launcher_traces_file(plan.run_dir, 0))
    assert len(spans[SpanName.JOB_ATTEMPT]) == 1
    for span in (*spans[SpanName.JOB_ATTEMPT], *spans[SpanName.JOB]):
        assert span["attributes"][Attr.TRUNCATED] is True
        assert span["attributes"][Attr.SIGNAL] == "SIGTERM"
        assert span["status_code"] == 2 and span["status_message"] == "interrupted by SIGTERM"


def test_abort_writes_every_open_span_truncated(tmp_path):
    plan = build(tmp_path)
    job = jobtrace.JobTrace(plan, environ=CLEAN)
    job.spawned()
    with pytest.raises(KeyboardInterrupt), job.guard():
        raise KeyboardInterrupt
    spans = spans_of(lay.launcher_traces_file(plan.run_dir, 0))
    assert {s["name"] for s in otlp_json.read_spans(lay.launcher_traces_file(plan.run_dir, 0))} == {
        SpanName.JOB,
        SpanName.JOB_ATTEMPT,
    }
    for span in (*spans[SpanName.JOB_ATTEMPT], *spans[SpanName.JOB]):
        assert span["attributes"][Attr.TRUNCATED] is True
        assert "KeyboardInterrupt" in span["status_message"]


def test_an_inherited_traceparent_parents_the_job(tmp_path):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plan = build(tmp_path)
    job = jobtrace.JobTrace(plan, environ={**CLEAN, ec.TRACEPARENT: parent})
    job.spawned()
    job.finish(0)
    (root,) = spans_of(lay.launcher_traces_file(plan.run_dir, 0))[SpanName.JOB]
    assert root["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert root["parent_span_id"] == "b7ad6b7169203331"


def test_nodes_share_one_trace_and_only_node_0_writes_the_root(tmp_path):
    def node(rank: int) -> jobtrace.JobTrace:
        flags = {"launch.nnodes": 2, "launch.node_rank": rank, "launch.rdzv_endpoint": "h:29500"}
        return jobtrace.JobTrace(build(tmp_path, flags | {"telemetry.run_id": "r1"}), CLEAN)

    n0, n1 = node(0), node(1)
    assert n0.trace_id == n1.trace_id and n0.job.span_id == n1.job.span_id
    assert n0.traceparent(0) != n1.traceparent(0)  # each node's attempts are its own spans
    for job in (n0, n1):
        job.spawned()
        job.finish(0)
    f0, f1 = (lay.launcher_traces_file(n0.plan.run_dir, r) for r in (0, 1))
    assert set(spans_of(f0)) == {SpanName.JOB, SpanName.JOB_ATTEMPT}
    (a1,) = spans_of(f1)[SpanName.JOB_ATTEMPT]
    assert set(spans_of(f1)) == {SpanName.JOB_ATTEMPT}
    assert a1["parent_span_id"] == n0.job.span_id and a1["resource"][ResourceAttr.NODE_RANK] == 1
    # a fresh single-node launch never reuses ids (a resume in the same run directory)
    plan = build(tmp_path)
    assert jobtrace.JobTrace(plan, CLEAN).trace_id != jobtrace.JobTrace(plan, CLEAN).trace_id


def test_off_without_telemetry_or_traces(tmp_path):
    for flags in ({"telemetry.enabled": False}, {"telemetry.traces_enabled": False}):
        plan = build(tmp_path, flags)
        job = jobtrace.start(plan)
        assert job.wrap(plan.argv, plan.child_env) == (plan.argv, plan.child_env)


def test_a_failing_sink_never_stops_the_others(tmp_path):
    class Broken:
        def export(self, request, line):
            raise OSError("disk full")

        def close(self, timeout_s):
            raise OSError("still full")

    plan = build(tmp_path)
    path = tmp_path / "out.jsonl"
    job = jobtrace.JobTrace(plan, environ=CLEAN, sinks=[Broken(), jobtrace.FileSink(path)])
    job.spawned()
    job.finish(0)
    assert len(otlp_json.read_spans(path)) == 2


def test_in_relay_mode_the_job_trace_goes_upstream_through_the_receiver(tmp_path):
    from mlaunch.receiver import Receiver
    from mlaunch.receiver.signals import SIGNALS
    from mlaunch.receiver.upstream import Upstream

    with GrpcOtlpReceiver() as collector:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        }
        relay = {name: Upstream.from_env(env, name) for name in SIGNALS}
        plan = build(tmp_path)
        rx = Receiver(plan.run_dir, relay=relay).start()
        try:
            sinks = jobtrace.relay_sinks(plan, rx)
            assert sinks is not None
            job = jobtrace.JobTrace(plan, environ=CLEAN, sinks=sinks)
            job.spawned()
            job.finish(0)
        finally:
            rx.close(5.0)
        assert collector.wait_for_spans(2, timeout=10)
        assert sorted(s["name"] for s in collector.spans) == sorted(
            [SpanName.JOB_ATTEMPT, SpanName.JOB]
        )
    # The file has them too, and the receiver wrote no per-rank copy of the launcher's spans.
    launcher = otlp_json.read_spans(lay.launcher_traces_file(plan.run_dir, 0))
    assert [s["name"] for s in launcher] == [SpanName.JOB_ATTEMPT, SpanName.JOB]
    telemetry = plan.run_dir / lay.TELEMETRY_DIR
    assert not list(telemetry.glob("traces-unranked*")) and not list(telemetry.glob("spool-*"))


def test_without_the_relay_the_job_trace_keeps_its_default_sinks(tmp_path):
    assert jobtrace.relay_sinks(build(tmp_path), None) is None


# ---- upstream --------------------------------------------------------------------------------


@pytest.mark.parametrize("receiver", [GrpcOtlpReceiver, HttpOtlpReceiver])
def test_the_job_trace_reaches_an_otlp_endpoint(tmp_path, receiver):
    with receiver() as rx:
        plan = build(
            tmp_path,
            {
                "telemetry.exporter": "otlp",
                "telemetry.otel.base_endpoint": rx.endpoint,
                "telemetry.otel.base_protocol": "grpc" if receiver is GrpcOtlpReceiver
                else "http/protobuf",
                "telemetry.otel.headers": {"x-team": "lens"},
            },
        )  # fmt: skip
        job = jobtrace.start(plan)
        assert any(isinstance(s, jobtrace.UpstreamSink) for s in job.sinks)
        job.spawned()
        job.finish(0)
        assert rx.wait_for_spans(2, timeout=10)
        names = sorted(s["name"] for s in rx.spans)
        assert names == [SpanName.JOB, SpanName.JOB_ATTEMPT]
        assert {s["span_id"] for s in rx.spans} == {
            s["span_id"] for s in otlp_json.read_spans(lay.launcher_traces_file(plan.run_dir, 0))
        }
        assert all(h.get("x-team") == "lens" for h in rx.headers)


@pytest.mark.parametrize(
    ("protocol", "status"),
    [("grpc", "(gRPC UNAVAILABLE: "), ("http/protobuf", "(Connection refused)")],
)
def test_a_delivery_failure_is_one_line_endpoint_status_and_where_the_spans_go(
    tmp_path, caplog, protocol, status
):
    # A real refused connection: gRPC's error would print as its multi-line _InactiveRpcError
    # repr (debug_error_string and all), urllib's as "<urlopen error ...>".
    endpoint = closed_port_endpoint()
    flags = {
        "telemetry.exporter": "otlp",
        "telemetry.otel.base_endpoint": endpoint,
        "telemetry.otel.base_protocol": protocol,
    }
    plan = build(tmp_path, flags)
    with caplog.at_level(logging.WARNING, logger=jobtrace.log.name):
        job = jobtrace.start(plan)
        job.spawned()
        job.finish(0)
    (said,) = [
        r.getMessage() for r in caplog.records if "job trace: cannot deliver" in r.getMessage()
    ]
    spool = lay.spooled(lay.launcher_traces_file(plan.run_dir, 0))
    assert said.startswith(f"job trace: cannot deliver to {endpoint}"), said
    assert status in said and "\n" not in said
    assert "debug_error_string" not in said and "<" not in said
    assert said.endswith(
        f"; its spans are spooled to {spool}; send them later with mlaunch trace replay"
    )
    assert len(otlp_json.read_spans(spool)) == 2


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_hanging_endpoint_costs_the_launcher_a_bounded_wait(tmp_path, protocol):
    with HangingServer() as hang:
        flags = {
            "telemetry.exporter": "otlp",
            "telemetry.otel.base_endpoint": hang.endpoint,
            "telemetry.otel.base_protocol": protocol,
            "telemetry.shutdown_timeout_s": 1.0,
        }
        plan = build(tmp_path, flags)
        job = jobtrace.start(plan)
        job.spawned()
        t0 = time.monotonic()
        job.finish(0)
        assert time.monotonic() - t0 < jobtrace.UPSTREAM_CLOSE_S + 1
    written = otlp_json.read_spans(lay.launcher_traces_file(plan.run_dir, 0))
    assert len(written) == 2
    # what close gave up on is spooled for `mlaunch trace replay`, each span once
    spooled = otlp_json.read_spans(lay.spooled(lay.launcher_traces_file(plan.run_dir, 0)))
    assert sorted(s["span_id"] for s in spooled) == sorted(s["span_id"] for s in written)


# ---- encoding --------------------------------------------------------------------------------


def test_the_stdlib_encoding_is_valid_otlp_json():
    span = otlp_json.encode_span(
        name="n", trace_id="ab" * 16, span_id="cd" * 8, parent_span_id="ef" * 8, start_ns=1,
        end_ns=2, attributes={"s": "x", "i": -3, "f": 0.5, "b": True, "l": [1, 2], "none": None},
        status_code=2, status_message="why",
    )  # fmt: skip
    request = otlp_json.trace_request({"service.name": "svc", "process.pid": 7}, "scope", [span])
    line = json.dumps(request)
    proto = otlp_json.decode_traces_line(line)  # protobuf's parser accepts it
    assert otlp_json.trace_request_to_dict(proto) == request
    (flat,) = otlp_json.iter_spans(request)
    assert flat["attributes"] == {"s": "x", "i": -3, "f": 0.5, "b": True, "l": [1, 2]}
    assert (flat["status_code"], flat["status_message"], flat["parent_span_id"]) == (
        2,
        "why",
        "ef" * 8,
    )
    assert flat["resource"] == {"service.name": "svc", "process.pid": 7}
