"""The receiver's fast OTLP -> OTLP/JSON conversion gives exactly what protobuf's JSON printer
(with OTLP/JSON's hex ids) gives, on real SDK output of every signal: spans with every attribute
type, events, links and status; every metric kind with exemplars; log records."""

from __future__ import annotations

import logging
import math

from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, Status, StatusCode

from mlaunch.receiver.signals import LOGS, METRICS, TRACES

RESOURCE = Resource.create({"dl.rank": 3, "f": 0.5, "b": True, "list": ["x", "y"]})


def same(signal, request) -> None:  # type: ignore[no-untyped-def]
    # Parse back from bytes: exactly what the receiver's writer holds.
    request = signal.parse(request.SerializeToString())
    fast, ref = signal.to_json(request), signal.to_json_reference(request)
    assert fast == ref or repr(fast) == repr(ref)  # NaN != NaN: compare the text then


def test_spans() -> None:
    memory = InMemorySpanExporter()
    tp = TracerProvider(resource=RESOURCE)
    tp.add_span_processor(SimpleSpanProcessor(memory))
    t = tp.get_tracer("scope", "1.2")
    attrs = {"s": "x", "i": -7, "big": 2**62, "f": 1.25, "zero": 0, "no": False, "nan": math.nan,
             "inf": math.inf, "ints": [1, 2], "strs": ["a"], "bools": [True], "empty": ""}  # fmt: skip
    with t.start_as_current_span("root", attributes=attrs) as root:
        root.add_event("ev", {"k": 1}, timestamp=123)
        root.add_event("bare")
        with t.start_as_current_span("child", links=[Link(root.get_span_context(), {"l": 2})]) as c:
            c.set_status(Status(StatusCode.ERROR, "broken"))
        with t.start_as_current_span("ok") as ok:
            ok.set_status(Status(StatusCode.OK))
    same(TRACES, encode_spans(memory.get_finished_spans()))


def test_metrics_of_every_kind() -> None:
    reader = InMemoryMetricReader()
    mp = MeterProvider(
        resource=RESOURCE, metric_readers=[reader],
        views=[View(instrument_name="exp", aggregation=ExponentialBucketHistogramAggregation())],
    )  # fmt: skip
    m = mp.get_meter("m")
    tp = TracerProvider()
    with tp.get_tracer("t").start_as_current_span("s"):  # exemplars carry trace/span ids
        m.create_counter("c").add(3, {"a": "b"})
        m.create_up_down_counter("ud").add(-2)
        m.create_histogram("h").record(2.5)
        m.create_histogram("exp").record(7)
        m.create_gauge("g").set(1.5)
    same(METRICS, encode_metrics(reader.get_metrics_data()))


def test_logs() -> None:
    memory = InMemoryLogRecordExporter()
    lp = LoggerProvider(resource=RESOURCE)
    lp.add_log_record_processor(SimpleLogRecordProcessor(memory))
    log = logging.getLogger("test-otlp-dict")
    handler = LoggingHandler(logger_provider=lp)
    log.addHandler(handler)
    try:
        with TracerProvider().get_tracer("t").start_as_current_span("s"):
            log.warning("inside a span %s", 1)
        log.error("outside")
    finally:
        log.removeHandler(handler)
    same(LOGS, encode_logs(memory.get_finished_logs()))
