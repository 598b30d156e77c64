"""The OTLP endpoint: the configured URL, a TCP connect, then a real (empty) OTLP export, with a
specific diagnosis when it fails. grpc and the OTLP protobufs are imported only here, on use."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import ssl
import time
import urllib.error
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from mlaunch import envcontract as ec
from mlaunch.doctor.results import NET_TIMEOUT_S, CheckResult, fail, ok, warn
from mlaunch.endpoints import bracket
from mlaunch.endpoints import redact as redact_url
from mlaunch.envcontract import PRIMARY_PREFIX
from mlaunch.otlp import send
from mlaunch.settings import Settings

#: The OTLP/gRPC trace export method.
GRPC_EXPORT_METHOD = send.EXPORT_METHODS["traces"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    """What one OTLP export attempt got back."""

    kind: Literal["otlp", "status", "grpc", "cert", "timeout", "refused", "broken"]
    detail: str = ""
    status: int = 0


def _host_port(url: str) -> tuple[str, int]:
    from mlaunch.endpoints import EndpointError, parse_endpoint

    try:
        ep = parse_endpoint(url, default_port=443 if url.strip().startswith("https") else 80)
    except EndpointError:
        return "localhost", 80
    return ep.host, ep.port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _grpc_target(host: str, port: int) -> str:
    return f"{bracket(host)}:{port}"


def grpc_export(
    url: str, headers: Mapping[str, str], timeout_s: float, certificate: str | None = None
) -> _Answer:
    """An empty ExportTraceServiceRequest as a gRPC unary call (TLS for https URLs)."""
    send.quiet_grpc()  # doctor reports failed handshakes itself
    import grpc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    host, port = _host_port(url)
    # One probe reports the first answer: no gRPC retries.
    options = [("grpc.enable_retries", 0)]
    if _is_loopback(host):
        options.append(("grpc.enable_http_proxy", 0))
    # The URL comes from the settings, always http:// or https://: TLS for https only.
    tls = send.grpc_tls(urllib.parse.urlparse(url).scheme)
    channel = send.grpc_channel(
        _grpc_target(host, port), tls=tls, certificate=certificate, options=options
    )
    try:
        export = send.grpc_unary(
            channel,
            GRPC_EXPORT_METHOD,
            request_serializer=ExportTraceServiceRequest.SerializeToString,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        export(ExportTraceServiceRequest(), timeout=timeout_s, metadata=send.grpc_metadata(headers))
        return _Answer("otlp")
    except grpc.RpcError as err:
        code = err.code() if hasattr(err, "code") else None
        details = (err.details() if hasattr(err, "details") else "") or ""
        if "CERTIFICATE_VERIFY_FAILED" in details or "certificate verify failed" in details:
            return _Answer("cert", details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Answer("timeout", details)
        if code == grpc.StatusCode.UNAVAILABLE:
            return _Answer("broken", details)
        return _Answer("grpc", f"{code.name if code else 'UNKNOWN'}: {details}".strip())
    finally:
        channel.close()


def http_export(
    url: str, headers: Mapping[str, str], timeout_s: float, certificate: str | None = None
) -> _Answer:
    """An empty ExportTraceServiceRequest POSTed as ``application/x-protobuf``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    host, _ = _host_port(url)
    body = ExportTraceServiceRequest().SerializeToString()
    context = send.ssl_context(certificate) if url.startswith("https") else None
    try:
        status, answer_headers, data = send.http_post(
            url,
            body,
            {**headers, "Content-Type": "application/x-protobuf"},
            timeout_s,
            context=context,
            use_proxy=not _is_loopback(host),
        )
        ctype = answer_headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return _Answer(
            "status", err.headers.get("Content-Type", "") if err.headers else "", err.code
        )
    except urllib.error.URLError as err:
        return _classify_socket_error(err.reason)
    except Exception as exc:  # http.client.BadStatusLine and friends: not an HTTP/1 answer
        return _classify_socket_error(exc)
    if ctype.split(";")[0].strip() in ("application/x-protobuf", "application/protobuf") or (
        not ctype and not data
    ):
        try:
            ExportTraceServiceResponse.FromString(data)
            return _Answer("otlp", status=status)
        except Exception:
            pass
    return _Answer("status", ctype or "no Content-Type", status)


