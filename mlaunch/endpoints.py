"""One parser for OTLP endpoint URLs, shared by ``train`` settings, ``doctor``, ``trace replay`` and
the embedded receiver's upstream (stdlib only: every command may import it).

Rules, the same everywhere:

* ``http://`` or ``https://`` and a host; a port in 1..65535 when given (otherwise the protocol's
  default: 4317 for gRPC, 4318 for HTTP/protobuf).
* IPv6 literals keep their brackets in ``host:port`` (``[::1]:4318``): gRPC targets and the
  HTTP ``Host`` need them; :attr:`Endpoint.host` is the bare address for sockets.
* Credentials in the URL (``user:pass@host``) are accepted but never shown: :attr:`Endpoint.shown`
  and every error message carry the URL with the user info replaced by ``***``.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import SplitResult, unquote, urlsplit

#: Default OTLP ports by protocol (the OTel exporter defaults).
DEFAULT_PORTS = {"grpc": 4317, "http/protobuf": 4318}


class EndpointError(ValueError):
    """An endpoint that is not a usable ``http(s)://host[:port]`` URL (message is user-facing and
    already redacted)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed OTLP endpoint."""

    scheme: str
    host: str
    """The bare host (an IPv6 literal without brackets)."""
    port: int
    path: str
    """The path without a trailing slash ('' for none)."""
    userinfo: str = dataclasses.field(default="", repr=False)
    """``user[:password]`` from the URL, percent-decoded ('' for none; never shown)."""

    @property
    def tls(self) -> bool:
        """Whether the endpoint is ``https``."""
        return self.scheme == "https"

    @property
    def hostport(self) -> str:
        """``host:port`` with an IPv6 literal in brackets (a gRPC target, an HTTP Host)."""
        return f"{bracket(self.host)}:{self.port}"

    @property
    def base(self) -> str:
        """The URL without credentials, with the resolved port, no trailing slash."""
        return f"{self.scheme}://{self.hostport}{self.path}"

    @property
    def shown(self) -> str:
        """The URL as messages show it (credentials never)."""
        return self.base


def bracket(host: str) -> str:
    """``host`` as it goes before ``:port`` (an IPv6 literal in brackets)."""
    return f"[{host}]" if ":" in host else host


def redact(url: str) -> str:
    """``url`` with any ``user:pass@`` replaced by ``***@`` (for messages; never fails)."""
    text = str(url).strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}://{netloc}{slash}{tail}"


def parse_endpoint(
    url: str, protocol: str = "grpc", *, default_port: int | None = None
) -> Endpoint:
    """``url`` as an :class:`Endpoint`; :class:`EndpointError` (redacted message) when it is not
    an ``http(s)://host[:port]`` URL. ``protocol`` picks the default port."""
    text = str(url).strip()
    shown = redact(text)
    port_default = default_port or DEFAULT_PORTS.get(protocol, 4317)
    example = f"e.g. http://localhost:{port_default}"
    try:
        parts: SplitResult = urlsplit(text)
        host = parts.hostname
    except ValueError as exc:  # e.g. an unclosed '[' ("Invalid IPv6 URL")
        raise EndpointError(f"{shown!r} is not a valid URL ({exc}); {example}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise EndpointError(f"{shown!r} is not an http(s) URL with a host, {example}")
    try:
        port = parts.port
    except ValueError:
        raise EndpointError(f"{shown!r} has an invalid port (1-65535), {example}") from None
    if port == 0:
        raise EndpointError(f"{shown!r} has an invalid port (1-65535), {example}")
    if " " in host or any(c in host for c in '<>"{}|\\^`'):
        raise EndpointError(f"{shown!r} has an invalid host, {example}")
    return Endpoint(
        scheme=parts.scheme,
        host=host,
        port=port or port_default,
        path=parts.path.rstrip("/"),
        userinfo=unquote(parts.netloc.rpartition("@")[0]),
    )
