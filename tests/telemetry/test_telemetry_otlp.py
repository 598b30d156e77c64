# ruff: noqa: SIM117 - nested with-blocks mirror the span tree under test
"""OTLP export over gRPC and HTTP/protobuf to real in-process receivers: spans (names, parents,
attributes, links, status, resource) and the ``megatron.training.*`` metrics with their units."""

from __future__ import annotations

import pytest
from support.otlp import GrpcOtlpReceiver, HttpOtlpReceiver
from telemetry_helpers import by_name, parent_names

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import METRICS, Attr, Metric, ResourceAttr
from mlaunch.model.spans import SpanName as S


@pytest.fixture(params=["grpc", "http/protobuf"])
def receiver(request):
    rx = (GrpcOtlpReceiver() if request.param == "grpc" else HttpOtlpReceiver()).start()
    rx.protocol = request.param
    yield rx
    rx.stop()


def _emit() -> None:
    with telemetry.span(G.JOB, S.STARTUP, **{Attr.MODEL_TYPE: "gpt"}):  # noqa: SIM117
        with telemetry.span(G.FORWARD_BACKWARD, S.FORWARD_BACKWARD, **{Attr.NUM_MICROBATCHES: 2}):
            with telemetry.span(G.COMMUNICATION, S.P2P_SEND_FORWARD):
                ints = telemetry.current_context_ints()
            with telemetry.linked_span(
                G.COMMUNICATION, S.PP_RECV_FORWARD_LINKED, telemetry.context_from_ints(ints)
            ):
                pass
            with telemetry.span(G.MICROBATCH, S.MICROBATCH_FORWARD, **{Attr.MICROBATCH_ID: 0}):
                pass
        try:
            with telemetry.span(G.OPTIMIZER, S.OPTIMIZER):
                raise RuntimeError("nan")
        except RuntimeError:
            pass
    for it in range(3):
        telemetry.record_step(
            it,
            step_ms=100.0 + it,
            loss=2.0 - it / 10,
            grad_norm=1.0,
            learning_rate=1e-4,
            tokens_per_sec=1000.0,
            tflops=1.5,
            skipped=it == 1,
            memory_gb=0.5,
        )


def test_spans_and_metrics_arrive_over_otlp(make_settings, tmp_path, receiver):
    settings = make_settings(
        EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL=receiver.protocol,
        OTEL_EXPORTER_OTLP_HEADERS="x-mlaunch-token=s3cret",
        OTEL_RESOURCE_ATTRIBUTES="team=llm",
    )
    assert settings.exporter == "otlp"
    telemetry.setup(
        settings, rank=0, world_size=1, run_dir=tmp_path, resource={ResourceAttr.PP_SIZE: 2}
    )
    _emit()
    telemetry.shutdown(10.0)

    assert receiver.wait_for_spans(5, timeout=10)
    spans = receiver.spans
    assert sorted(s["name"] for s in spans) == sorted(
        [
            S.STARTUP,
            S.FORWARD_BACKWARD,
            S.P2P_SEND_FORWARD,
            S.PP_RECV_FORWARD_LINKED,
            S.MICROBATCH_FORWARD,
            S.OPTIMIZER,
        ]
    )
    parents = parent_names(spans)
    assert parents[S.STARTUP] is None
    assert parents[S.MICROBATCH_FORWARD] == S.FORWARD_BACKWARD
    assert parents[S.OPTIMIZER] == S.STARTUP
    named = by_name(spans)
    # forward_backward is one of the spans Megatron-LM marks as goodput.
    assert named[S.FORWARD_BACKWARD]["attributes"] == {
        Attr.NUM_MICROBATCHES: 2,
        Attr.IS_GOODPUT: True,
    }
    assert named[S.MICROBATCH_FORWARD]["attributes"] == {Attr.MICROBATCH_ID: 0}
    assert named[S.STARTUP]["attributes"][Attr.IS_GOODPUT] is True
    (link,) = named[S.PP_RECV_FORWARD_LINKED]["links"]
    assert link["span_id"] == named[S.P2P_SEND_FORWARD]["span_id"]
    assert named[S.OPTIMIZER]["status_code"] == 2
    assert named[S.OPTIMIZER]["events"][0]["name"] == "exception"
    for s in spans:
        assert s["resource"][ResourceAttr.SERVICE_INSTANCE_ID] == "testrun-rank0"
        assert s["resource"][ResourceAttr.PP_SIZE] == 2
        assert s["resource"]["team"] == "llm"
        assert s["scope"] == "mlaunch"
    assert all(h.get("x-mlaunch-token") == "s3cret" for h in receiver.headers)

    names = {m.name for m in METRICS}
    assert receiver.wait_for_metrics(names, timeout=10)
    got = {m["name"]: m for m in receiver.metrics}
    for m in METRICS:
        assert got[m.name]["unit"] == m.unit
        assert got[m.name]["resource"][ResourceAttr.RUN_ID] == "testrun"
    step = got[Metric.STEP_DURATION_MS]
    assert step["kind"] == "histogram"
    (point,) = step["data_points"]
    assert int(point["count"]) == 3  # one sample per step
    assert point["sum"] == pytest.approx(303.0)
    assert got[Metric.LOSS]["kind"] == "gauge"
    assert got[Metric.LOSS]["data_points"][0]["asDouble"] == pytest.approx(1.8)
    skipped = got[Metric.SKIPPED_ITERS]
    assert skipped["kind"] == "sum" and int(skipped["data_points"][0]["asInt"]) == 1


