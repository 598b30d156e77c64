"""The launcher's embedded OTLP receiver lets in only the job's own workers, tried as another user
on the node would: a real ``mlaunch train --script`` run hosting the receiver, and from the test
process (the "second shell") exports sent to the launcher's listening ports with no token and
with a wrong one, over gRPC and HTTP, while the job runs.

- embedded: both refused (``UNAUTHENTICATED`` / 401), counted, and absent from the run directory;
  the workers' own spans (an ``mlaunch.telemetry`` script) arrive; the token is in no file of the
  run directory, not in the launcher's output, and on no process's command line (``ps``);
- relay: the collector gets the workers' spans and never a forged one, with the user's header
  and never the workers' token.

The real nemo-lens worker authenticates too: tests/integration/test_receiver_script.py (its
spans arrive, embedded and relayed, only because it sends the token it was handed).
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.launch_runs import clean_env, finish, mlaunch
from support.otlp import GrpcOtlpReceiver

from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FORGED = "forged.by.another.user"
SECRET = "user-api-key-5e4d3c"
TRACE_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

#: A ``--script`` worker using mlaunch.telemetry. It writes what the test needs outside the run
#: directory (argv[1]): its token (so the test can look for it), whether any process's command
#: line holds it, and "ready"; it waits for the test's "go" before its own spans.
WORKER = """
import os, sys, time
from pathlib import Path
from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import SpanName as S

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
token = os.environ["OTEL_EXPORTER_OTLP_HEADERS"].partition("Bearer%20")[2]
(out / f"token-rank{rank}").write_text(token)
seen = []
for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
    try:
        if token.encode() in cmdline.read_bytes():
            seen.append(cmdline.parent.name)
    except OSError:
        pass
(out / f"ps-rank{rank}").write_text(",".join(seen))
(out / f"ready-rank{rank}").write_text("")
deadline = time.monotonic() + 120
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
with telemetry.setup(rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                     local_rank=int(os.environ["LOCAL_RANK"])):
    with telemetry.span(G.JOB, S.STARTUP):
        pass
    with telemetry.span(G.JOB, S.TRAIN):
        pass
"""


def listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` listens on (what another user finds with ``ss -ltn``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def forged_request() -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.int_value = "dl.rank", 0
    span = rs.scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = FORGED, b"\x01" * 16, b"\x02" * 8
    return req.SerializeToString()


def forge(port: int) -> list[str]:
    """Send the forged span to ``port`` as gRPC and as HTTP, with no token and a wrong one; what
    each answered (``grpc:UNAUTHENTICATED``, ``http:401``; a protocol the port does not speak
    answers something else)."""
    body, said = forged_request(), []
    for metadata in (None, (("authorization", "Bearer guessed"),)):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            channel.unary_unary(TRACE_PATH)(body, timeout=5, metadata=metadata)
            said.append("grpc:OK")
        except grpc.RpcError as exc:
            said.append(f"grpc:{exc.code().name}")
        finally:
            channel.close()
    for headers in ({}, {"Authorization": "Bearer guessed"}):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/traces", data=body, method="POST",
            headers={"Content-Type": "application/x-protobuf", **headers},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                said.append(f"http:{resp.status}")
        except urllib.error.HTTPError as exc:
            said.append(f"http:{exc.code}")
        except (OSError, http.client.HTTPException):  # the gRPC port: not HTTP/1.1
            said.append("http:no-answer")
    return said


def wait_for(paths: list[Path], proc) -> None:
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the workers never got ready"
        time.sleep(0.05)


def run_and_forge(tmp_path: Path, *extra: str, env: dict[str, str]) -> tuple[str, Path, Path, list]:
    """Start the job, forge against every port the launcher listens on while the workers wait,
    let them finish; (launcher output, run dir, the workers' folder, what the ports answered)."""
    out_dir = tmp_path / "outside"
    out_dir.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(script), "--run-dir", str(run_dir), "--nproc-per-node", "2",
        "--otel-enabled", "--otel-export-strategy", "all_ranks", *extra, "--", str(out_dir),
        cwd=tmp_path, env=env,
    )  # fmt: skip
    answers = []
    try:
        wait_for([out_dir / f"ready-rank{r}" for r in (0, 1)], proc)
        ports = listening_ports(proc.pid)
        assert len(ports) == 2, ports  # the receiver's gRPC and HTTP listeners
        answers = sorted(a for p in ports for a in forge(p))
    finally:
        (out_dir / "go").write_text("")
        code, out = finish(proc)
    assert code == 0, out
    return out, run_dir, out_dir, answers


