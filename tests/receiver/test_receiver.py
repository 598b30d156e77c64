"""The launcher's embedded OTLP receiver with real clients: the OTel SDK's OTLP exporters (gRPC and
HTTP/protobuf, as a worker uses them), raw OTLP/JSON over HTTP, gzip, a full queue, broken and
vanishing clients, a disk that refuses writes, and the in-process ingestion API.

What arrives must land in the run directory exactly as mlaunch's file exporter writes it: one
OTLP/JSON line per request and rank, in ``telemetry/traces-rank{R}.jsonl`` (``metrics-``,
``logs-``), readable by ``mlaunch trace``'s reader unchanged.
"""

from __future__ import annotations

import gzip
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support.otlp import RECEIVER_HEADERS, RECEIVER_TOKEN

from mlaunch.otlp.otlp_json import read_metrics, read_spans
from mlaunch.receiver import Receiver
from mlaunch.receiver import core as rx_core
from mlaunch.rundir import layout as lay
from mlaunch.trace.reader import TraceReader

TRACE_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def emit(exporter, n: int, rank: int | None = 0, name: str = "megatron.train_step") -> list[str]:
    """End ``n`` spans through ``exporter`` (one request each, as a worker's SDK sends them,
    each acknowledged before the next); their span ids (hex)."""
    attrs = {"service.name": "worker"} if rank is None else {"dl.rank": rank}
    tp = TracerProvider(resource=Resource.create(attrs))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    ids = []
    for i in range(n):
        with tp.get_tracer("t").start_as_current_span(name, attributes={"i": i}) as sp:
            ids.append(format(sp.get_span_context().span_id, "016x"))
    return ids  # exported on end (SimpleSpanProcessor); the exporter stays usable


@pytest.fixture
def rx(tmp_path: Path):
    r = Receiver(tmp_path, token=RECEIVER_TOKEN, log=lambda m: None).start()
    yield r
    r.close()


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """POST as an authenticated client (the job's token unless ``headers`` says otherwise)."""
    req = urllib.request.Request(
        url, data=body, method="POST", headers={**RECEIVER_HEADERS, **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_sdk_exporters_grpc_and_http_land_in_per_rank_files(rx: Receiver, tmp_path: Path) -> None:
    assert rx.grpc_endpoint and rx.http_endpoint
    assert rx.grpc_endpoint.startswith("http://127.0.0.1:")  # loopback only
    ids0 = emit(GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True), 7, rank=0)
    ids1 = emit(
        HttpSpans(endpoint=rx.http_endpoint + "/v1/traces", compression=Compression.Gzip), 5, rank=1
    )
    for rank, exporter in ((0, GrpcMetrics(endpoint=rx.grpc_endpoint, insecure=True)),
                           (1, HttpMetrics(endpoint=rx.http_endpoint + "/v1/metrics"))):  # fmt: skip
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
        mp = MeterProvider(resource=Resource.create({"dl.rank": rank}), metric_readers=[reader])
        mp.get_meter("m").create_counter("tokens").add(5)
        mp.shutdown()
    lp = LoggerProvider(resource=Resource.create({"dl.rank": 0}))
    lp.add_log_record_processor(
        SimpleLogRecordProcessor(OTLPLogExporter(endpoint=rx.grpc_endpoint, insecure=True))
    )
    from opentelemetry.sdk._logs import LoggingHandler

    log = logging.getLogger("test-receiver-logs")
    handler = LoggingHandler(logger_provider=lp)
    log.addHandler(handler)
    log.warning("hello from rank 0")
    log.removeHandler(handler)
    lp.shutdown()

    stats = rx.close()
    t = stats.signals["traces"]
    assert (t.received_items, t.written_items, t.lost_items, t.unranked_items) == (12, 12, 0, 0)
    assert [s["span_id"] for s in read_spans(lay.traces_file(tmp_path, 0))] == ids0
    assert [s["span_id"] for s in read_spans(lay.traces_file(tmp_path, 1))] == ids1
    # One line per request, as the file exporter writes (SimpleSpanProcessor: one span each).
    assert len(lay.traces_file(tmp_path, 0).read_text().splitlines()) == 7
    for rank in (0, 1):
        metrics = read_metrics(lay.metrics_file(tmp_path, rank))
        assert [m["name"] for m in metrics] == ["tokens"]
        assert metrics[0]["resource"]["dl.rank"] == rank
    logs = lay.received_file(tmp_path, "logs", 0).read_text()
    assert "hello from rank 0" in logs
    assert stats.signals["logs"].written_items == 1
    # mlaunch trace's reader reads the directory unchanged, ranks from dl.rank.
    reader = TraceReader.open(tmp_path)
    by_rank: dict[int, int] = {}
    for res, spans, _ in reader:
        by_rank[res.rank] = by_rank.get(res.rank, 0) + len(spans)
    assert by_rank == {0: 7, 1: 5}
    saved = json.loads(lay.receiver_stats_file(tmp_path).read_text())
    assert saved["signals"]["traces"]["written_items"] == 12
    assert saved["mode"] == "embedded"


def _json_request(trace_id: str, span_id: str, rank: int) -> dict:
    return {
        "resourceSpans": [{
            "resource": {"attributes": [{"key": "dl.rank", "value": {"intValue": str(rank)}}]},
            "scopeSpans": [{"scope": {"name": "js"}, "spans": [{
                "traceId": trace_id, "spanId": span_id, "name": "from-json", "kind": 1,
                "startTimeUnixNano": "1000", "endTimeUnixNano": "2000",
            }]}],
        }]
    }  # fmt: skip


def test_http_json_bodies_plain_and_gzip(rx: Receiver, tmp_path: Path) -> None:
    tid, sid = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    body = json.dumps(_json_request(tid, sid, 3)).encode()
    code, _, reply = post(
        rx.http_endpoint + "/v1/traces", body, {"Content-Type": "application/json"}
    )
    assert (code, reply) == (200, b"{}")
    code, _, _ = post(
        rx.http_endpoint + "/v1/traces", gzip.compress(body),
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )  # fmt: skip
    assert code == 200
    rx.close()
    spans = read_spans(lay.traces_file(tmp_path, 3))
    assert [(s["trace_id"], s["span_id"], s["name"]) for s in spans] == [
        (tid, sid, "from-json")
    ] * 2


def test_unranked_sender_gets_its_own_clearly_named_file(rx: Receiver, tmp_path: Path) -> None:
    emit(GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True), 3, rank=None)
    stats = rx.close()
    assert stats.signals["traces"].unranked_items == 3
    path = lay.received_file(tmp_path, "traces", None)
    assert path.name == "traces-unranked.jsonl"
    assert len(read_spans(path)) == 3


