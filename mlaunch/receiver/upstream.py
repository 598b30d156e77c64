"""The relay's upstream: where the embedded receiver forwards what workers send, configured exactly
as the workers' own OTLP exporters would have been (the standard ``OTEL_EXPORTER_OTLP_*``
variables, per-signal ones winning), so relaying changes nothing about protocol, headers or TLS.

Headers are secrets: they live in memory only; nothing here prints, logs or writes them (errors
name the endpoint and the failure, never a header).
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from mlaunch import envcontract as ec
from mlaunch.endpoints import bracket, redact
from mlaunch.otlp import send as otlp_send
from mlaunch.receiver.signals import SIGNALS, Signal

#: The exporters' default timeout (OTEL_EXPORTER_OTLP_TIMEOUT, seconds).
DEFAULT_TIMEOUT_S = 10.0
_DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http": "http://localhost:4318"}


def _var(env: Mapping[str, str], signal: str, name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_<SIGNAL>_<NAME>`` else ``OTEL_EXPORTER_OTLP_<NAME>`` (blank = unset)."""
    for key in (ec.otlp_var(name, signal), ec.otlp_var(name)):
        value = env.get(key, "").strip()
        if value:
            return value
    return None


def _headers(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip():  # a malformed entry was refused by the settings before launch
            out[unquote(key.strip()).lower()] = unquote(value.strip())
    return out


@dataclass
class Upstream:
    """One signal's upstream endpoint, as the SDK exporter resolves it from the environment."""

    signal: str
    protocol: str
    """``grpc``, ``http/protobuf`` or ``http/json``."""
    endpoint: str
    """The URL (for HTTP the full per-signal URL)."""
    headers: dict[str, str] = field(repr=False, default_factory=dict)
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None
    insecure: bool | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    gzip: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str], signal: str) -> Upstream:
        """The upstream of ``signal`` from the variables the workers would have been given."""
        protocol = (_var(env, signal, "PROTOCOL") or "grpc").lower()
        specific = env.get(ec.otlp_var("ENDPOINT", signal), "").strip()
        base = env.get(ec.OTLP_ENDPOINT, "").strip()
        kind = "grpc" if protocol == "grpc" else "http"
        if specific:
            endpoint = specific
        elif kind == "grpc":
            endpoint = base or _DEFAULT_ENDPOINTS["grpc"]
        else:
            endpoint = (base or _DEFAULT_ENDPOINTS["http"]).rstrip("/") + f"/v1/{signal}"
        insecure = _var(env, signal, "INSECURE")
        try:
            timeout = float(_var(env, signal, "TIMEOUT") or DEFAULT_TIMEOUT_S)
        except ValueError:
            timeout = DEFAULT_TIMEOUT_S
        return cls(
            signal=signal,
            protocol=protocol,
            endpoint=endpoint,
            headers=_headers(_var(env, signal, "HEADERS")),
            certificate=_var(env, signal, "CERTIFICATE"),
            client_key=_var(env, signal, "CLIENT_KEY"),
            client_certificate=_var(env, signal, "CLIENT_CERTIFICATE"),
            insecure=None if insecure is None else insecure.lower() == "true",
            timeout_s=timeout if timeout > 0 else DEFAULT_TIMEOUT_S,
            gzip=(_var(env, signal, "COMPRESSION") or "").lower() == "gzip",
        )

    def describe(self) -> str:
        """For messages: protocol and endpoint (never the headers)."""
        return f"{self.protocol} {redact(self.endpoint)}"


class Sender:
    """Sends serialized export requests of one signal upstream; raises OSError on failure."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.signal: Signal = SIGNALS[upstream.signal]
        self._channel: Any = None
        self._call: Any = None
        self._ssl: ssl.SSLContext | None = None
        self._conn: http.client.HTTPConnection | None = None

    def _grpc_call(self) -> Any:
        if self._call is None:
            u = self.upstream
            parts = urlsplit(u.endpoint if "://" in u.endpoint else f"http://{u.endpoint}")
            target = f"{bracket(parts.hostname or 'localhost')}:{parts.port or 4317}"
            self._channel = otlp_send.grpc_channel(
                target,
                tls=otlp_send.grpc_tls(parts.scheme, u.insecure),
                certificate=u.certificate,
                client_key=u.client_key,
                client_certificate=u.client_certificate,
                options=[("grpc.max_send_message_length", otlp_send.RELAY_MAX_SEND_BYTES)],
            )
            # Raw bytes both ways: what the worker sent goes out unchanged, unparsed.
            self._call = otlp_send.grpc_unary(self._channel, f"/{self.signal.service}/Export")
        return self._call

    def send(self, body: bytes, timeout_s: float) -> None:
        """Deliver one serialized request within ``timeout_s`` seconds, or raise OSError."""
        u = self.upstream
        timeout_s = otlp_send.deadline(timeout_s, u.timeout_s)
        if u.protocol == "grpc":
            import grpc

            metadata = otlp_send.grpc_metadata(u.headers)
            try:
                self._grpc_call()(
                    body, timeout=timeout_s, metadata=metadata,
                    compression=grpc.Compression.Gzip if u.gzip else None,
                )  # fmt: skip
            except grpc.RpcError as exc:
                # A fresh channel next time: one that failed to connect would otherwise wait out
                # gRPC's reconnect backoff after the collector is back.
                self.close()
                raise OSError(f"gRPC {exc.code().name}") from None
            return
        content_type = "application/x-protobuf"
        if u.protocol == "http/json":
            import json

            content_type = "application/json"
            body = json.dumps(self.signal.to_json(self.signal.parse(body))).encode()
        headers = {**u.headers, "Content-Type": content_type}
        if u.gzip:
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        parts = urlsplit(u.endpoint)
        # http.client rather than urllib: the connection is at hand, so abort() can cut a call
        # that an unresponsive collector would otherwise hold for the whole timeout.
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=timeout_s, context=self._context()
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
        self._conn = conn
        try:
            conn.request("POST", parts.path or "/", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            if not 200 <= resp.status < 300:
                raise OSError(f"HTTP {resp.status}")
        except (http.client.HTTPException, TimeoutError, ConnectionError, ssl.SSLError) as exc:
            raise OSError(str(exc) or type(exc).__name__) from None
        finally:
            self._conn = None
            conn.close()

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            u = self.upstream
            self._ssl = otlp_send.ssl_context(u.certificate, u.client_certificate, u.client_key)
        return self._ssl

    def abort(self) -> None:
        """End a call in flight now (from another thread): it fails, and its data is spooled."""
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        self.close()

    def close(self) -> None:
        """Release the channel (in-flight calls end with an error)."""
        channel, self._channel, self._call = self._channel, None, None
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close()