def assert_refused_and_secret(out: str, run_dir: Path, out_dir: Path, answers: list) -> None:
    # Each port refused the request it understands, twice (no token, a wrong one).
    assert answers.count("grpc:UNAUTHENTICATED") == 2 and answers.count("http:401") == 2, answers
    assert "grpc:OK" not in answers and "http:200" not in answers, answers
    stats = json.loads(lay.receiver_stats_file(run_dir).read_text())
    assert stats["authenticated"] is True
    assert stats["signals"]["traces"]["unauthenticated_requests"] == 4
    # Logged once as it happens, and counted in the end-of-run summary.
    assert out.count("OTLP receiver: refused a request without this job's token") == 1
    assert "receiver: refused 4 request(s) without this job's token (nothing kept)" in out
    tokens = {(out_dir / f"token-rank{r}").read_text() for r in (0, 1)}
    assert len(tokens) == 1 and len(token := tokens.pop()) >= 32  # one token per launch (node)
    assert (out_dir / "ps-rank0").read_text() == "", "the token is on a command line"
    assert token not in out
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert token not in text and FORGED not in text, path


def test_embedded_receiver_refuses_other_users_and_keeps_the_workers_spans(tmp_path: Path):
    out, run_dir, out_dir, answers = run_and_forge(tmp_path, env=clean_env())
    assert_refused_and_secret(out, run_dir, out_dir, answers)
    stats = json.loads(lay.receiver_stats_file(run_dir).read_text())
    assert stats["mode"] == "embedded"
    for rank in (0, 1):  # the workers' own spans arrived (they sent the token)
        names = {s["name"] for s in read_spans(lay.traces_file(run_dir, rank))}
        assert names and FORGED not in names, names


def test_relay_forwards_only_the_workers_spans_with_the_users_header(tmp_path: Path):
    with GrpcOtlpReceiver() as collector:
        env = clean_env(OTEL_EXPORTER_OTLP_HEADERS=f"x-api-key={SECRET}")
        out, run_dir, out_dir, answers = run_and_forge(
            tmp_path, "--otel-exporter", "otlp", "--otlp-endpoint", collector.endpoint, env=env
        )
        assert_refused_and_secret(out, run_dir, out_dir, answers)
        stats = json.loads(lay.receiver_stats_file(run_dir).read_text())
        assert stats["mode"] == "relay" and stats["signals"]["traces"]["forwarded_items"] > 0
        assert collector.wait_for_spans(stats["signals"]["traces"]["forwarded_items"], timeout=10)
        names = {s["name"] for s in collector.spans}
        assert FORGED not in names and {s["resource"].get("dl.rank") for s in collector.spans} >= {
            0, 1
        }  # fmt: skip
        token = (out_dir / "token-rank0").read_text()
        assert all(h.get("x-api-key") == SECRET for h in collector.headers)
        assert all(token not in json.dumps(h) for h in collector.headers)
    assert SECRET not in out


def test_mlaunchs_trainer_through_the_relay_sends_the_token(tmp_path: Path):
    """mlaunch's own trainer (its telemetry runtime's exporters) with ``--otlp-relay``: its spans
    get through the receiver (so it sends the token) and reach the collector."""
    run_dir = tmp_path / "run"
    with GrpcOtlpReceiver() as collector:
        proc = mlaunch(
            "--run-dir", str(run_dir), "--nproc-per-node", "1", "--train-iters", "2",
            "--eval-interval", "0", "--device", "cpu", "--otel-enabled", "--otel-exporter",
            "otlp", "--otlp-endpoint", collector.endpoint, "--otlp-relay",
            cwd=tmp_path, env=clean_env(),
        )  # fmt: skip
        code, out = finish(proc)
        assert code == 0, out
        stats = json.loads(lay.receiver_stats_file(run_dir).read_text())
        traces = stats["signals"]["traces"]
        assert stats["mode"] == "relay" and traces["unauthenticated_requests"] == 0, stats
        assert traces["forwarded_items"] > 0 and traces["spooled_items"] == 0, stats
        assert collector.wait_for_spans(traces["forwarded_items"], timeout=10)
        assert {s["resource"].get("dl.rank") for s in collector.spans} >= {0}
