"""The OTLP signals the embedded receiver handles: one table, used by the gRPC and HTTP frontends,
the writer and the relay, so a signal is added in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from mlaunch.otlp import from_proto, otlp_json
from mlaunch.otlp.send import EXPORT_SERVICES


@dataclass(frozen=True)
class Signal:
    """One OTLP signal: its request type, gRPC service, HTTP path and OTLP/JSON converters."""

    name: str
    """``traces`` / ``metrics`` / ``logs`` (the spool and file name word, the HTTP path)."""
    request_type: type
    service: str
    """The fully qualified gRPC service name (its one method is ``Export``)."""
    resources_field: str
    """``resource_spans`` / ``resource_metrics`` / ``resource_logs``."""

    @property
    def http_path(self) -> str:
        """The OTLP/HTTP path of this signal."""
        return f"/v1/{self.name}"

    def parse(self, payload: bytes | Any) -> Any:
        """A request message from serialized protobuf (or the message itself)."""
        if isinstance(payload, bytes | bytearray | memoryview):
            return self.request_type.FromString(bytes(payload))
        return payload

    def items(self, request: Any) -> int:
        """What the counts count: spans, metric data points, log records."""
        n = 0
        for res in getattr(request, self.resources_field):
            if self.name == "traces":
                n += sum(len(ss.spans) for ss in res.scope_spans)
            elif self.name == "metrics":
                for sm in res.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        n += len(getattr(m, kind).data_points) if kind else 0
            else:
                n += sum(len(sl.log_records) for sl in res.scope_logs)
        return n

    def to_json(self, request: Any) -> dict[str, Any]:
        """The request in OTLP/JSON (hex ids), as mlaunch's file exporter writes it (the same
        dict as :meth:`to_json_reference`, ~3x faster)."""
        return from_proto.to_dict(request)

    def to_json_reference(self, request: Any) -> dict[str, Any]:
        """:meth:`to_json` by protobuf's own JSON printer (what the file exporter uses)."""
        if self.name == "traces":
            return otlp_json.trace_request_to_dict(request)
        if self.name == "metrics":
            return otlp_json.metrics_request_to_dict(request)
        return _logs_to_dict(request)

    def from_json(self, data: dict[str, Any]) -> Any:
        """An OTLP/JSON body (hex ids, as OTLP/HTTP JSON clients send) as a request message."""
        import json

        text = json.dumps(data)
        if self.name == "traces":
            return otlp_json.decode_traces_line(text)
        if self.name == "metrics":
            return otlp_json.decode_metrics_line(text)
        return _logs_from_dict(data)


def _logs_fix(data: dict[str, Any], convert: Any) -> dict[str, Any]:
    for rl in data.get("resourceLogs", ()):
        for sl in rl.get("scopeLogs", ()):
            for rec in sl.get("logRecords", ()):
                for key in ("traceId", "spanId"):
                    if rec.get(key):
                        rec[key] = convert(rec[key])
    return data


def _logs_to_dict(request: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return _logs_fix(MessageToDict(request, use_integers_for_enums=True), otlp_json._b64_to_hex)


def _logs_from_dict(data: dict[str, Any]) -> Any:
    from google.protobuf.json_format import ParseDict

    return ParseDict(
        _logs_fix(data, otlp_json._hex_to_b64), logs_service_pb2.ExportLogsServiceRequest()
    )


TRACES = Signal(
    "traces",
    trace_service_pb2.ExportTraceServiceRequest,
    EXPORT_SERVICES["traces"],
    "resource_spans",
)
METRICS = Signal(
    "metrics",
    metrics_service_pb2.ExportMetricsServiceRequest,
    EXPORT_SERVICES["metrics"],
    "resource_metrics",
)
LOGS = Signal(
    "logs",
    logs_service_pb2.ExportLogsServiceRequest,
    EXPORT_SERVICES["logs"],
    "resource_logs",
)
#: Every signal, by name.
SIGNALS: dict[str, Signal] = {s.name: s for s in (TRACES, METRICS, LOGS)}
