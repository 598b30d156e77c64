"""Where the exporting rank's telemetry goes: the sinks (OTLP gRPC / HTTP, console, file, none)
and the spool files that keep what could not be delivered.

The export thread of :mod:`mlaunch.telemetry._runtime` hands each batch to one :class:`Sink`; a
batch that fails goes to the :class:`Spool`. Imported only by the runtime, on an exporting rank
(the OTLP exporters are imported only when an OTLP sink is built).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay
from mlaunch.telemetry._encode import SpanEncoder

if TYPE_CHECKING:
    from mlaunch.settings import TelemetrySettings


class ExportFailed(Exception):
    """An exporter reported failure (the cause string is the message)."""


class LineFile:
    """Appends OTLP/JSON lines (``bytes`` or ``str``) to a file opened on first use, or to a text
    stream; flushed per write."""

    def __init__(self, path: Path | None, stream: IO[str] | None = None) -> None:
        self.path = path
        self.stream: Any = stream
        self.lock = threading.Lock()

    def write(self, line: bytes | str) -> None:
        with self.lock:
            if self.stream is None:
                assert self.path is not None
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.stream = open(self.path, "ab")  # noqa: SIM115 - long-lived
            if self.path is None:  # a text stream (console)
                text = line.decode("utf-8") if isinstance(line, bytes) else line
                self.stream.write(text + "\n")
            else:
                data = line.encode("utf-8") if isinstance(line, str) else line
                self.stream.write(data + b"\n")
            self.stream.flush()

    def close(self) -> None:
        with self.lock:
            if self.stream is not None and self.path is not None:
                self.stream.close()
                self.stream = None


class Sink:
    """Where exported spans and metrics go. ``export_spans`` gets raw records (FineSpan or SDK
    spans), encodes them with the runtime's encoder and returns how many could not be encoded
    (dropped, already logged); ``export_*`` raise :class:`ExportFailed` on failure."""

    def export_spans(self, spans: list[Any], encoder: SpanEncoder) -> int:
        """Deliver spans (``none``: accept them without encoding)."""
        return 0

    def export_metrics(self, data: Any) -> None:
        """Deliver one metrics collection."""

    def close(self) -> None:
        """Release resources (may block; called on a daemon thread at shutdown)."""


class FailingSink(Sink):
    """Used when the configured exporter could not be built: every batch goes to the spool."""

    def __init__(self, cause: str) -> None:
        self.cause = cause

    def export_spans(self, spans: list[Any], encoder: SpanEncoder) -> int:
        raise ExportFailed(self.cause)

    def export_metrics(self, data: Any) -> None:
        raise ExportFailed(self.cause)


class LinesSink(Sink):
    """``file`` and ``console``: OTLP/JSON lines."""

    def __init__(self, traces: LineFile, metrics: LineFile) -> None:
        self.traces = traces
        self.metrics = metrics

    def export_spans(self, spans: list[Any], encoder: SpanEncoder) -> int:
        line, dropped = encoder.json_line(spans)
        self.traces.write(line)
        return dropped

    def export_metrics(self, data: Any) -> None:
        self.metrics.write(otlp_json.encode_metrics_line(data))

    def close(self) -> None:
        self.traces.close()
        self.metrics.close()


def _exporter_class(protocol: str, signal: str) -> Any:
    """The SDK's OTLP exporter class for a protocol and signal (``trace`` or ``metric``)."""
    if protocol == "grpc":
        if signal == "trace":
            return _grpc_bytes_span_exporter()
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter
    if signal == "trace":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter


class _Payload:
    """A serialised ExportTraceServiceRequest and how many spans it holds."""

    __slots__ = ("data", "count")

    def __init__(self, data: bytes, count: int) -> None:
        self.data = data
        self.count = count


_GRPC_BYTES_EXPORTER: Any = None


def _grpc_bytes_span_exporter() -> Any:
    """The SDK's OTLP gRPC span exporter, sending requests mlaunch encoded itself.

    Everything the exporter does with a request is kept (endpoint and ``insecure`` parsing, TLS
    credentials, headers as metadata, timeout as the call deadline, compression, retries with
    backoff, reconnecting after UNAVAILABLE); only the request is already bytes, so the stub's
    method passes it through instead of serialising a message built from ReadableSpans.
    """
    global _GRPC_BYTES_EXPORTER
    if _GRPC_BYTES_EXPORTER is not None:
        return _GRPC_BYTES_EXPORTER
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    from mlaunch.otlp.send import EXPORT_METHODS

    class _BytesTraceStub:
        """TraceService's Export with no request serialiser (the request is bytes)."""

        def __init__(self, channel: Any) -> None:
            self.Export = channel.unary_unary(  # noqa: N815 - the gRPC method name
                EXPORT_METHODS["traces"],
                request_serializer=None,
                response_deserializer=ExportTraceServiceResponse.FromString,
            )

    class BytesSpanExporter(OTLPSpanExporter):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._stub = _BytesTraceStub
            self._client = _BytesTraceStub(self._channel)

        def _translate_data(self, data: Any) -> Any:
            return data.data

        def _count_data(self, data: Any) -> int:
            return data.count

    _GRPC_BYTES_EXPORTER = BytesSpanExporter
    return BytesSpanExporter


def otlp_headers(otel: Any) -> dict[str, str]:
    """The OTLP headers with lower-case names, as the SDK's own env parsing gives them: gRPC
    rejects any metadata key with a capital ("Authorization") and fails every export."""
    return {str(k).lower(): v for k, v in (otel.headers or {}).items()}


