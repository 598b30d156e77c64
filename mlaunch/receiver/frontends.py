"""The receiver's network frontends, loopback only (127.0.0.1, ephemeral ports): OTLP/gRPC
(TraceService, MetricsService, LogsService) and OTLP/HTTP (``/v1/traces``, ``/v1/metrics``,
``/v1/logs``; protobuf and JSON bodies, gzip or deflate).

A handler first checks the launch's token (:meth:`Receiver.authorized`; HTTP before reading the
body), then reads the request, hands the raw bytes to :meth:`Receiver.submit` and answers: no
parsing, no disk. Both frontends cap a request at :data:`~mlaunch.receiver.limits.MAX_REQUEST_BYTES`
(gRPC's receive limit; HTTP's body and decompressed body) and bound their threads, so a burst
or a misbehaving client holds bounded memory; a client that disconnects mid-request, or sends
half a body, costs one handler thread until its socket times out.
"""

from __future__ import annotations

import contextlib
import json
import threading
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from mlaunch.envcontract import RECEIVER_AUTH_HEADER
from mlaunch.receiver.limits import MAX_REQUEST_BYTES, RETRY_AFTER_S
from mlaunch.receiver.signals import SIGNALS


class Intake(Protocol):
    """What a frontend hands its requests to (:class:`mlaunch.receiver.core.Receiver`), written
    here rather than imported: the receiver starts its frontends, so this module is above it."""

    def authorized(self, value: str | bytes | None) -> bool:
        """Whether an ``authorization`` value carries this launch's token."""
        ...

    def unauthenticated(self, signal: str) -> None:
        """Count a request refused for a missing or wrong token."""
        ...

    def submit(self, signal: str, payload: Any, nbytes: int) -> bool:
        """Queue one request; False when the queue is full."""
        ...

    def refuse(self, signal: str, nbytes: int) -> None:
        """Count a request refused before it was read."""
        ...

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` would be queued now."""
        ...

    def malformed(self, signal: str, message: str) -> None:
        """Count an undecodable request."""
        ...


#: Handler threads of each frontend (a node has at most a few dozen exporting workers).
WORKER_THREADS = 8
#: gRPC calls admitted at once; more are refused with RESOURCE_EXHAUSTED (retryable).
MAX_CONCURRENT_RPCS = 64
#: Open HTTP connections served at once (each holds a thread; the SDK keeps one per signal and
#: worker alive between exports).
MAX_HTTP_CONNECTIONS = 128
#: An HTTP client that stops sending mid-request frees its thread after this many seconds.
HTTP_SOCKET_TIMEOUT_S = 10.0


def _retry_trailer() -> tuple[tuple[str, bytes], ...]:
    """``google.rpc.RetryInfo`` in the trailers: the OTel SDK waits this long before retrying."""
    try:
        from google.rpc.error_details_pb2 import RetryInfo
    except (
        ImportError
    ):  # googleapis-common-protos comes with the gRPC exporter; tolerate it missing
        return ()
    info = RetryInfo()
    info.retry_delay.FromMilliseconds(int(RETRY_AFTER_S * 1000))
    return (("google.rpc.retryinfo-bin", info.SerializeToString()),)


class GrpcFrontend:
    """OTLP/gRPC on 127.0.0.1; raw bytes in, empty response out."""

    def __init__(self, receiver: Intake) -> None:
        import grpc

        self._server = grpc.server(
            futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="mlaunch-otlp-grpc"),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.so_reuseport", 0),  # never share a port with another process
            ],
        )
        trailer = _retry_trailer()

        def handler(signal: str) -> Any:
            def export(body: bytes, context: Any) -> bytes:
                auth = [v for k, v in context.invocation_metadata() if k == RECEIVER_AUTH_HEADER]
                if len(auth) != 1 or not receiver.authorized(auth[0]):
                    receiver.unauthenticated(signal)
                    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
                    context.set_details("mlaunch receiver: this job's token is required")
                    return b""
                if not receiver.submit(signal, body, len(body)):
                    context.set_trailing_metadata(trailer)
                    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                    context.set_details("mlaunch receiver queue full; retry")
                return b""  # an empty Export*ServiceResponse: full success

            # No (de)serializers: the request stays bytes until the writer thread parses it.
            return grpc.unary_unary_rpc_method_handler(export)

        self._server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(sig.service, {"Export": handler(name)})
                for name, sig in SIGNALS.items()
            ]
        )
        port = self._server.add_insecure_port("127.0.0.1:0")
        if not port:
            raise OSError("no free port on 127.0.0.1")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop accepting; let calls in flight finish within ``grace`` seconds."""
        self._server.stop(grace).wait(grace + 1.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, receiver: Intake) -> None:
        self.receiver = receiver
        self.slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Bounded threads: beyond the limit a connection waits a moment, then is closed (the
        # client's exporter retries); never an unbounded receiver, never a stuck shutdown().
        if not self.slots.acquire(timeout=1.0):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that vanished mid-request: nothing to report, nothing to keep


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the SDK's session reuses its connection
    timeout = HTTP_SOCKET_TIMEOUT_S
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        signal = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        if self.path.split("?", 1)[0].rstrip("/") != f"/v1/{signal}" or signal not in SIGNALS:
            self._reply(404, b"", "text/plain")
            return
        receiver = self.server.receiver
        auth = self.headers.get_all(RECEIVER_AUTH_HEADER) or []
        if len(auth) != 1 or not receiver.authorized(auth[0]):
            # Before the body is read: a stranger's request never enters memory (the connection
            # closes, as the unread body is still on it).
            receiver.unauthenticated(signal)
            self._reply(401, b"", "text/plain", close=True, extra=(("WWW-Authenticate", "Bearer"),))
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(411, b"", "text/plain")
            return
        if not 0 <= length <= MAX_REQUEST_BYTES:
            self._reply(413, b"", "text/plain", close=True)
            return
        if not receiver.has_room(length):
            # Refused before reading: a body the queue cannot take never enters memory (the
            # connection closes, as the unread body is still on it).
            receiver.refuse(signal, length)
            self._refuse(close=True)
            return
        body = self.rfile.read(length)
        if len(body) != length:  # the client went away mid-body
            self.close_connection = True
            return
        json_body = "json" in (self.headers.get("Content-Type") or "").lower()
        try:
            body = _decompress(body, (self.headers.get("Content-Encoding") or "").lower())
        except ValueError as exc:
            self._reply(400 if "decode" in str(exc) else 413, str(exc).encode(), "text/plain")
            return
        sig = SIGNALS[signal]
        payload: Any = body
        if json_body:
            try:
                payload = sig.from_json(json.loads(body))
            except Exception:
                receiver.malformed(signal, f"refused an undecodable OTLP/JSON {signal} request")
                self._reply(400, b'{"message":"not OTLP/JSON"}', "application/json")
                return
        if not receiver.submit(signal, payload, len(body)):
            self._refuse()
            return
        if json_body:
            self._reply(200, b"{}", "application/json")
        else:
            self._reply(200, b"", "application/x-protobuf")

    def _refuse(self, *, close: bool = False) -> None:
        """429 with Retry-After: the OTel SDK's HTTP exporter waits that long and retries."""
        self.send_response(429)
        self.send_header("Retry-After", str(max(1, round(RETRY_AFTER_S))))
        self.send_header("Content-Length", "0")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _reply(
        self, code: int, body: bytes, ctype: str, *, close: bool = False,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:  # fmt: skip
        self.send_response(code)
        for name, value in extra:
            self.send_header(name, value)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # one line per request would drown the launcher's output


def _decompress(body: bytes, encoding: str) -> bytes:
    """The body without its Content-Encoding, refusing more than MAX_REQUEST_BYTES (a zip bomb)."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ValueError(f"cannot decode Content-Encoding {encoding!r}")
    d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = d.decompress(body, MAX_REQUEST_BYTES + 1)
    except zlib.error as exc:
        raise ValueError(f"cannot decode the {encoding} body ({exc})") from None
    if len(out) > MAX_REQUEST_BYTES:
        raise ValueError("decompressed body too large")
    return out


class HttpFrontend:
    """OTLP/HTTP on 127.0.0.1."""

    def __init__(self, receiver: Intake) -> None:
        self._server = _Server(receiver)
        port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
            name="mlaunch-otlp-http", daemon=True,
        )  # fmt: skip
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop accepting (requests in flight finish on their daemon threads)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(grace)
