"""The one way mlaunch sends an OTLP export request: the launcher's job trace, the receiver's relay
upstream, ``mlaunch trace replay`` and ``doctor``'s endpoint probe all open their channel or
connection here, by one TLS rule and one deadline rule.

- TLS (:func:`grpc_tls`): for gRPC the OpenTelemetry SDK's rule; for HTTP the URL's scheme, as
  every HTTP client has it. Certificates are read only when TLS is used.
- Deadline and retries (:func:`deadline`): each send has one deadline and mlaunch never retries
  it; what is not delivered is the caller's to spool (the job trace, the relay) or to report
  (replay, doctor). gRPC's own transparent retries stay as gRPC has them unless a caller turns
  them off (doctor, whose single probe must report the first answer).
- Metadata (:func:`grpc_metadata`): gRPC needs lower-case keys; no headers is no metadata.

Each caller keeps its own reading of a failure (doctor classifies it, replay names a protocol
mismatch, the job trace and the relay spool), since that is what differs between them on purpose.
``grpc``, ``ssl`` and ``urllib`` are imported only when used (the receiver reads the service
names here on start-up); the rest is the standard library.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

#: Each signal's fully qualified OTLP gRPC service (what the receiver serves, what senders call).
EXPORT_SERVICES: dict[str, str] = {
    "traces": "opentelemetry.proto.collector.trace.v1.TraceService",
    "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService",
    "logs": "opentelemetry.proto.collector.logs.v1.LogsService",
}
#: Each signal's gRPC export method (``/<service>/Export``, the service's one method).
EXPORT_METHODS: dict[str, str] = {
    signal: f"/{service}/Export" for signal, service in EXPORT_SERVICES.items()
}
#: The shortest deadline a send is given: less cannot even connect.
MIN_DEADLINE_S = 0.05
#: The largest request the relay forwards over gRPC (gRPC's default is 4 MiB; a worker's batch
#: of fine-grained spans can be more).
RELAY_MAX_SEND_BYTES = 64 * 1024 * 1024


def grpc_tls(scheme: str, insecure: bool | None = None, *, insecure_first: bool = False) -> bool:
    """Whether a gRPC channel to an endpoint of URL ``scheme`` uses TLS.

    The SDK's rule: ``https`` is TLS; otherwise ``OTEL_EXPORTER_OTLP_INSECURE`` decides when it
    is set (``insecure``); otherwise every scheme but ``http`` is TLS.

    ``insecure_first`` is the launcher's job trace's rule, kept as it has always been: an
    ``insecure`` true means plaintext even for ``https``, and ``http`` is plaintext even with
    ``insecure`` false (the SDK would use TLS in both cases)."""
    if insecure_first:
        return not insecure and scheme != "http"
    if scheme == "https":
        return True
    if insecure is not None:
        return not insecure
    return scheme != "http"


def deadline(timeout_s: float, limit_s: float | None = None) -> float:
    """One send's deadline: ``timeout_s``, no more than the endpoint's own ``limit_s``
    (``OTEL_EXPORTER_OTLP_TIMEOUT``) when given, and never below :data:`MIN_DEADLINE_S`."""
    if limit_s is not None:
        timeout_s = min(timeout_s, limit_s)
    return max(MIN_DEADLINE_S, timeout_s)


def grpc_metadata(headers: Mapping[str, str] | None) -> tuple[tuple[str, str], ...] | None:
    """``headers`` as gRPC metadata: keys lower case (gRPC refuses others), None for none."""
    return tuple((str(k).lower(), str(v)) for k, v in (headers or {}).items()) or None


def failure_text(exc: BaseException) -> str:
    """A failed send in one line: ``gRPC UNAVAILABLE: failed to connect ...``, ``HTTP 404 Not
    Found``, the connection's own reason. Never grpc's multi-line ``_InactiveRpcError`` repr (its
    ``debug_error_string`` is for gRPC's developers) nor urllib's ``<urlopen error ...>``."""
    import urllib.error

    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):  # grpc.RpcError (a grpc.Call): status and details
        name = getattr(code(), "name", str(code()))
        text = f"gRPC {name}: {details() or ''}".rstrip(": ")
    elif isinstance(exc, urllib.error.HTTPError):
        text = f"HTTP {exc.code} {exc.reason}"
    elif isinstance(exc, urllib.error.URLError):
        reason = exc.reason
        text = getattr(reason, "strerror", None) or str(reason)
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def quiet_grpc() -> None:
    """Keep gRPC's C core from logging failed handshakes to stderr, for a caller that reports the
    failure itself; only effective before grpc is first imported, and a user's setting wins."""
    if "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def grpc_channel(
    target: str,
    *,
    tls: bool,
    certificate: str | None = None,
    client_key: str | None = None,
    client_certificate: str | None = None,
    options: list[tuple[str, Any]] | None = None,
) -> Any:
    """A gRPC channel to ``target`` (``host:port``): with TLS, verified against ``certificate``
    (PEM; the system's roots when None) and presenting the client pair when given."""
    import grpc

    if tls:
        creds = grpc.ssl_channel_credentials(
            _read(certificate), _read(client_key), _read(client_certificate)
        )
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def grpc_unary(
    channel: Any,
    method: str,
    request_serializer: Any = None,
    response_deserializer: Any = None,
) -> Any:
    """The unary call ``method`` (``/<service>/Export``) on ``channel``. Raw bytes both ways by
    default: a request goes out as its caller serialised it, and the response is not parsed
    (give the message classes' ``SerializeToString`` / ``FromString`` to have them used)."""
    return channel.unary_unary(
        method, request_serializer=request_serializer, response_deserializer=response_deserializer
    )


def ssl_context(
    certificate: str | None = None,
    client_certificate: str | None = None,
    client_key: str | None = None,
) -> ssl.SSLContext:
    """The TLS context of an HTTPS send: the system's roots, or ``certificate`` (PEM), and the
    client pair when given."""
    import ssl

    ctx = ssl.create_default_context(cafile=certificate or None)
    if client_certificate:
        ctx.load_cert_chain(client_certificate, client_key or None)
    return ctx


def http_post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float,
    *,
    context: ssl.SSLContext | None = None,
    use_proxy: bool = True,
) -> tuple[int, Any, bytes]:
    """POST ``body`` to ``url`` with urllib; ``(status, response headers, response body)``.
    Raises urllib's errors unchanged (``HTTPError`` for a non-2xx answer), for the caller to read.
    ``use_proxy`` False ignores the ``*_proxy`` variables (a loopback endpoint)."""
    import urllib.request  # here: the receiver reads this module's names and never posts

    request = urllib.request.Request(url, data=body, method="POST", headers=dict(headers))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler(None if use_proxy else {}),
        urllib.request.HTTPSHandler(context=context),
    )
    with opener.open(request, timeout=timeout_s) as resp:
        return resp.status, resp.headers, resp.read()
