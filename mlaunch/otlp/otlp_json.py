"""OTLP/JSON lines: the format of the file exporter, the console exporter and the spool files.

Each line is one ``ExportTraceServiceRequest`` (traces files) or ``ExportMetricsServiceRequest``
(metrics files) in the OTLP/JSON mapping, the same as the OpenTelemetry collector's file exporter:

- lowerCamelCase field names (``resourceSpans``, ``scopeSpans``, ``traceId``, ``parentSpanId``,
  ``startTimeUnixNano`` ...);
- trace and span ids as lowercase hex strings (protobuf's JSON mapping would give base64; OTLP/JSON
  overrides that);
- 64-bit integers as decimal strings, enums as integers (``kind``, ``status.code``);
- attribute values as ``{"stringValue"|"intValue"|"doubleValue"|"boolValue"|"arrayValue"|...: v}``;
- fields with default values (0, "", empty lists) are omitted, as protobuf's JSON printer does.

Spans are encoded by the runtime's direct encoder (:mod:`mlaunch.telemetry._encode`, whose
span document is built by :mod:`mlaunch.otlp.encode`); metrics and the protobuf conversions need
``opentelemetry-proto``; the flat readers (:func:`iter_spans`, :func:`iter_metrics`,
:func:`read_spans`) use only the standard library, so ``mlaunch trace`` can read run directories
without the SDK, and without importing the telemetry runtime.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# Which keys hold ids (bytes in protobuf) at each level of a request.
_SPAN_ID_KEYS = ("traceId", "spanId", "parentSpanId")
_LINK_ID_KEYS = ("traceId", "spanId")


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def _fix_ids(request: dict[str, Any], convert: Any) -> dict[str, Any]:
    """Rewrite every trace/span id in a trace request dict in place with ``convert``."""
    for rs in request.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for sp in ss.get("spans", ()):
                for key in _SPAN_ID_KEYS:
                    if sp.get(key):
                        sp[key] = convert(sp[key])
                for link in sp.get("links", ()):
                    for key in _LINK_ID_KEYS:
                        if link.get(key):
                            link[key] = convert(link[key])
    return request


def _fix_metric_ids(request: dict[str, Any], convert: Any) -> dict[str, Any]:
    """Exemplars carry trace/span ids too."""
    for rm in request.get("resourceMetrics", ()):
        for sm in rm.get("scopeMetrics", ()):
            for metric in sm.get("metrics", ()):
                for body in metric.values():
                    if not isinstance(body, dict):
                        continue
                    for dp in body.get("dataPoints", ()):
                        for ex in dp.get("exemplars", ()):
                            for key in _LINK_ID_KEYS:
                                if ex.get(key):
                                    ex[key] = convert(ex[key])
    return request


def trace_request_to_dict(request: Any) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` protobuf as an OTLP/JSON dict (hex ids)."""
    from google.protobuf.json_format import MessageToDict

    return _fix_ids(MessageToDict(request, use_integers_for_enums=True), _b64_to_hex)


def metrics_request_to_dict(request: Any) -> dict[str, Any]:
    """An ``ExportMetricsServiceRequest`` protobuf as an OTLP/JSON dict."""
    from google.protobuf.json_format import MessageToDict

    return _fix_metric_ids(MessageToDict(request, use_integers_for_enums=True), _b64_to_hex)