def test_bad_requests_are_refused_or_counted_and_the_receiver_keeps_serving(
    rx: Receiver, tmp_path: Path
) -> None:
    url = rx.http_endpoint
    proto = {"Content-Type": "application/x-protobuf"}
    assert post(url + "/v1/nope", b"", proto)[0] == 404
    assert post(url + "/v1/traces", b"not json", {"Content-Type": "application/json"})[0] == 400
    assert post(url + "/v1/traces", b"\x00junk", {**proto, "Content-Encoding": "gzip"})[0] == 400
    # A gzip bomb: 17 MiB of zeros in a few KiB.
    bomb = gzip.compress(b"\0" * (rx_core.MAX_REQUEST_BYTES + 2**20))
    assert post(url + "/v1/traces", bomb, {**proto, "Content-Encoding": "gzip"})[0] == 413
    # Accepted (protobuf is parsed off the request path), then counted as malformed.
    assert post(url + "/v1/traces", b"\xff\xff\xff\xff", proto)[0] == 200
    # A client announcing a big body, sending half and vanishing; another connecting and leaving.
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf"
                  b"\r\nContent-Length: 100000\r\n\r\n" + b"\x0a" * 5000)  # fmt: skip
    socket.create_connection((host, int(port))).close()
    # A gRPC client that gives up (deadline) mid-call and one sending garbage bytes.
    channel = grpc.insecure_channel(rx.grpc_endpoint.removeprefix("http://"))
    raw = channel.unary_unary(TRACE_PATH)
    raw(
        b"\xff\xff\xff\xff", timeout=5, metadata=tuple(RECEIVER_HEADERS.items())
    )  # accepted, malformed later
    channel.close()
    ids = emit(GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True), 2)
    ids += emit(HttpSpans(endpoint=url + "/v1/traces"), 2)
    stats = rx.close()
    assert stats.signals["traces"].malformed_requests == 3  # the bad JSON and the 2 bad protobufs
    assert [s["span_id"] for s in read_spans(lay.traces_file(tmp_path, 0))] == ids
    assert stats.closed_in_s is not None and stats.closed_in_s < 3