def test_metrics_disabled_creates_no_instruments(make_settings, tmp_path):
    handle = telemetry.setup(
        make_settings(METRICS_ENABLED="0"), rank=0, world_size=1, run_dir=tmp_path
    )
    assert handle.meter_provider is None
    telemetry.record_step(1, step_ms=1.0, loss=1.0)
    telemetry.shutdown()
    assert not (tmp_path / "telemetry" / "metrics-rank0.jsonl").exists()


def test_traces_disabled_creates_no_spans(make_settings, tmp_path):
    handle = telemetry.setup(
        make_settings(TRACES_ENABLED="0"), rank=0, world_size=1, run_dir=tmp_path
    )
    assert handle.exporting and handle.enabled_groups == frozenset()
    with telemetry.span(G.JOB, S.STARTUP) as s:
        assert isinstance(s, telemetry.NullSpan)
    telemetry.record_step(1, step_ms=5.0)
    telemetry.shutdown()
    from telemetry_helpers import read_metric_file

    assert {m["name"] for m in read_metric_file(tmp_path)} >= {Metric.STEP_DURATION_MS}


def test_per_signal_protocol_and_endpoint_win(make_settings, tmp_path):
    with HttpOtlpReceiver() as http_rx, GrpcOtlpReceiver() as grpc_rx:
        settings = make_settings(
            EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http_rx.traces_url,
            OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=grpc_rx.endpoint,
        )
        telemetry.setup(settings, rank=0, world_size=1, run_dir=tmp_path)
        with telemetry.span(G.JOB, S.STARTUP):
            pass
        telemetry.record_step(1, step_ms=3.0)
        telemetry.shutdown(10.0)
        assert http_rx.wait_for_spans(1, timeout=10)
        assert grpc_rx.wait_for_metrics({Metric.STEP_DURATION_MS}, timeout=10)
        assert grpc_rx.spans == [] and http_rx.metrics == []


def test_capitalized_header_names_are_sent_lower_case(make_settings, tmp_path) -> None:
    # "Authorization=Bearer%20T" is the usual spelling; gRPC refuses capitalized metadata keys,
    # so passed as given every export failed (and went to the spool) while doctor said "ok".
    rx = GrpcOtlpReceiver().start()
    try:
        settings = make_settings(
            EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer%20s3cret",
            METRICS_ENABLED="false",
        )
        telemetry.setup(settings, rank=0, world_size=1, run_dir=tmp_path)
        with telemetry.span(G.JOB, S.STARTUP):
            pass
        telemetry.shutdown(10.0)
        assert rx.wait_for_spans(1, timeout=10)
        assert all(h.get("authorization") == "Bearer s3cret" for h in rx.headers)
    finally:
        rx.stop()