def encode_metrics_line(metrics_data: Any) -> str:
    """An SDK ``MetricsData`` as one OTLP/JSON line (no trailing newline)."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )

    return json.dumps(metrics_request_to_dict(encode_metrics(metrics_data)), separators=(",", ":"))


# ------------------------------------------------------------------------------------------------
# Standard-library encoding (the launcher's job trace: no protobuf, no SDK on its start-up path).


def encode_any_value(value: Any) -> dict[str, Any]:
    """A Python value as an OTLP/JSON ``AnyValue`` (the inverse of :func:`any_value`)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # int64 as a decimal string
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [encode_any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def encode_attributes(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """A dict as a list of OTLP/JSON ``KeyValue`` (None values left out)."""
    return [{"key": k, "value": encode_any_value(v)} for k, v in attrs.items() if v is not None]


def encode_span(
    *,
    name: str,
    trace_id: str,
    span_id: str,
    parent_span_id: str = "",
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any] | None = None,
    status_code: int = 0,
    status_message: str = "",
    kind: int = 1,
) -> dict[str, Any]:
    """One span in the OTLP/JSON mapping (hex ids; defaults omitted as protobuf's printer does).

    ``kind`` 1 is INTERNAL; ``status_code`` 0 unset, 1 ok, 2 error."""
    span: dict[str, Any] = {"traceId": trace_id, "spanId": span_id}
    if parent_span_id:
        span["parentSpanId"] = parent_span_id
    span.update(name=name, kind=kind, startTimeUnixNano=str(start_ns), endTimeUnixNano=str(end_ns))
    if attributes:
        span["attributes"] = encode_attributes(attributes)
    status: dict[str, Any] = {}
    if status_message:
        status["message"] = status_message
    if status_code:
        status["code"] = status_code
    span["status"] = status
    return span


def trace_request(
    resource: dict[str, Any], scope: str, spans: Iterable[dict[str, Any]]
) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` in the OTLP/JSON mapping: one resource, one scope."""
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": encode_attributes(resource)},
                "scopeSpans": [{"scope": {"name": scope}, "spans": list(spans)}],
            }
        ]
    }


def decode_traces_line(line: str) -> Any:
    """One traces line back into an ``ExportTraceServiceRequest`` protobuf."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    data = _fix_ids(json.loads(line), _hex_to_b64)
    return ParseDict(data, ExportTraceServiceRequest())


def decode_metrics_line(line: str) -> Any:
    """One metrics line back into an ``ExportMetricsServiceRequest`` protobuf."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    data = _fix_metric_ids(json.loads(line), _hex_to_b64)
    return ParseDict(data, ExportMetricsServiceRequest())


# ------------------------------------------------------------------------------------------------
# Flat, standard-library readers.


def any_value(v: Any) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value: int64 strings become ints, ``bytesValue``
    (base64, as protobuf's JSON mapping writes bytes: OTLP/JSON overrides that only for trace and
    span ids) becomes ``bytes``. Never raises: a malformed value (not an object, an ``intValue``
    that is no integer, a ``bytesValue`` that is no base64) decodes to ``None`` or its raw form,
    so one bad attribute cannot make a reader fail with a traceback."""
    if not isinstance(v, dict):
        return None
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        try:
            return int(v["intValue"])
        except (TypeError, ValueError):
            return v["intValue"]
    if "doubleValue" in v:
        try:
            return float(v["doubleValue"])
        except (TypeError, ValueError):
            return v["doubleValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        arr = v["arrayValue"]
        vals = arr.get("values") if isinstance(arr, dict) else None
        return [any_value(x) for x in vals] if isinstance(vals, list) else []
    if "kvlistValue" in v:
        kvl = v["kvlistValue"]
        return attributes(kvl.get("values") if isinstance(kvl, dict) else None)
    if "bytesValue" in v:
        try:
            return base64.b64decode(v["bytesValue"])
        except (TypeError, ValueError):  # binascii.Error is a ValueError
            return v["bytesValue"]
    return None  # an empty AnyValue


def attributes(kvs: Any) -> dict[str, Any]:
    """A list of OTLP/JSON ``KeyValue`` as a dict. Entries that are not ``{"key": str, ...}``
    are dropped, and anything but a list decodes to {} (see :func:`any_value`: never raises)."""
    if not isinstance(kvs, list | tuple):
        return {}
    out: dict[str, Any] = {}
    for kv in kvs:
        if isinstance(kv, dict) and isinstance(key := kv.get("key"), str):
            out[key] = any_value(kv.get("value"))
    return out


def iter_spans(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The spans of one OTLP/JSON trace request, flattened.

    Each span is a dict: ``name``, ``trace_id``, ``span_id``, ``parent_span_id`` (hex, "" for a
    root), ``start_ns``, ``end_ns``, ``kind`` (int), ``status_code`` (0 unset, 1 ok, 2 error),
    ``status_message``, ``attributes``, ``events`` (``name``, ``time_ns``, ``attributes``),
    ``links`` (``trace_id``, ``span_id``, ``attributes``), ``resource`` (attributes dict) and
    ``scope`` (instrumentation scope name).
    """
    for rs in request.get("resourceSpans", ()):
        resource = attributes(rs.get("resource", {}).get("attributes", ()))
        for ss in rs.get("scopeSpans", ()):
            scope = ss.get("scope", {}).get("name", "")
            for sp in ss.get("spans", ()):
                status = sp.get("status", {})
                yield {
                    "name": sp.get("name", ""),
                    "trace_id": sp.get("traceId", ""),
                    "span_id": sp.get("spanId", ""),
                    "parent_span_id": sp.get("parentSpanId", ""),
                    "start_ns": int(sp.get("startTimeUnixNano", 0)),
                    "end_ns": int(sp.get("endTimeUnixNano", 0)),
                    "kind": int(sp.get("kind", 0)),
                    "status_code": int(status.get("code", 0)),
                    "status_message": status.get("message", ""),
                    "attributes": attributes(sp.get("attributes", ())),
                    "events": [
                        {
                            "name": ev.get("name", ""),
                            "time_ns": int(ev.get("timeUnixNano", 0)),
                            "attributes": attributes(ev.get("attributes", ())),
                        }
                        for ev in sp.get("events", ())
                    ],
                    "links": [
                        {
                            "trace_id": ln.get("traceId", ""),
                            "span_id": ln.get("spanId", ""),
                            "attributes": attributes(ln.get("attributes", ())),
                        }
                        for ln in sp.get("links", ())
                    ],
                    "resource": resource,
                    "scope": scope,
                }


_METRIC_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "summary")


def iter_metrics(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The metrics of one OTLP/JSON metrics request, flattened: ``name``, ``unit``,
    ``description``, ``kind`` (``gauge``/``sum``/``histogram``/...), ``data_points`` (raw OTLP/JSON
    dicts, with ``attributes`` decoded) and ``resource``."""
    for rm in request.get("resourceMetrics", ()):
        resource = attributes(rm.get("resource", {}).get("attributes", ()))
        for sm in rm.get("scopeMetrics", ()):
            for metric in sm.get("metrics", ()):
                kind = next((k for k in _METRIC_KINDS if k in metric), "")
                points = []
                for dp in metric.get(kind, {}).get("dataPoints", ()):
                    dp = dict(dp)
                    dp["attributes"] = attributes(dp.get("attributes", ()))
                    points.append(dp)
                yield {
                    "name": metric.get("name", ""),
                    "unit": metric.get("unit", ""),
                    "description": metric.get("description", ""),
                    "kind": kind,
                    "data_points": points,
                    "resource": resource,
                }


def _read_lines(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                # A process killed mid-write leaves at most one torn last line; skip it.
                continue


def read_spans(path: str | Path) -> list[dict[str, Any]]:
    """Every span of a traces (or traces spool) file, flattened as by :func:`iter_spans`."""
    return [sp for req in _read_lines(path) for sp in iter_spans(req)]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every metric of a metrics (or metrics spool) file, flattened as by :func:`iter_metrics`."""
    return [m for req in _read_lines(path) for m in iter_metrics(req)]