class _SlowReceiver(Receiver):
    """A writer that cannot keep up (each request takes a while), to fill the queue."""

    def _handle(self, item) -> None:  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        super()._handle(item)


def test_full_queue_refuses_with_a_retryable_status_counted(tmp_path: Path) -> None:
    said: list[str] = []
    rx = _SlowReceiver(tmp_path, token=RECEIVER_TOKEN, max_queued_bytes=1, log=said.append).start()
    body = ExportTraceServiceRequest().SerializeToString() + b"\x0a\x00"  # one empty resource
    channel = grpc.insecure_channel(rx.grpc_endpoint.removeprefix("http://"))
    raw = channel.unary_unary(TRACE_PATH)
    auth = tuple(RECEIVER_HEADERS.items())
    raw(body, timeout=5, metadata=auth)  # queue empty: accepted even over budget
    with pytest.raises(grpc.RpcError) as exc:
        raw(body, timeout=5, metadata=auth)  # the writer is still busy with the first one
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(exc.value.trailing_metadata())
    assert "google.rpc.retryinfo-bin" in trailers  # the SDK waits as told, then retries
    code, headers, _ = post(
        rx.http_endpoint + "/v1/traces", body, {"Content-Type": "application/x-protobuf"}
    )
    assert code == 429 and headers["Retry-After"] == "1"
    channel.close()
    stats = rx.close()
    t = stats.signals["traces"]
    assert t.rejected_requests == 2 and t.rejected_bytes == 2 * len(body)
    assert sum("queue full" in m for m in said) == 1  # logged once


def test_a_disk_that_refuses_writes_never_raises(tmp_path: Path) -> None:
    (tmp_path / lay.TELEMETRY_DIR).write_text("a file where the folder should be")
    said: list[str] = []
    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=said.append).start()
    emit(GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True), 3)
    stats = rx.close()
    t = stats.signals["traces"]
    assert (t.received_items, t.written_items, t.lost_items) == (3, 0, 3)
    assert any("cannot write" in m for m in said)
    assert len([m for m in said if "traces-rank0" in m]) == 1  # once, not per request


