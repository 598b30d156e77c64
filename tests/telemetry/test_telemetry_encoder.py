"""The direct encoder against the SDK's own: the same spans, decoded with opentelemetry-proto from
mlaunch's protobuf bytes and OTLP/JSON lines, equal field by field to what the SDK's encoder
produces (ids, times, attributes of every type, events, links, status, resource, scope)."""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson
import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    TracerProvider,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from mlaunch.otlp import otlp_json
from mlaunch.telemetry._encode import Limits, SpanEncoder, encode_spans_line
from mlaunch.telemetry._spans import FineSpan

#: One attribute of every type OTLP carries, and the edge values of each.
EVERY_TYPE: dict[str, Any] = {
    "str": "héllo",
    "empty_str": "",
    "int": 42,
    "zero": 0,
    "negative": -7,
    "int64_max": (1 << 63) - 1,
    "int64_min": -(1 << 63),
    "float": 0.25,
    "whole_float": 3.0,
    "nan": float("nan"),
    "inf": float("inf"),
    "neg_inf": float("-inf"),
    "true": True,
    "false": False,
    "strs": ["a", "b"],
    "ints": (1, -2, 3),
    "floats": [0.5, 1.5],
    "bools": [True, False],
    "empty_list": [],
    "bytes": b"\x00\x01hi",
    "mapping": {"k": "v", "n": 1},
    "none_in_list": ["a", None],
}


class _Collect(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def _sdk_spans() -> list[ReadableSpan]:
    provider = TracerProvider(resource=Resource({"service.name": "enc", "rank": 3, "f": 1.5}))
    collect = _Collect()
    provider.add_span_processor(collect)
    tracer = provider.get_tracer("mlaunch", "9.9")
    other = provider.get_tracer("other")
    remote = SpanContext(0xABC, 0xDEF, True, TraceFlags(1), TraceState([("v", "1")]))
    local = SpanContext(0x123, 0x456, False, TraceFlags(1))
    with tracer.start_as_current_span(
        "root",
        attributes=EVERY_TYPE,
        links=[Link(remote, {"why": "launcher"}), Link(local)],
        kind=SpanKind.SERVER,
    ) as root:
        root.add_event("ev", {"x": 1, "l": ["a"]})
        root.add_event("bare")
        root.set_status(Status(StatusCode.ERROR, "it broke"))
        with tracer.start_as_current_span("child") as child:
            child.set_status(Status(StatusCode.OK))
            with other.start_as_current_span("other-scope"):
                pass
    from opentelemetry import trace

    ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    tracer.start_span("remote-parent", context=ctx, kind=SpanKind.CLIENT).end()
    provider.shutdown()
    return collect.spans


def _sdk_request(spans: list[ReadableSpan]) -> ExportTraceServiceRequest:
    return encode_spans(spans)


@pytest.fixture(autouse=True)
def _quiet_sdk_warnings(caplog: Any) -> None:
    caplog.set_level(logging.ERROR, logger="opentelemetry")


def test_protobuf_equals_the_sdk_encoder_for_sdk_spans() -> None:
    spans = _sdk_spans()
    encoder = SpanEncoder(spans[0].resource, spans[0].instrumentation_scope)
    payload, dropped = encoder.pb_request(spans)
    assert dropped == 0
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(payload)
    expected = _sdk_request(spans)
    _assert_same(ours, expected)
    # Two scopes under one resource, as the SDK groups them.
    assert len(ours.resource_spans) == 1
    assert [s.scope.name for s in ours.resource_spans[0].scope_spans] == [
        "other",
        "mlaunch",
    ]  # first ended first


def test_json_equals_the_sdk_encoder_for_sdk_spans() -> None:
    spans = _sdk_spans()
    encoder = SpanEncoder(spans[0].resource, spans[0].instrumentation_scope)
    line, dropped = encoder.json_line(spans)
    assert dropped == 0 and b"\n" not in line
    expected = _sdk_request(spans)
    # Decoded with opentelemetry-proto's JSON parser (after the OTLP/JSON hex-id mapping) ...
    _assert_same(otlp_json.decode_traces_line(line.decode()), expected)
    # ... and the same document as the SDK encoder + json_format + hex ids.
    assert json.loads(line) == otlp_json.trace_request_to_dict(expected)
    assert line == orjson.dumps(encoder.json_request(spans)[0])
    # The public helper is the same encoder.
    assert encode_spans_line(spans) == line.decode()


def test_keys_are_in_the_proto_declaration_order_as_the_collector_writes_them() -> None:
    spans = _sdk_spans()
    line = encode_spans_line(spans)
    span = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][-1]
    assert list(span)[:6] == ["traceId", "spanId", "parentSpanId", "flags", "name", "kind"]
    assert list(span)[-1] == "status"
    assert '"status":{"message":"it broke","code":2}' in line
    assert '"kind":2' in line and '"flags":256' in line and '"flags":768' in line


