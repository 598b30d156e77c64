"""Non-OTLP peers for the doctor tests, on 127.0.0.1 ephemeral ports (the OTLP receivers are in
``support.otlp``):

- :class:`PlainHttpServer`: an HTTP/1.1 server that is not an OTLP receiver.
- :class:`TlsHttpOtlpServer`: OTLP/HTTP behind TLS (a self-signed certificate), for https
  success and for http-to-TLS mismatches.
- :class:`TlsGrpcOtlpServer`: OTLP/gRPC behind TLS.
- :class:`PlainGrpcServer`: a gRPC server with no services (every call is UNIMPLEMENTED).
- :class:`Listener`: a socket that holds a port (a busy rendezvous port).
- :func:`self_signed_cert`: a certificate for 127.0.0.1/localhost, made with ``cryptography``.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from support.serving import GrpcServed, HttpServed


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """Write ``cert.pem`` and ``key.pem`` for CN/SAN 127.0.0.1 + localhost; returns both paths.
    The certificate is its own CA, so it can be passed as OTEL_EXPORTER_OTLP_CERTIFICATE."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class _HttpPeer(HttpServed):
    """A threaded HTTP server on 127.0.0.1 with start/stop and context-manager use."""

    scheme = "http"

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    def _wrap(self, server: ThreadingHTTPServer) -> None:
        """Hook for TLS."""

    @property
    def endpoint(self) -> str:
        """``<scheme>://127.0.0.1:<port>``."""
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self) -> Any:
        """Start serving; returns self."""
        server = _QuietServer(("127.0.0.1", 0), self._handler())
        server.daemon_threads = True
        self._wrap(server)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # failed TLS handshakes and dropped clients are the point of these tests


class _Quiet(BaseHTTPRequestHandler):
    timeout = 5  # a client that never finishes its request does not pin a thread forever

    def log_message(self, *args: Any) -> None:
        pass


class PlainHttpServer(_HttpPeer):
    """An HTTP/1.1 server that is not an OTLP receiver: GET / answers an HTML page; POST
    answers ``post_status`` with an HTML body, or 501 (http.server's default) when None."""

    def __init__(self, post_status: int | None = None) -> None:
        super().__init__()
        self.post_status = post_status

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        post_status = self.post_status

        class Handler(_Quiet):
            def _html(self, status: int) -> None:
                body = b"<html><body>hello</body></html>"
                self.send_response(status)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server name
                self._html(200)

        if post_status is not None:

            def do_POST(self: Any) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self._html(post_status)

            Handler.do_POST = do_POST  # type: ignore[attr-defined]
        return Handler


class TlsHttpOtlpServer(_HttpPeer):
    """OTLP/HTTP behind TLS: ``POST /v1/traces`` answers an empty ExportTraceServiceResponse.
    Plaintext clients fail the handshake and are dropped."""

    scheme = "https"

    def __init__(self, cert: Path, key: Path) -> None:
        super().__init__()
        self.cert, self.key = cert, key

    def _wrap(self, server: ThreadingHTTPServer) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        # The handshake happens in the handler thread, so a bad client blocks no one.
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        class Handler(_Quiet):
            def setup(self) -> None:
                self.request.settimeout(5)
                self.request.do_handshake()
                super().setup()

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


class _GrpcPeer(GrpcServed):
    scheme = "http"

    def __init__(self) -> None:
        self._server: Any = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        """``<scheme>://127.0.0.1:<port>``."""
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _build(self, server: Any) -> int:
        raise NotImplementedError

    def start(self) -> Any:
        """Start serving; returns self."""
        import grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.port = self._build(server)
        server.start()
        self._server = server
        return self


class PlainGrpcServer(_GrpcPeer):
    """A plaintext gRPC server with no services: every call ends UNIMPLEMENTED."""

    def _build(self, server: Any) -> int:
        return server.add_insecure_port("127.0.0.1:0")


class TlsGrpcOtlpServer(_GrpcPeer):
    """OTLP/gRPC TraceService behind TLS."""

    scheme = "https"

    def __init__(self, cert: Path, key: Path) -> None:
        super().__init__()
        self.cert, self.key = cert, key

    def _build(self, server: Any) -> int:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
                return trace_service_pb2.ExportTraceServiceResponse()

        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        creds = grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])
        return server.add_secure_port("127.0.0.1:0", creds)


class Listener:
    """A listening socket on 127.0.0.1 that holds a port (and answers nothing)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port: int = self.sock.getsockname()[1]

    def close(self) -> None:
        """Release the port."""
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
