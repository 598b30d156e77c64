# ruff: noqa: SIM117 - nested with-blocks mirror the span tree under test
"""The OTLP/JSON line format (exact field conventions, decode/encode round trip), the console
exporter, incremental file writes, the log bridge, OTEL_SDK_DISABLED."""

from __future__ import annotations

import base64
import json
import logging
import time

from support.otlp import GrpcOtlpReceiver

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr
from mlaunch.model.spans import SpanName as S
from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay


def _emit_some() -> None:
    with telemetry.span(
        G.STEP, S.ITERATION, **{Attr.ITERATION: 7, Attr.LOSS: 2.5, Attr.SKIPPED: False}
    ):
        with telemetry.span(G.COMMUNICATION, S.P2P_SEND_FORWARD):  # noqa: SIM117
            carrier: dict[str, str] = {}
            telemetry.inject(carrier)
        with telemetry.linked_span(G.LAYER, S.LAYER_FORWARD, carrier, tags=["a"]):
            pass


def test_trace_lines_follow_the_otlp_json_conventions(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    _emit_some()
    telemetry.record_step(7, step_ms=12.5, loss=2.5)
    telemetry.shutdown()
    lines = lay.traces_file(tmp_path, 0).read_text().splitlines()
    spans = []
    for line in lines:
        request = json.loads(line)
        (rs,) = request["resourceSpans"]
        assert {"resource", "scopeSpans"} <= rs.keys()
        for ss in rs["scopeSpans"]:
            assert ss["scope"]["name"] == "mlaunch"
            spans.extend(ss["spans"])
        # decoding and re-encoding gives the same line content
        assert otlp_json.trace_request_to_dict(otlp_json.decode_traces_line(line)) == request
    for sp in spans:
        assert len(sp["traceId"]) == 32 and int(sp["traceId"], 16)
        assert len(sp["spanId"]) == 16 and sp["spanId"] == sp["spanId"].lower()
        assert isinstance(sp["startTimeUnixNano"], str) and sp["startTimeUnixNano"].isdigit()
        assert sp["kind"] == 1  # SPAN_KIND_INTERNAL as an integer
    step = next(sp for sp in spans if sp["name"] == S.ITERATION)
    values = {kv["key"]: kv["value"] for kv in step["attributes"]}
    assert values[Attr.ITERATION] == {"intValue": "7"}
    assert values[Attr.LOSS] == {"doubleValue": 2.5}
    assert values[Attr.SKIPPED] == {"boolValue": False}
    layer = next(sp for sp in spans if sp["name"] == S.LAYER_FORWARD)
    assert len(layer["parentSpanId"]) == 16
    assert layer["attributes"][0]["value"] == {"arrayValue": {"values": [{"stringValue": "a"}]}}
    assert len(layer["links"][0]["spanId"]) == 16

    metric_lines = lay.metrics_file(tmp_path, 0).read_text().splitlines()
    request = json.loads(metric_lines[-1])
    assert "resourceMetrics" in request
    assert (
        otlp_json.metrics_request_to_dict(otlp_json.decode_metrics_line(metric_lines[-1]))
        == request
    )


def test_a_bytes_attribute_reads_back_as_the_bytes_written():
    # OTLP/JSON writes hex only for trace and span ids; every other bytes field keeps protobuf's
    # JSON mapping, base64. Both writers agree (mlaunch's file exporter and protobuf's printer,
    # which the collector's file exporter follows), and the one decoder gives the bytes back.
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    from mlaunch.otlp.encode import json_value

    raw = b"\x00\xffmlaunch"
    for written in (json_value(raw), MessageToDict(AnyValue(bytes_value=raw))):
        assert written == {"bytesValue": base64.b64encode(raw).decode("ascii")}
        assert otlp_json.any_value(written) == raw
        assert otlp_json.attributes([{"key": "k", "value": written}]) == {"k": raw}
    # Not base64: kept as written, never an exception (one bad attribute must not stop a reader).
    assert otlp_json.any_value({"bytesValue": "not base64!"}) == "not base64!"


def test_readers_skip_a_torn_last_line(tmp_path):
    path = tmp_path / "t.jsonl"
    good = {
        "resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "traceId": "0" * 31 + "1"}]}]}]
    }
    path.write_text(json.dumps(good) + "\n" + '{"resourceSpans": [{"sco')
    assert [s["name"] for s in otlp_json.read_spans(path)] == ["x"]


def test_console_exporter_writes_json_lines_to_stdout(make_settings, tmp_path, capsys):
    telemetry.setup(
        make_settings(EXPORTER="console", METRICS_ENABLED="0"),
        rank=0,
        world_size=1,
        run_dir=tmp_path,
    )
    _emit_some()
    telemetry.shutdown()
    out = capsys.readouterr().out.splitlines()
    names = [s["name"] for line in out for s in otlp_json.iter_spans(json.loads(line))]
    assert sorted(names) == sorted([S.ITERATION, S.P2P_SEND_FORWARD, S.LAYER_FORWARD])
    assert not (tmp_path / lay.TELEMETRY_DIR).exists()


def test_file_is_written_while_running_not_only_at_shutdown(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    _emit_some()
    path = lay.traces_file(tmp_path, 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (path.exists() and path.read_text().strip()):
        time.sleep(0.05)
    assert len(otlp_json.read_spans(path)) == 3  # before shutdown


def test_log_bridge_sends_python_logging_to_otlp(make_settings, tmp_path):
    with GrpcOtlpReceiver() as rx:
        settings = make_settings(
            EXPORTER="otlp", LOGS_ENABLED="1", OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint
        )
        telemetry.setup(settings, rank=0, world_size=1, run_dir=tmp_path)
        logging.getLogger("trainer-test").warning("hello from the trainer")
        telemetry.shutdown(5.0)
        assert rx.wait_for_logs(1, timeout=10)
        assert any(r.body.string_value == "hello from the trainer" for r in rx.logs)
    assert not any(type(h).__name__ == "LoggingHandler" for h in logging.getLogger().handlers)


def test_otel_sdk_disabled_turns_telemetry_off(make_settings, tmp_path):
    handle = telemetry.setup(
        make_settings(OTEL_SDK_DISABLED="true"), rank=0, world_size=1, run_dir=tmp_path
    )
    assert not handle.exporting and not telemetry.is_enabled(G.JOB)


def test_an_exporter_that_cannot_be_built_spools_instead_of_raising(make_settings, tmp_path):
    settings = make_settings(
        EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT="https://127.0.0.1:9",
        OTEL_EXPORTER_OTLP_CERTIFICATE=str(tmp_path / "missing-ca.pem"),
    )
    handle = telemetry.setup(settings, rank=0, world_size=1, run_dir=tmp_path)
    assert handle.exporting
    _emit_some()
    telemetry.shutdown()
    assert len(otlp_json.read_spans(lay.spool_file(tmp_path, 0, "traces"))) == 3
