"""``mlaunch trace replay``: send a run's spool (the spans and metrics its exporter could not
deliver) to an OTLP collector later.

Each spool line is one OTLP/JSON export request (:mod:`mlaunch.otlp.otlp_json`); it goes out
as the same request in OTLP protobuf, over gRPC or HTTP/protobuf, with no SDK in between. What was
sent is recorded in ``telemetry/replayed.json`` (per spool file, the byte offset up to which every
line was delivered), written after each delivered line, so a replay that is interrupted or meets a
dead collector resumes where it stopped and a second replay sends nothing twice. The spool files
themselves stay where they are: ``mlaunch trace summary RUN_DIR`` keeps reading them.

A lock file keeps two replays of one run directory from sending the same lines at once.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import urllib.error
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from mlaunch.endpoints import DEFAULT_PORTS, Endpoint, EndpointError, parse_endpoint
from mlaunch.otlp import otlp_json
from mlaunch.otlp import send as otlp_send
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import Busy, locked, write_atomic

PROTOCOLS = ("grpc", "http/protobuf")


class ReplayInputError(Exception):
    """Bad input (run directory, endpoint, headers): the CLI exits 2 with this message."""


@dataclass
class ReplayResult:
    """What one replay did."""

    endpoint: str
    protocol: str
    spans_sent: int = 0
    metric_batches_sent: int = 0
    requests_sent: int = 0
    spans_failed: int = 0
    """Spans not delivered this time (kept for the next replay)."""
    metric_batches_failed: int = 0
    log_batches_sent: int = 0
    """Log export requests delivered (the launcher's receiver spools workers' OTLP logs)."""
    log_batches_failed: int = 0
    spans_already_sent: int = 0
    """Spans earlier replays delivered (skipped now)."""
    malformed_lines: int = 0
    """Complete lines that do not decode (skipped for good, reported)."""
    error: str | None = None
    """Why sending stopped, when it did."""
    exporter: str | None = None
    """The exporter the run used (from its resolved.json; None when unknown)."""
    files: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether anything could not be delivered."""
        return bool(self.spans_failed or self.metric_batches_failed or self.log_batches_failed)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def check_endpoint(endpoint: str, protocol: str) -> Endpoint:
    """The parsed OTLP endpoint (:func:`mlaunch.endpoints.parse_endpoint`, the parser ``train`` and
    ``doctor`` use); ReplayInputError (credentials never shown) when it is not usable."""
    if protocol not in PROTOCOLS:
        raise ReplayInputError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    try:
        return parse_endpoint(endpoint, protocol)
    except EndpointError as exc:
        raise ReplayInputError(f"--endpoint: {exc}") from None


