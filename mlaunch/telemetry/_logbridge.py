"""The bridge from Python logging to OpenTelemetry logs (``LOGS_ENABLED``).

Imported only by the runtime, on an exporting rank. The bridge is optional: the runtime logs a
failure to build it once and goes on without it.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from mlaunch.telemetry._sinks import otlp_headers, protocol_kwargs

if TYPE_CHECKING:
    from mlaunch.settings import TelemetrySettings

log = logging.getLogger("mlaunch.telemetry")


class LogBridge:
    """An SDK ``LoggerProvider`` and the handler on the root logger that feeds it."""

    def __init__(self, provider: Any, handler: logging.Handler) -> None:
        self.provider = provider
        self.handler = handler

    def detach(self) -> None:
        """Take the handler off the root logger (records logged from now on are not exported)."""
        logging.getLogger().removeHandler(self.handler)

    def shutdown(self) -> None:
        """Flush and stop the provider's processors (may block: the runtime calls it on a daemon
        thread within its shutdown deadline)."""
        self.provider.shutdown()


def install_log_bridge(settings: TelemetrySettings, resource: Any) -> LogBridge | None:
    """Send Python logging to the ``otlp`` or ``console`` exporter; None for the file and none
    exporters, which have no log output (Python logging keeps its own handlers). Raises when the
    SDK's logs support is missing or the exporter cannot be built."""
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    if settings.exporter == "otlp":
        provider.add_log_record_processor(_otlp_processor(settings.otel))
    elif settings.exporter == "console":
        from opentelemetry.sdk._logs.export import ConsoleLogExporter

        provider.add_log_record_processor(SimpleLogRecordProcessor(ConsoleLogExporter()))
    else:
        log.info(
            "mlaunch telemetry: LOGS_ENABLED has no effect with exporter %r", settings.exporter
        )
        return None
    with warnings.catch_warnings():
        # Deprecated in favour of opentelemetry-instrumentation-logging, which is not a
        # dependency; the SDK handler still works and keeps the dependency set small.
        warnings.simplefilter("ignore", DeprecationWarning)
        handler = LoggingHandler(level=logging.NOTSET, logger_provider=provider)
    logging.getLogger().addHandler(handler)
    return LogBridge(provider, handler)


def _otlp_processor(otel: Any) -> Any:
    """A batching processor with the OTLP log exporter of the logs protocol (gRPC: the base
    endpoint; HTTP: the base endpoint's ``/v1/logs``)."""
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    protocol = getattr(otel, "logs_protocol", None) or otel.protocol
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

        endpoint = getattr(otel, "base_endpoint", None) or otel.endpoint
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

        base = getattr(otel, "base_endpoint", None) or otel.endpoint.rsplit("/v1/", 1)[0]
        endpoint = base.rstrip("/") + "/v1/logs"
    kwargs: dict[str, Any] = {"headers": otlp_headers(otel)}
    if otel.timeout_s is not None:
        kwargs["timeout"] = otel.timeout_s
    exporter = OTLPLogExporter(endpoint=endpoint, **protocol_kwargs(otel, protocol, kwargs))
    return BatchLogRecordProcessor(exporter)