def protocol_kwargs(otel: Any, protocol: str, common: dict[str, Any]) -> dict[str, Any]:
    """Exporter keyword arguments: TLS options differ between the gRPC and HTTP exporters."""
    kwargs = dict(common)
    if protocol == "grpc":
        if otel.insecure is not None:
            kwargs["insecure"] = otel.insecure
        if otel.certificate:
            import grpc

            with open(otel.certificate, "rb") as f:
                kwargs["credentials"] = grpc.ssl_channel_credentials(root_certificates=f.read())
    elif otel.certificate:
        kwargs["certificate_file"] = otel.certificate
    return kwargs


class OtlpSink(Sink):
    """OTLP over gRPC or HTTP/protobuf. Spans: mlaunch's own encoding, sent through the lower
    layer of the SDK's exporters (gRPC: the exporter with a bytes stub; HTTP: its HTTP client,
    which compresses, sets headers and certificates, retries). Metrics: the SDK's exporters."""

    def __init__(self, settings: TelemetrySettings, traces: bool, metrics: bool) -> None:
        otel = settings.otel
        self.span_exporter = None
        self.metric_exporter = None
        self.grpc = otel.protocol == "grpc"
        kwargs: dict[str, Any] = {"headers": otlp_headers(otel)}
        if otel.timeout_s is not None:
            kwargs["timeout"] = otel.timeout_s
        if traces:
            span_cls = _exporter_class(otel.protocol, "trace")
            self.span_exporter = span_cls(
                endpoint=otel.endpoint, **protocol_kwargs(otel, otel.protocol, kwargs)
            )
        if metrics:
            protocol = getattr(otel, "metrics_protocol", otel.protocol)
            metric_cls = _exporter_class(protocol, "metric")
            self.metric_exporter = metric_cls(
                endpoint=otel.metrics_endpoint or otel.endpoint,
                **protocol_kwargs(otel, protocol, kwargs),
            )
        self.where = f"{otel.protocol} {otel.endpoint}"

    def export_spans(self, spans: list[Any], encoder: SpanEncoder) -> int:
        if self.span_exporter is None:
            return 0
        data, dropped = encoder.pb_request(spans)
        exporter = self.span_exporter
        if self.grpc:
            ok = exporter.export(_Payload(data, len(spans) - dropped)).name == "SUCCESS"
        elif hasattr(getattr(exporter, "_client", None), "export"):
            ok = exporter._client.export(data).success  # SDK >= 1.4x: the retrying HTTP client
        else:
            ok = bool(getattr(exporter._export(data), "ok", False))  # older SDKs: one POST
        if not ok:
            raise ExportFailed(f"OTLP trace export to {self.where} failed")
        return dropped

    def export_metrics(self, data: Any) -> None:
        if self.metric_exporter is None:
            return
        result = self.metric_exporter.export(data)
        if getattr(result, "name", "") != "SUCCESS":
            raise ExportFailed(f"OTLP metric export to {self.where} failed")

    def close(self) -> None:
        for exporter in (self.span_exporter, self.metric_exporter):
            if exporter is not None:
                with contextlib.suppress(Exception):
                    exporter.shutdown()


def build_sink(
    settings: TelemetrySettings, run_dir: Path, rank: int, traces: bool, metrics: bool
) -> Sink:
    """The sink ``settings.exporter`` names (``otlp``, ``file``, ``console``; anything else is
    ``none``: decisions and conversion happen, nothing is written)."""
    exporter = settings.exporter
    if exporter == "otlp":
        return OtlpSink(settings, traces, metrics)
    if exporter == "file":
        return LinesSink(
            LineFile(lay.traces_file(run_dir, rank)),
            LineFile(lay.metrics_file(run_dir, rank)),
        )
    if exporter == "console":
        out = LineFile(None, sys.stdout)
        return LinesSink(out, out)
    return Sink()


class Spool:
    """The run directory's spool files for one rank: spans and metrics that could not be
    delivered, as OTLP/JSON lines (the replay command sends them later), with their counts.

    ``drop(reason, n)`` counts spans that are lost (not encodable, or the file not writable);
    ``log_once(cause, message, *args)`` reports a failure once. The runtime calls the ``write_*``
    methods with its lock held."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        encoder: SpanEncoder,
        batch_size: int,
        drop: Callable[[str, int], None],
        log_once: Callable[..., None],
    ) -> None:
        self.traces = LineFile(lay.spool_file(run_dir, rank, "traces"))
        self.metrics = LineFile(lay.spool_file(run_dir, rank, "metrics"))
        self.encoder = encoder
        self.batch_size = batch_size
        self._drop = drop
        self._log_once = log_once
        #: Spans written to the spool so far.
        self.spans = 0
        #: Metric collections written to the spool so far.
        self.metric_batches = 0

    def write_spans(self, spans: list[Any]) -> None:
        """Write spans, ``batch_size`` per line (as they are sent), and count them."""
        size = self.batch_size
        for i in range(0, len(spans), size):
            chunk = spans[i : i + size]
            try:
                line, dropped = self.encoder.json_line(chunk)
                self.traces.write(line)
            except Exception as exc:
                self._log_once(
                    "spool", "mlaunch telemetry: cannot write spool file (%s); spans lost", exc
                )
                self._drop(f"spool file not writable ({type(exc).__name__})", len(chunk))
                continue
            self.spans += len(chunk) - dropped
            self._drop("cannot be encoded", dropped)

    def write_metrics(self, data: Any) -> None:
        """Write one metrics collection (None: nothing)."""
        if data is None:
            return
        try:
            self.metrics.write(otlp_json.encode_metrics_line(data))
            self.metric_batches += 1
        except Exception as exc:
            self._log_once(
                "spool", "mlaunch telemetry: cannot write spool file (%s); metrics lost", exc
            )

    def close(self) -> None:
        """Close both files (a later write opens them again)."""
        self.traces.close()
        self.metrics.close()