def _classify_socket_error(reason: object) -> _Answer:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return _Answer("cert", str(reason.verify_message or reason))
    if isinstance(reason, TimeoutError | socket.timeout):
        return _Answer("timeout", str(reason))
    if isinstance(reason, ConnectionRefusedError):
        return _Answer("refused", str(reason))
    return _Answer("broken", f"{type(reason).__name__}: {reason}")


PeerKind = Literal["http1", "http2", "tls", "silent", "closes", "refused", "unreachable"]

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def identify_peer(host: str, port: int, timeout_s: float) -> PeerKind:
    """What the server at ``host:port`` speaks, in plaintext first: the HTTP/2 connection
    preface draws a SETTINGS frame from a gRPC server and an ``HTTP/1.x`` error from an HTTP/1
    server; a peer that answers neither is tried with a TLS handshake."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"
    data = b""
    with sock:
        try:
            sock.sendall(_H2_PREFACE)
            deadline = time.monotonic() + timeout_s
            while len(data) < 9:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(64)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            if not data:
                return "silent"
        except OSError:
            pass
    if len(data) >= 9 and data[:3] < b"\x00\x40\x00" and data[3] == 0x04:
        return "http2"  # a SETTINGS frame (a small length, type 4) answers the preface
    if data.startswith(b"HTTP/") or (
        data and all(32 <= b < 127 or b in b"\r\n\t" for b in data[:64])
    ):
        # An HTTP/1 error page; some servers (Python's http.server) answer an unsupported
        # version HTTP/0.9-style, with the body only.
        return "http1"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return "tls"
    except (OSError, ssl.SSLError):
        return "closes"


def _describe_peer(kind: PeerKind) -> str:
    return {
        "http1": "a plaintext HTTP/1.1 server",
        "http2": "a plaintext HTTP/2 (gRPC) server",
        "tls": "a TLS server",
    }.get(kind, "a server")


def check_otlp(settings: Settings, timeout_s: float = NET_TIMEOUT_S) -> list[CheckResult]:
    """The OTLP endpoint: configured URL, TCP connect, then a real OTLP export probe."""
    t, o = settings.telemetry, settings.telemetry.otel
    if t.exporter != "otlp" and o.endpoint_configured:
        # An endpoint does not override an exporter the user chose (their own config file, a
        # variable; a shipped config's gives way in load_settings): say that the run will not
        # send there, instead of probing a collector nothing will reach.
        return [
            warn(
                "otlp endpoint",
                f"{redact_url(o.endpoint)} is configured but not used: the exporter is"
                f" {t.exporter!r} from {settings.source('telemetry.exporter')}",
                f"set {PRIMARY_PREFIX}EXPORTER=otlp (or pass --otel-exporter otlp) to send there;"
                " an endpoint you set wins only over a shipped config's exporter",
            )
        ]
    if t.exporter != "otlp":
        what = {"file": "file exporter: no collector needed (traces go to the run directory)"}
        return [
            ok(
                "otlp endpoint",
                what.get(t.exporter or "", f"{t.exporter} exporter: no collector needed"),
            )
        ]
    url, protocol = o.endpoint, o.protocol
    src = settings.source("telemetry.otel.traces_endpoint")
    if src.kind == "default":
        src = settings.source("telemetry.otel.base_endpoint")
    var = src.name if src.kind == "env" else ec.OTLP_ENDPOINT
    origin = f"from {src}" if src.kind != "default" else "the default"
    host, port = _host_port(url)
    results = [ok("otlp endpoint", f"{redact_url(url)} over {protocol} ({origin})")]
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.gaierror as exc:
        return [*results, fail("otlp connect", f"cannot resolve {host!r} ({exc})",
                               f"fix the host name in {var}")]  # fmt: skip
    except ConnectionRefusedError:
        return [*results, _refused(f"{host}:{port}", protocol, var, "otlp connect")]
    except TimeoutError:
        return [*results, fail("otlp connect", f"no TCP answer from {host}:{port} within"
                               f" {timeout_s:g} s", f"check the host in {var} and firewalls")]  # fmt: skip
    except OSError as exc:
        return [*results, fail("otlp connect", f"cannot connect to {host}:{port} ({exc})",
                               f"check {var}")]  # fmt: skip
    results.append(ok("otlp connect", f"TCP connect to {host}:{port} succeeded"))
    if o.certificate and not Path(o.certificate).is_file():
        return [
            *results,
            fail(
                "otlp probe",
                f"{ec.OTLP_CERTIFICATE}={o.certificate} is not a file",
                f"point {ec.OTLP_CERTIFICATE} at the collector's CA certificate (PEM)",
            ),
        ]
    results.append(probe_otlp(url, protocol, dict(o.headers), timeout_s, o.certificate, var))
    return results


def _export(
    url: str, protocol: str, headers: Mapping[str, str], timeout_s: float, cert: str | None
) -> _Answer:
    if protocol == "grpc":
        return grpc_export(url, headers, timeout_s, cert)
    return http_export(url, headers, timeout_s, cert)


def probe_otlp(
    url: str,
    protocol: str,
    headers: Mapping[str, str],
    timeout_s: float = NET_TIMEOUT_S,
    certificate: str | None = None,
    var: str = ec.OTLP_ENDPOINT,
) -> CheckResult:
    """Whether ``url`` answers an empty trace export as an OTLP receiver over ``protocol``; on
    failure, a specific diagnosis (wrong protocol, TLS on one side only, wrong path, hang).
    ``headers`` are sent but never shown."""
    name = "otlp probe"
    answer = _export(url, protocol, headers, timeout_s, certificate)
    hostport = _grpc_target(*_host_port(url))
    if answer.kind == "otlp":
        return ok(name, f"{redact_url(url)} answers an empty trace export as an OTLP/{_proto_label(protocol)}"
                  " receiver")  # fmt: skip
    if answer.kind == "cert":
        return fail(
            name,
            f"the TLS certificate of {hostport} is not trusted ({answer.detail})",
            f"set {ec.OTLP_CERTIFICATE} to the collector's CA certificate (PEM)",
        )
    if answer.kind == "refused":
        return _refused(hostport, protocol, var)
    if answer.kind == "status":
        return _http_status_result(url, answer, var, headers)
    if answer.kind == "grpc":
        return _grpc_answer_result(answer, hostport, var)
    # No usable answer: find out what the peer speaks.
    return _peer_result(url, protocol, headers, timeout_s, certificate, var, answer)


def _grpc_answer_result(answer: _Answer, hostport: str, var: str) -> CheckResult:
    """A gRPC server answered the export with an error status."""
    name = "otlp probe"
    if answer.detail.startswith("UNIMPLEMENTED"):
        return fail(
            name,
            f"a gRPC server answers at {hostport}, but without the OTLP trace service"
            " (UNIMPLEMENTED)",
            f"point {var} at the collector's OTLP gRPC receiver (usually port 4317)",
        )
    if answer.detail.startswith(("UNAUTHENTICATED", "PERMISSION_DENIED")):
        return fail(
            name,
            f"the OTLP receiver at {hostport} rejected the credentials ({answer.detail.split(':')[0]})",
            f"check {ec.OTLP_HEADERS} (e.g. authorization=Bearer%20TOKEN)",
        )
    return fail(name, f"the gRPC peer at {hostport} answered {answer.detail}",
                "check the collector's logs")  # fmt: skip


def _peer_result(
    url: str,
    protocol: str,
    headers: Mapping[str, str],
    timeout_s: float,
    certificate: str | None,
    var: str,
    answer: _Answer,
) -> CheckResult:
    """The export got no usable ``answer``: the diagnosis from what the peer speaks (wrong
    protocol, TLS on one side only, silence)."""
    name = "otlp probe"
    parsed = urllib.parse.urlparse(url)
    host, port = _host_port(url)
    hostport = _grpc_target(host, port)
    peer = identify_peer(host, port, timeout_s)
    if peer == "refused":
        return _refused(hostport, protocol, var)
    if peer == "unreachable":
        return fail(name, f"cannot connect to {hostport}", f"check the host and port in {var}")
    if peer == "silent":
        return fail(
            name,
            f"{hostport} accepts connections but never answers (no reply within {timeout_s:g} s)",
            "check the collector is healthy and that this port is its OTLP receiver",
        )
    if parsed.scheme == "https" and peer in ("http1", "http2"):
        return fail(
            name,
            f"TLS on one side only: the URL is https:// but {hostport} is {_describe_peer(peer)}",
            f"use http://{hostport} in {var}, or enable TLS on the collector",
        )
    if parsed.scheme == "http" and peer == "tls":
        return fail(
            name,
            f"TLS on one side only: the URL is http:// but {hostport} expects TLS",
            f"use https://{hostport} in {var} (with {ec.OTLP_CERTIFICATE} for a private CA)",
        )
    if protocol == "grpc" and peer == "http1":
        other = http_export(
            f"{parsed.scheme}://{hostport}/v1/traces", headers, timeout_s, certificate
        )
        if other.kind == "otlp":
            return fail(
                name,
                f"an OTLP/HTTP receiver answers at {hostport}, but the protocol is grpc",
                f"set {ec.OTLP_PROTOCOL}=http/protobuf",
            )
        return fail(
            name,
            f"an HTTP/1.1 server (not OTLP/gRPC) answers on the gRPC endpoint {hostport}",
            f"point {var} at the collector's OTLP gRPC port (usually 4317)",
        )
    if protocol != "grpc" and peer == "http2":
        other = grpc_export(f"{parsed.scheme}://{hostport}", headers, timeout_s, certificate)
        if other.kind == "otlp":
            return fail(
                name,
                f"an OTLP/gRPC receiver answers at {hostport}, but the protocol is http/protobuf",
                f"set {ec.OTLP_PROTOCOL}=grpc",
            )
        return fail(
            name,
            f"a gRPC (HTTP/2) server, not an OTLP/HTTP receiver, answers on the HTTP endpoint"
            f" {hostport}",
            f"point {var} at the collector's OTLP HTTP port (usually 4318)",
        )
    if answer.kind == "timeout":
        return fail(
            name,
            f"{hostport} did not answer the OTLP export within {timeout_s:g} s",
            "check the collector is healthy and that this port is its OTLP receiver",
        )
    return fail(
        name,
        f"{hostport} is {_describe_peer(peer)} but did not answer as an OTLP/"
        f"{_proto_label(protocol)} receiver ({answer.detail})",
        f"point {var} at the collector's OTLP receiver",
    )


def _refused(hostport: str, protocol: str, var: str, name: str = "otlp probe") -> CheckResult:
    """Nothing listens at ``hostport``: start the collector or point ``var`` at it."""
    default = 4317 if protocol == "grpc" else 4318
    return fail(
        name,
        f"connection refused at {hostport}: nothing listens there",
        f"start the collector, or point {var} at it (OTLP {protocol} usually listens on port"
        f" {default})",
    )


def _proto_label(protocol: str) -> str:
    return "gRPC" if protocol == "grpc" else "HTTP"


def _http_status_result(
    url: str, answer: _Answer, var: str, headers: Mapping[str, str]
) -> CheckResult:
    name = "otlp probe"
    path = urllib.parse.urlparse(url).path
    code = answer.status
    if code == 404:
        if path.endswith("/v1/traces/v1/traces"):
            return fail(
                name,
                f"404 at {redact_url(url)}: the endpoint already ended with /v1/traces and mlaunch appends it",
                f"set {var} to the base URL, without /v1/traces",
            )
        if not path.endswith("/v1/traces"):
            return fail(
                name,
                f"404 at {redact_url(url)}: OTLP/HTTP receivers serve traces at /v1/traces, not {path or '/'}",
                f"end {ec.OTLP_TRACES_ENDPOINT} with /v1/traces (or set only the base"
                f" {ec.OTLP_ENDPOINT})",
            )
        return fail(
            name,
            f"404 at {redact_url(url)}: an HTTP server answers, but has no OTLP receiver at /v1/traces",
            f"point {var} at the collector's OTLP HTTP port (usually 4318)",
        )
    if code in (401, 403):
        sent = "with the configured headers" if headers else f"without {ec.OTLP_HEADERS}"
        return fail(
            name,
            f"{code} from {redact_url(url)}: the receiver rejected the request {sent}",
            f"set {ec.OTLP_HEADERS} to the collector's credentials"
            " (e.g. authorization=Bearer%20TOKEN)",
        )
    if code in (429, 502, 503, 504):
        return warn(
            name,
            f"{code} from {redact_url(url)}: the receiver is busy or unavailable right now",
            "check the collector's health; exporters retry these codes",
        )
    if 200 <= code < 300:
        return fail(
            name,
            f"{redact_url(url)} answered {code} with {answer.detail}, not an OTLP protobuf response",
            f"point {var} at the collector's OTLP HTTP receiver (usually port 4318)",
        )
    return fail(
        name,
        f"{code} from {redact_url(url)}: an HTTP server that is not an OTLP/HTTP protobuf receiver",
        f"point {var} at the collector's OTLP HTTP receiver (usually port 4318)",
    )