def run_exporter(run_dir: Path) -> str | None:
    """The exporter the run used (``telemetry.exporter`` in its resolved.json), None if unknown."""
    try:
        data = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text())
        value = data["settings"]["telemetry.exporter"]["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def parse_headers(text: str | None) -> dict[str, str]:
    """``k1=v1,k2=v2`` (the OTEL_EXPORTER_OTLP_HEADERS format: percent-encoded) as a dict."""
    out: dict[str, str] = {}
    for n, part in enumerate((text or "").split(","), 1):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            # Named by position only: the entry may hold the token itself ("Authorization: ...").
            raise ReplayInputError(
                f"header entry #{n} is not KEY=VALUE (not shown: a secret);"
                " e.g. --headers x-api-key=SECRET"
            )
        # Percent-decoded, as the exporter decodes OTEL_EXPORTER_OTLP_HEADERS (Bearer%20TOKEN).
        out[unquote(key.strip()).lower()] = unquote(value.strip())
    return out


def spool_files(run_dir: Path) -> list[Path]:
    """The run's spool files, traces before metrics, by rank; ReplayInputError when ``run_dir`` is
    not a run directory."""
    if not run_dir.exists():
        raise ReplayInputError(
            f"{run_dir}: no such directory; give a run directory (runs/<run_id>)"
        )
    if not run_dir.is_dir():
        raise ReplayInputError(f"{run_dir}: not a directory; give a run directory (runs/<run_id>)")
    telemetry_dir = run_dir / lay.TELEMETRY_DIR
    if not telemetry_dir.is_dir():
        raise ReplayInputError(
            f"{run_dir}: not an mlaunch run directory (no {lay.TELEMETRY_DIR}/ folder); "
            "give the directory `mlaunch train` printed as 'run dir'"
        )
    # Spool files: per rank (a worker's or the launcher's receiver), unranked (the receiver got
    # them without dl.rank) and per launcher node (the launcher's own job trace, relayed).
    found = [
        (named, p)
        for p in telemetry_dir.iterdir()
        if (named := lay.parse_telemetry_file(p.name)) is not None and named.spool and p.is_file()
    ]
    found.sort(
        key=lambda np: (
            lay.SIGNALS.index(np[0].signal),
            np[0].rank if np[0].rank is not None else 1 << 62,
            np[1].name,
        )
    )
    return [p for _, p in found]


# --------------------------------------------------------------------------------------------
# Senders: one OTLP export request in, raise on failure.

Sender = Callable[[str, Any], None]


def _grpc_sender(
    ep: Endpoint, headers: Mapping[str, str], timeout_s: float
) -> tuple[Sender, Callable[[], None]]:
    otlp_send.quiet_grpc()  # the failure is reported once, here
    import grpc

    # An IPv6 literal keeps its brackets. The system's roots verify TLS: replay has never read
    # OTEL_EXPORTER_OTLP_CERTIFICATE.
    channel = otlp_send.grpc_channel(ep.hostport, tls=otlp_send.grpc_tls(ep.scheme))
    calls = {
        signal: otlp_send.grpc_unary(channel, method)
        for signal, method in otlp_send.EXPORT_METHODS.items()
    }
    metadata = otlp_send.grpc_metadata(headers)

    def send(signal: str, request: Any) -> None:
        try:
            calls[signal](request.SerializeToString(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise OSError(_grpc_problem(ep, exc.code().name, str(exc.details()))) from None

    return send, channel.close


def _grpc_problem(ep: Endpoint, code: str, details: str) -> str:
    """A gRPC failure in words; an HTTP/1.x peer (an OTLP/HTTP receiver) is named as the wrong
    protocol rather than shown as gRPC's transport detail."""
    low = details.lower()
    http1 = ("http1" in low or "http/1" in low or "bad_http" in low or "http2 header" in low
             or "malformed" in low or "protocol error" in low or "frame" in low)  # fmt: skip
    if code in ("UNAVAILABLE", "INTERNAL", "UNIMPLEMENTED", "UNKNOWN") and http1:
        return (
            f"{ep.shown} does not speak gRPC (it answered like an HTTP/1.x server, e.g. an "
            f"OTLP/HTTP receiver): protocol mismatch; use --protocol http/protobuf"
            f" (port {DEFAULT_PORTS['http/protobuf']} by convention), or the collector's gRPC port"
        )
    return f"gRPC {code}: {details}"


def _wrong_protocol_http(ep: Endpoint) -> str:
    return (
        f"{ep.shown} does not speak HTTP/1.1 (it answered with HTTP/2 frames, like a gRPC "
        f"receiver): protocol mismatch; use --protocol grpc"
        f" (port {DEFAULT_PORTS['grpc']} by convention), or the collector's HTTP port"
    )


def _http_sender(
    ep: Endpoint, headers: Mapping[str, str], timeout_s: float
) -> tuple[Sender, Callable[[], None]]:
    extra = dict(headers)
    if ep.userinfo and "authorization" not in extra:
        # Credentials in the URL become Basic auth (urllib would not send them, and they must
        # never appear in the URL we print).
        extra["Authorization"] = "Basic " + base64.b64encode(ep.userinfo.encode()).decode()

    def send(signal: str, request: Any) -> None:
        try:
            otlp_send.http_post(
                f"{ep.base}/v1/{signal}", request.SerializeToString(),
                {"Content-Type": "application/x-protobuf", **extra}, timeout_s,
            )  # fmt: skip
        except urllib.error.HTTPError as exc:
            raise OSError(f"HTTP {exc.code} {exc.reason}") from None
        except http.client.HTTPException:
            # BadStatusLine / RemoteDisconnected: an HTTP/2-only (gRPC) server; its raw
            # frames are never shown.
            raise OSError(_wrong_protocol_http(ep)) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, http.client.HTTPException):
                raise OSError(_wrong_protocol_http(ep)) from None
            raise OSError(f"cannot reach {ep.shown}: {reason}") from None

    return send, lambda: None


# --------------------------------------------------------------------------------------------
# The ledger


def _read_ledger(path: Path) -> dict[str, dict[str, int]]:
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        return {
            str(k): {"offset": int(v["offset"]), "spans": int(v.get("spans", 0))}
            for k, v in files.items()
        }
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReplayInputError(
            f"{path}: unreadable replay record ({exc}); it says what was already sent, so fix or "
            "remove it knowing that removing it sends everything again"
        ) from None


def _write_ledger(path: Path, ledger: Mapping[str, Mapping[str, int]]) -> None:
    write_atomic(path, json.dumps({"files": ledger}, indent=1, sort_keys=True))


@contextlib.contextmanager
def _exclusive(telemetry_dir: Path) -> Iterator[None]:
    try:
        with locked(telemetry_dir / lay.REPLAY_LOCK_FILE, blocking=False):
            yield
    except Busy:
        raise ReplayInputError(
            f"{telemetry_dir.parent}: another `mlaunch trace replay` of this run is in progress; "
            "wait for it to finish"
        ) from None


def _complete_lines(path: Path, offset: int) -> Iterator[tuple[int, bytes]]:
    """(end offset, line) for each complete line from ``offset`` (a last line a writer is still
    appending, without its newline, waits for a later replay)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        pos = offset
        for raw in fh:
            if not raw.endswith(b"\n"):
                return
            pos += len(raw)
            yield pos, raw


def _decode(signal: str, raw: bytes) -> Any:
    """One spool line as the export request it was."""
    if signal == "traces":
        return otlp_json.decode_traces_line(raw.decode("utf-8"))
    if signal == "metrics":
        return otlp_json.decode_metrics_line(raw.decode("utf-8"))
    from mlaunch.receiver.signals import LOGS

    return LOGS.from_json(json.loads(raw))


def _count(signal: str, request: Any) -> int:
    if signal == "traces":
        return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    return 1


def replay(
    run_dir: str | Path,
    endpoint: str,
    *,
    protocol: str = "grpc",
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 10.0,
    sender: tuple[Sender, Callable[[], None]] | None = None,
) -> ReplayResult:
    """Send every spool line not yet delivered to ``endpoint``; record each delivery at once.

    Stops at the first failed request (the collector is down or refusing: later requests would
    fail the same way, each after a timeout) and counts everything unsent as failed.
    """
    run_dir = Path(run_dir)
    ep = check_endpoint(endpoint, protocol)
    files = spool_files(run_dir)
    result = ReplayResult(
        endpoint=ep.shown, protocol=protocol, files=[str(p) for p in files],
        exporter=run_exporter(run_dir),
    )  # fmt: skip
    telemetry_dir = run_dir / lay.TELEMETRY_DIR
    ledger_path = telemetry_dir / lay.REPLAY_LEDGER_FILE
    with _exclusive(telemetry_dir):
        ledger = _read_ledger(ledger_path)
        if sender is None:
            sender = (
                _grpc_sender(ep, headers or {}, timeout_s) if protocol == "grpc"
                else _http_sender(ep, headers or {}, timeout_s)
            )  # fmt: skip
        send, close = sender
        try:
            for path in files:
                signal = lay.parse_telemetry_file(path.name).signal  # type: ignore[union-attr]
                entry = ledger.setdefault(path.name, {"offset": 0, "spans": 0})
                if path.stat().st_size < entry["offset"]:  # replaced by a new, shorter file
                    entry.update(offset=0, spans=0)
                if signal == "traces":
                    result.spans_already_sent += entry["spans"]
                for end, raw in _complete_lines(path, entry["offset"]):
                    try:
                        request = _decode(signal, raw)
                    except Exception:
                        result.malformed_lines += 1
                        entry["offset"] = end
                        _write_ledger(ledger_path, ledger)
                        continue
                    n = _count(signal, request)
                    if result.error is None:
                        try:
                            send(signal, request)
                        except Exception as exc:
                            result.error = f"{path.name}: {exc}"
                    if result.error is not None:
                        if signal == "traces":
                            result.spans_failed += n
                        elif signal == "logs":
                            result.log_batches_failed += n
                        else:
                            result.metric_batches_failed += n
                        continue
                    result.requests_sent += 1
                    if signal == "traces":
                        result.spans_sent += n
                        entry["spans"] += n
                    elif signal == "logs":
                        result.log_batches_sent += n
                    else:
                        result.metric_batches_sent += n
                    entry["offset"] = end
                    _write_ledger(ledger_path, ledger)
        finally:
            with contextlib.suppress(Exception):
                close()
    return result