def _readable(rec: FineSpan, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The ReadableSpan the SDK would have produced for the calls a FineSpan recorded."""
    limits = SpanLimits()
    flags = TraceFlags(1)
    parent = SpanContext(rec.trace_id, rec.parent_id, False, flags) if rec.parent_id else None

    def bounded(attrs: dict[str, Any], maxlen: int | None) -> BoundedAttributes:
        return BoundedAttributes(maxlen, attrs, max_value_len=limits.max_span_attribute_length)

    return ReadableSpan(
        name=rec.name,
        context=SpanContext(rec.trace_id, rec.span_id, False, flags),
        parent=parent,
        resource=resource,
        attributes=bounded(rec.attributes, limits.max_span_attributes),
        events=[
            Event(n, bounded(a, limits.max_event_attributes), ts) for n, a, ts in rec.events or ()
        ],
        links=rec.links or (),
        kind=SpanKind.INTERNAL,
        status=Status(StatusCode(rec.status[0]), rec.status[1] or None)
        if rec.status
        else Status(StatusCode.UNSET),
        start_time=rec.start,
        end_time=rec.end,
        instrumentation_scope=scope,
    )


def _fine(name: str, parent: FineSpan | None, attrs: dict[str, Any], **extra: Any) -> FineSpan:
    rec = FineSpan(name, dict(attrs), extra.get("links"))
    rec.trace_id = parent.trace_id if parent else 0x1234567890ABCDEF1234567890ABCDEF
    rec.parent_id = parent.span_id if parent else 0
    rec.span_id = extra.get("span_id", 0x1111)
    rec.sampled = True
    rec.start, rec.end = 1_700_000_000_000_000_000, 1_700_000_000_000_001_234
    rec.events = extra.get("events")
    rec.status = extra.get("status")
    return rec


def _fine_spans() -> list[FineSpan]:
    root = _fine("megatron.microbatch.forward", None, EVERY_TYPE, span_id=0xAAAA)
    root.add_event("exception", {"exception.type": "KeyError", "n": 2}, timestamp=5)
    root.set_status(StatusCode.ERROR, "KeyError: 'gone'")
    remote = SpanContext(0xABC, 0xDEF, True, TraceFlags(1))
    child = _fine(
        "megatron.layer.forward",
        root,
        {"megatron.layer.number": 2},
        span_id=0xBBBB,
        links=[Link(remote)],
    )
    many = _fine("many-attrs", None, {f"a{i}": i for i in range(200)}, span_id=0xCCCC)
    bad = _fine("bad-values", None, {"obj": object(), "": 1, "ok": 1}, span_id=0xDDDD)
    # The common case (the encoder's fast path): no events, links or status, plain values.
    plain = {"s": 'é"q', "i": 3, "neg": -1, "f": 0.5, "nan": float("nan"), "b": True, "i1": 1}
    plain_root = _fine("plain", None, plain, span_id=0xEEEE)
    plain_child = _fine("plain-child", plain_root, {}, span_id=0xFFFF)
    return [root, child, many, bad, plain_root, plain_child]


def test_fine_spans_encode_as_the_sdk_encodes_the_same_calls() -> None:
    resource = Resource({"service.name": "enc"})
    scope = InstrumentationScope("mlaunch", "1.0")
    records = _fine_spans()
    expected = _sdk_request([_readable(r, resource, scope) for r in records])
    encoder = SpanEncoder(resource, scope, Limits(SpanLimits()))
    for _ in range(2):  # the second time from the fast path's caches
        payload, dropped = encoder.pb_request(records)
        assert dropped == 0
        ours = ExportTraceServiceRequest()
        ours.ParseFromString(payload)
        _assert_same(ours, expected)
        line, _ = encoder.json_line(records)
        _assert_same(otlp_json.decode_traces_line(line.decode()), expected)
        # The pieces assembled for the line are exactly orjson's bytes for the whole document.
        assert line == orjson.dumps(encoder.json_request(records)[0])
    spans = {s.name: s for s in ours.resource_spans[0].scope_spans[0].spans}
    # The SDK's limits: 128 attributes kept (the newest), the rest counted as dropped.
    assert len(spans["many-attrs"].attributes) == 128
    assert spans["many-attrs"].dropped_attributes_count == 72
    # The SDK's cleaning: an empty key is dropped, an object without __str__ becomes empty.
    assert [kv.key for kv in spans["bad-values"].attributes] == ["obj", "ok"]


def test_a_value_otlp_cannot_carry_drops_the_attribute_not_the_span() -> None:
    resource = Resource({})
    scope = InstrumentationScope("mlaunch")
    drops: list[tuple[str, str]] = []
    encoder = SpanEncoder(resource, scope, on_drop=lambda cause, msg: drops.append((cause, msg)))
    rec = _fine("big", None, {"huge": 1 << 70, "lone": "\ud800", "ok": 1})
    payload, dropped = encoder.pb_request([rec])
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(payload)
    (span,) = ours.resource_spans[0].scope_spans[0].spans
    assert [kv.key for kv in span.attributes] == ["ok"] and dropped == 0
    line, _ = encoder.json_line([rec])
    assert [
        kv["key"]
        for kv in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    ] == ["ok"]
    assert drops and {cause for cause, _ in drops} == {"attr:huge", "attr:lone"}


def _assert_same(ours: ExportTraceServiceRequest, expected: ExportTraceServiceRequest) -> None:
    """Field by field (protobuf equality), with a readable diff when they differ."""
    if ours != expected:
        a = MessageToDict(ours)
        b = MessageToDict(expected)
        assert a == b
    assert ours == expected


def test_an_invalid_value_set_in_a_loop_is_logged_once(caplog: Any) -> None:
    import mlaunch.telemetry._runtime  # noqa: F401 - installs the once-per-message filter

    class OddValue14:  # a type no other test logs about
        pass

    caplog.set_level(logging.WARNING, logger="opentelemetry")
    encoder = SpanEncoder(Resource({}), InstrumentationScope("mlaunch"))
    records = [_fine("odd", None, {"odd": OddValue14(), "i": i}, span_id=i + 1) for i in range(50)]
    payload, dropped = encoder.pb_request(records)
    encoder.json_line(records)
    assert dropped == 0
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(payload)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == 50
    odd = [r for r in caplog.records if "OddValue14" in r.getMessage()]
    assert len(odd) == 1, [r.getMessage() for r in odd]