def test_a_listener_that_cannot_start_leaves_the_other(tmp_path: Path, monkeypatch) -> None:
    from mlaunch.launcher import receiver_wiring as wiring
    from mlaunch.receiver import frontends

    def no_port(_receiver):  # type: ignore[no-untyped-def]
        raise OSError("no free port on 127.0.0.1")

    monkeypatch.setattr(frontends, "GrpcFrontend", no_port)
    said: list[str] = []
    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=said.append).start()
    assert rx.grpc_endpoint is None and rx.http_endpoint
    env = wiring.worker_env(rx, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert env is not None
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == rx.http_endpoint
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    emit(HttpSpans(endpoint=rx.http_endpoint + "/v1/traces"), 2)
    assert rx.close().signals["traces"].written_items == 2
    assert any("gRPC listener" in m for m in said)


def test_ingest_api_goes_through_the_same_path(tmp_path: Path) -> None:
    """The launcher's own job trace (mlaunch.job / mlaunch.job.attempt) enters in-process."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    captured: list = []

    class Capture(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            captured.extend(spans)
            return SpanExportResult.SUCCESS

    tp = TracerProvider(resource=Resource.create({"service.name": "mlaunch"}))
    tp.add_span_processor(SimpleSpanProcessor(Capture()))
    with tp.get_tracer("mlaunch").start_as_current_span("mlaunch.job"):
        pass
    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=lambda m: None)  # no listeners needed
    launcher_file = lay.launcher_traces_file(tmp_path, 0)
    assert rx.ingest_traces(encode_spans(captured), local_file=launcher_file)
    stats = rx.close()
    assert [s["name"] for s in read_spans(launcher_file)] == ["mlaunch.job"]
    assert stats.signals["traces"].written_items == 1
    assert not rx.ingest_traces(encode_spans(captured))  # closed: refused, never blocks


def test_close_with_requests_in_flight_flushes_everything(tmp_path: Path) -> None:
    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=lambda m: None).start()
    exporters = [GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True) for _ in range(3)]
    threads = [threading.Thread(target=emit, args=(e, 50)) for e in exporters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = rx.close()
    assert stats.signals["traces"].written_items == 150
    assert len(read_spans(lay.traces_file(tmp_path, 0))) == 150


def test_only_the_jobs_token_gets_in_grpc_and_http_every_signal(rx: Receiver, tmp_path) -> None:
    """No token, a wrong one, a second (duplicate) header: refused (gRPC UNAUTHENTICATED, HTTP
    401) for traces, metrics and logs, counted, logged once; nothing queued or written."""
    said: list[str] = []
    rx._log = said.append
    from mlaunch.receiver.signals import SIGNALS

    wrong = {"authorization": "Bearer not-the-token"}
    body = ExportTraceServiceRequest().SerializeToString() + b"\x0a\x00"
    channel = grpc.insecure_channel(rx.grpc_endpoint.removeprefix("http://"))
    for name, sig in SIGNALS.items():
        raw = channel.unary_unary(f"/{sig.service}/Export")
        for metadata in (None, tuple(wrong.items()), (*RECEIVER_HEADERS.items(), *wrong.items())):
            with pytest.raises(grpc.RpcError) as exc:
                raw(body, timeout=5, metadata=metadata)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for headers in ({"authorization": ""}, wrong, {"Authorization": RECEIVER_TOKEN}):
            code, reply, _ = post(rx.http_endpoint + f"/v1/{name}", body, headers)
            assert code == 401 and reply.get("WWW-Authenticate") == "Bearer"
    channel.close()
    # The SDK exporter a stranger would use, with no headers at all: refused, not retried.
    stranger = GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True, headers={"x": "y"})
    emit(stranger, 1)
    stats = rx.close()
    for name in SIGNALS:
        c = stats.signals[name]
        assert c.unauthenticated_requests == 6 + (name == "traces")
        assert (c.received_requests, c.written_items) == (0, 0)
    assert not list((tmp_path / lay.TELEMETRY_DIR).glob("*.jsonl"))
    assert sum("without this job's token" in m for m in said) == 1  # logged once
    assert all(RECEIVER_TOKEN not in m for m in said + stats.errors)
    assert stats.authenticated and RECEIVER_TOKEN not in json.dumps(stats.to_json())


def test_a_receiver_without_a_given_token_makes_a_fresh_one(tmp_path: Path) -> None:
    a, b = Receiver(tmp_path, log=lambda m: None), Receiver(tmp_path, log=lambda m: None)
    try:
        assert a.token != b.token and len(a.token) >= 32
        assert a.authorized(f"Bearer {a.token}") and not a.authorized(f"Bearer {b.token}")
        assert not a.authorized(a.token) and not a.authorized(None)
    finally:
        a.close(0.5), b.close(0.5)


def test_the_store_appends_come_at_geometric_steps(tmp_path: Path) -> None:
    """The first append after ``min_bytes`` of trace lines, then once the new bytes reach
    ``growth`` times what the store holds: few appends (and compactions) however long the run."""
    from mlaunch.receiver.store_append import StoreAppender

    a = StoreAppender(tmp_path, lambda key, msg: None, min_bytes=100, growth=0.25)
    a.close()  # the schedule alone: no watcher thread acting on it
    a.note(99)
    assert not a.due()
    a.note(1)
    assert a.due()
    a.stored = a.written = 1000
    assert not a.due()
    a.note(249)
    assert not a.due()
    a.note(1)
    assert a.due()


def test_only_embedded_trace_lines_count_towards_the_store(tmp_path: Path) -> None:
    """The receiver counts the bytes of the trace lines it writes (its metrics and logs are not
    in the span store); a relay (nothing of the workers' spans written locally) has no appender."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    from mlaunch.receiver import Upstream

    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=lambda m: None, store_min_bytes=1 << 62)
    assert rx._store is not None
    metrics = ExportMetricsServiceRequest()
    rm = metrics.resource_metrics.add()
    kv = rm.resource.attributes.add()
    kv.key, kv.value.int_value = "dl.rank", 0
    rm.scope_metrics.add().metrics.add().name = "m"
    assert rx.ingest_metrics(metrics)
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.int_value = "dl.rank", 0
    span = rs.scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = "megatron.train_step", b"\1" * 16, b"\2" * 8
    assert rx.ingest_traces(req)
    stats = rx.close()
    assert lay.received_file(tmp_path, "metrics", 0).stat().st_size > 0
    assert stats.store_appends == 0
    assert rx._store.written == lay.traces_file(tmp_path, 0).stat().st_size > 0
    relay = Receiver(tmp_path / "relay", token=RECEIVER_TOKEN, log=lambda m: None,
                     relay={"traces": Upstream.from_env({}, "traces")}, store_min_bytes=1)  # fmt: skip
    assert relay._store is None
    relay.close(0.5)
