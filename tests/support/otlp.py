"""In-process OTLP receivers for tests, on 127.0.0.1 ephemeral ports.

- :class:`GrpcOtlpReceiver`: a real gRPC server (grpcio + opentelemetry-proto) implementing the
  OTLP TraceService, MetricsService and LogsService.
- :class:`HttpOtlpReceiver`: OTLP over HTTP/protobuf (``POST /v1/traces``, ``/v1/metrics``,
  ``/v1/logs``).
- :class:`HangingServer`: accepts TCP connections and never answers (the worst collector).
- :func:`closed_port_endpoint`: an endpoint where nothing listens.

Both receivers share one API::

    rx = GrpcOtlpReceiver().start()      # or HttpOtlpReceiver(); .endpoint is the URL to use
    ...                                  # point an exporter at rx.endpoint
    rx.wait_for_spans(3, timeout=10)     # -> True once >= 3 spans arrived
    rx.spans                             # flat span dicts (mlaunch.otlp.otlp_json.iter_spans)
    rx.metrics                           # flat metric dicts (otlp_json.iter_metrics)
    rx.headers                           # request headers / gRPC metadata of every request
    rx.stop()

or as a context manager (``with GrpcOtlpReceiver() as rx:``). For HTTP, ``rx.endpoint`` is the
base URL (``OTEL_EXPORTER_OTLP_ENDPOINT``); ``rx.traces_url``/``rx.metrics_url`` are the full
per-signal URLs.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlaunch.otlp import otlp_json
from support.serving import GrpcServed, HttpServed, Served


class _Store:
    """What a receiver collected, guarded by a condition variable for the wait_* helpers."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.spans: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.logs: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.trace_requests = 0
        self.metric_requests = 0

    def add_traces(self, request: Any, headers: dict[str, str]) -> None:
        spans = list(otlp_json.iter_spans(otlp_json.trace_request_to_dict(request)))
        with self.cond:
            self.spans.extend(spans)
            self.headers.append(headers)
            self.trace_requests += 1
            self.cond.notify_all()

    def add_metrics(self, request: Any, headers: dict[str, str]) -> None:
        metrics = list(otlp_json.iter_metrics(otlp_json.metrics_request_to_dict(request)))
        with self.cond:
            self.metrics.extend(metrics)
            self.headers.append(headers)
            self.metric_requests += 1
            self.cond.notify_all()

    def add_logs(self, request: Any, headers: dict[str, str]) -> None:
        with self.cond:
            for rl in request.resource_logs:
                for sl in rl.scope_logs:
                    self.logs.extend(sl.log_records)
            self.headers.append(headers)
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)


class _Receiver(Served):
    """Shared API of the gRPC and HTTP receivers."""

    def __init__(self) -> None:
        self._store = _Store()
        self.port = 0

    @property
    def spans(self) -> list[dict[str, Any]]:
        """Every span received so far (flat dicts with ``resource`` attributes)."""
        with self._store.cond:
            return list(self._store.spans)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every metric received so far (flat dicts, one per metric per request)."""
        with self._store.cond:
            return list(self._store.metrics)

    @property
    def logs(self) -> list[Any]:
        """Every log record received (protobuf ``LogRecord`` objects)."""
        with self._store.cond:
            return list(self._store.logs)

    @property
    def headers(self) -> list[dict[str, str]]:
        """Lower-cased request headers (HTTP) or metadata (gRPC) of every request."""
        with self._store.cond:
            return list(self._store.headers)

    def wait_for_spans(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until at least ``n`` spans arrived; False on timeout."""
        return self._store.wait(lambda: len(self._store.spans) >= n, timeout)

    def wait_for_metrics(self, names: set[str] | int, timeout: float = 10.0) -> bool:
        """Wait until every metric name in ``names`` (or at least ``names`` metrics) arrived."""
        if isinstance(names, int):
            return self._store.wait(lambda: len(self._store.metrics) >= names, timeout)
        return self._store.wait(lambda: names <= {m["name"] for m in self._store.metrics}, timeout)

    def wait_for_logs(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until at least ``n`` log records arrived."""
        return self._store.wait(lambda: len(self._store.logs) >= n, timeout)


class GrpcOtlpReceiver(_Receiver, GrpcServed):
    """OTLP/gRPC TraceService + MetricsService + LogsService on 127.0.0.1:<ephemeral>, or on
    ``port`` (a collector restarting where it was)."""

    def __init__(self, port: int = 0) -> None:
        super().__init__()
        self._server: Any = None
        self._bind_port = port

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>`` (plaintext)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GrpcOtlpReceiver:
        """Start serving; returns self."""
        import grpc
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
        from opentelemetry.proto.collector.metrics.v1 import (
            metrics_service_pb2,
            metrics_service_pb2_grpc,
        )
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        store = self._store

        def meta(context: Any) -> dict[str, str]:
            return {k.lower(): v for k, v in context.invocation_metadata()}

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
                store.add_traces(request, meta(context))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                store.add_metrics(request, meta(context))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                store.add_logs(request, meta(context))
                return logs_service_pb2.ExportLogsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self._bind_port}")
        server.start()
        self._server = server
        return self


class HttpOtlpReceiver(_Receiver, HttpServed):
    """OTLP/HTTP (protobuf bodies) on 127.0.0.1:<ephemeral>."""

    def __init__(self) -> None:
        super().__init__()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """The base URL, as for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_url(self) -> str:
        """The full traces URL."""
        return self.endpoint + "/v1/traces"

    @property
    def metrics_url(self) -> str:
        """The full metrics URL."""
        return self.endpoint + "/v1/metrics"

    def start(self) -> HttpOtlpReceiver:
        """Start serving; returns self."""
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
            ExportLogsServiceRequest,
            ExportLogsServiceResponse,
        )
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        store = self._store
        routes = {
            "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse, store.add_traces),
            "/v1/metrics": (
                ExportMetricsServiceRequest,
                ExportMetricsServiceResponse,
                store.add_metrics,
            ),
            "/v1/logs": (ExportLogsServiceRequest, ExportLogsServiceResponse, store.add_logs),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server name
                route = routes.get(self.path.split("?")[0])
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if route is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                req_cls, resp_cls, add = route
                request = req_cls()
                request.ParseFromString(body)
                add(request, {k.lower(): v for k, v in self.headers.items()})
                payload = resp_cls().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self


class HangingServer(Served):
    """Accepts TCP connections on 127.0.0.1 and never reads or answers: an OTLP endpoint that
    hangs every exporter call until its own timeout."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self.port = 0

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """How many connections were accepted."""
        return len(self._conns)

    def start(self) -> HangingServer:
        """Start accepting; returns self."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set() and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)  # held open, never read

    def stop(self) -> None:
        """Close the listening socket and every held connection."""
        self._stop.set()
        time.sleep(0.25)  # let the accept loop notice
        for conn in self._conns:
            conn.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def closed_port_endpoint() -> str:
    """``http://127.0.0.1:<port>`` where nothing listens (connection refused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


#: The token tests give the launcher's embedded receiver (``Receiver(..., token=RECEIVER_TOKEN)``);
#: its clients send it as the workers do, through the standard headers variable
#: (:data:`RECEIVER_HEADERS_ENV`, which the SDK exporters read when given no headers).
RECEIVER_TOKEN = "test-receiver-token"
RECEIVER_HEADERS = {"authorization": f"Bearer {RECEIVER_TOKEN}"}
RECEIVER_HEADERS_ENV = {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{RECEIVER_TOKEN}"}
