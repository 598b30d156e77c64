"""The embedded receiver's core: a bounded queue between the request handlers and one writer
thread, the per-rank files, the relay with its spool, the counts, and a bounded close.

Handlers never parse or write: they check the queue's byte budget, enqueue the raw request and
answer. When the budget is full the request is refused with a retryable status (gRPC
``RESOURCE_EXHAUSTED`` with a ``RetryInfo`` of :data:`RETRY_AFTER_S`, HTTP 429 with
``Retry-After``): the worker's exporter keeps the batch and sends it again after the pause, on
its own export thread, so training never waits and a burst loses nothing; each refusal is counted
(``rejected_requests`` / ``rejected_bytes``) and logged once. Replying success and dropping would
lose data the worker still held.

The writer thread parses each request, splits it by the resource attribute ``dl.rank`` and
appends one OTLP/JSON line per rank (the file exporter's format) to
``telemetry/{traces,metrics,logs}-rank{R}.jsonl`` (``-unranked`` without ``dl.rank``). In relay
mode it forwards the request's bytes upstream instead, and spools what cannot be delivered into
``telemetry/spool-{signal}-rank{R}.jsonl`` (the format ``mlaunch trace replay`` sends). After a
failed delivery requests go straight to the spool for a backoff period (1 s doubling to 30 s),
so a dead collector costs one timeout per period, not one per request.

Only the job's own workers get in: every gRPC call and HTTP request must carry the launch's token
(``authorization: Bearer <token>``, a fresh random one per receiver, handed to the workers in
their environment only); one without it, or with a wrong one, is refused (gRPC
``UNAUTHENTICATED``, HTTP 401) before anything is queued, counted (``unauthenticated_requests``)
and logged once. The comparison is constant-time. The listeners are on loopback, so this is what
keeps other users of a shared node from forging or flooding the job's telemetry.

Nothing here ever raises into the launcher: a failure of the receiver's own (a port, a full disk,
a malformed request) is logged once and counted, and training goes on.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from mlaunch import envcontract
from mlaunch.model.spans import STEP_SPAN, Attr, ResourceAttr

# The frontends' limits, under the names the receiver has always given them.
from mlaunch.receiver.limits import MAX_REQUEST_BYTES, RETRY_AFTER_S  # noqa: F401
from mlaunch.receiver.signals import SIGNALS, Signal
from mlaunch.receiver.store_append import StoreAppender
from mlaunch.receiver.upstream import Sender, Upstream
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json

#: The queue's budget in request bytes (serialized protobuf); beyond it requests are refused.
MAX_QUEUED_BYTES = 64 * 1024 * 1024
#: Open files are flushed at least this often (a killed launcher loses at most this much).
FLUSH_INTERVAL_S = 0.5
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
#: The default deadline of :meth:`Receiver.close`.
CLOSE_DEADLINE_S = 5.0
#: Extra time :meth:`Receiver.close` gives the writer to write (or spool) a full queue to local
#: disk once the upstream, if any, is cut (no network involved; about 3 s for a full 64 MiB queue
#: on one core).
LOCAL_DRAIN_S = 25.0


@dataclass
class SignalCounts:
    """What happened to one signal's data (items = spans, metric data points, log records)."""

    received_requests: int = 0
    received_bytes: int = 0
    received_items: int = 0
    """Items in requests the writer parsed (accepted requests)."""
    rejected_requests: int = 0
    """Refused because the queue was full (the client was told to retry)."""
    rejected_bytes: int = 0
    unauthenticated_requests: int = 0
    """Refused for a missing or wrong token (not the job's workers): nothing of them kept."""
    malformed_requests: int = 0
    """Accepted but undecodable (dropped, counted)."""
    written_items: int = 0
    """Written to the run directory's per-rank files (embedded mode)."""
    unranked_items: int = 0
    """Of those, without ``dl.rank`` (written to the ``-unranked`` file)."""
    forwarded_items: int = 0
    """Delivered upstream (relay mode)."""
    spooled_items: int = 0
    """Not delivered upstream, kept in the spool for ``mlaunch trace replay`` (relay mode)."""
    lost_items: int = 0
    """Could not be written or spooled (a disk error): the only data loss, logged."""


@dataclass
class ReceiverStats:
    """The receiver's counts, written to ``telemetry/receiver-node{N}.json`` on close."""

    mode: str
    grpc_endpoint: str | None = None
    http_endpoint: str | None = None
    upstream: dict[str, str] = field(default_factory=dict)
    """Relay mode: per signal, protocol and endpoint (never the headers)."""
    signals: dict[str, SignalCounts] = field(
        default_factory=lambda: {name: SignalCounts() for name in SIGNALS}
    )
    authenticated: bool = True
    """Whether the listeners required the launch's token (always, from ``mlaunch train``)."""
    peak_queued_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    """Each distinct problem, once."""
    closed_in_s: float | None = None
    unsent_at_deadline: int = 0
    """Requests still queued when the close deadline passed (spooled or written without retry)."""
    store_appends: int = 0
    """Embedded mode: appends of the run's span store made while the run went on."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class _Item:
    __slots__ = ("signal", "payload", "nbytes", "local")

    def __init__(self, signal: Signal, payload: Any, nbytes: int, local: Path | None) -> None:
        self.signal = signal
        self.payload = payload  # serialized protobuf (bytes) or an already parsed request
        self.nbytes = nbytes
        self.local = local


_STEP_SPAN = STEP_SPAN
_ITERATION_ATTR = Attr.ITERATION.value


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe: it travels in an OTLP headers variable)."""
    return secrets.token_urlsafe(32)


def _rank_of(resource: Any) -> int | None:
    for kv in resource.attributes:
        if kv.key == ResourceAttr.RANK:
            v = kv.value
            kind = v.WhichOneof("value")
            if kind == "int_value":
                return int(v.int_value)
            if kind == "string_value" and v.string_value.strip().isdigit():
                return int(v.string_value)
            return None
    return None


def split_by_rank(signal: Signal, request: Any) -> dict[int | None, Any]:
    """The request's resources grouped by ``dl.rank`` (the request itself when one rank)."""
    resources = getattr(request, signal.resources_field)
    ranks = [_rank_of(r.resource) for r in resources]
    if len(set(ranks)) <= 1:
        return {ranks[0] if ranks else None: request}
    out: dict[int | None, Any] = {}
    for rank, res in zip(ranks, resources, strict=True):
        part = out.setdefault(rank, signal.request_type())
        getattr(part, signal.resources_field).add().CopyFrom(res)
    return out


class Receiver:
    """The launcher's OTLP receiver: accepts requests, writes (embedded) or relays them.

    ``relay``: per signal name, where to forward (``None`` = embedded mode: write locally).
    Start the network frontends with :meth:`start` (see :mod:`mlaunch.receiver.frontends`); the
    in-process API (:meth:`ingest_traces`, :meth:`ingest_metrics`) needs no network.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        relay: Mapping[str, Upstream] | None = None,
        node_rank: int = 0,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        log: Callable[[str], None] | None = None,
        token: str | None = None,
        store_min_bytes: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        # The per-launch secret every request must carry; never logged, written or put in stats.
        self._token = token or new_token()
        self._expected = f"Bearer {self._token}".encode()
        self.node_rank = node_rank
        self.max_queued_bytes = max_queued_bytes
        self._senders = {name: Sender(u) for name, u in (relay or {}).items()}
        self.stats = ReceiverStats(mode="relay" if relay else "embedded")
        self.stats.upstream = {name: u.describe() for name, u in (relay or {}).items()}
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[_Item] = deque()
        self._queued_bytes = 0
        #: Iteration spans seen, for the hang watchdog (bounded: an unread deque cannot grow).
        self._iterations: deque[tuple[int | None, int, int, int]] = deque(maxlen=4096)
        self._closing = False
        self._done = False  # the writer has stopped: nothing more can be accepted
        self._deadline: float | None = None
        self._files: dict[Path, IO[bytes]] = {}
        self._dirty = False
        self._down_until: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._frontends: list[Any] = []
        # Embedded mode with ``store_min_bytes``: the span store is appended as the trace
        # files grow (mlaunch.receiver.store_append), after that many bytes at first.
        self._store: StoreAppender | None = None
        if store_min_bytes is not None and not relay:
            self._store = StoreAppender(self.run_dir, self.problem, min_bytes=store_min_bytes)
        self._thread = threading.Thread(target=self._run, name="mlaunch-receiver", daemon=True)
        self._thread.start()

    # ---- frontends ----------------------------------------------------------------------

    def start(self, *, grpc: bool = True, http: bool = True) -> Receiver:
        """Listen on 127.0.0.1 (ephemeral ports). A frontend that cannot start is logged once and
        left out; see :attr:`grpc_endpoint` / :attr:`http_endpoint` for what is up."""
        from mlaunch.receiver import frontends

        if grpc:
            self.stats.grpc_endpoint = self._listen("grpc", "OTLP/gRPC", frontends.GrpcFrontend)
        if http:
            self.stats.http_endpoint = self._listen("http", "OTLP/HTTP", frontends.HttpFrontend)
        return self

    def _listen(self, kind: str, label: str, frontend: Callable[[Receiver], Any]) -> str | None:
        """Start one frontend: its endpoint, or None (the problem logged once) if it cannot start."""
        try:
            fe = frontend(self)
        except Exception as exc:
            self.problem(kind, f"cannot start the {label} listener ({exc})")
            return None
        self._frontends.append(fe)
        return fe.endpoint

    @property
    def grpc_endpoint(self) -> str | None:
        """``http://127.0.0.1:PORT`` of the gRPC listener, if it is up."""
        return self.stats.grpc_endpoint

    @property
    def http_endpoint(self) -> str | None:
        """``http://127.0.0.1:PORT`` (the OTLP/HTTP base URL) of the HTTP listener, if up."""
        return self.stats.http_endpoint

    @property
    def token(self) -> str:
        """The token clients must send (for the workers' environment only: a secret)."""
        return self._token

    @property
    def client_headers(self) -> dict[str, str]:
        """The headers (gRPC metadata) a client sends to be let in (a secret, as :attr:`token`)."""
        return {envcontract.RECEIVER_AUTH_HEADER: f"Bearer {self._token}"}

    def authorized(self, value: str | bytes | None) -> bool:
        """Whether an ``authorization`` header/metadata value is ``Bearer <this token>``, compared
        in constant time (a timing side channel must not leak the token byte by byte)."""
        if value is None:
            return False
        given = value.encode("latin-1", "replace") if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(given, self._expected)

    def unauthenticated(self, signal: str) -> None:
        """Count (and log once) a request refused for a missing or wrong token."""
        with self._lock:
            self.stats.signals[signal].unauthenticated_requests += 1
        self.problem(
            "unauthenticated",
            "refused a request without this job's token (not one of its workers; counted in"
            f" {lay.receiver_stats_file(self.run_dir, self.node_rank).name})",
        )

    # ---- intake -------------------------------------------------------------------------

    def submit(self, signal: str, payload: Any, nbytes: int, local: Path | None = None) -> bool:
        """Queue one request (serialized protobuf, or a request message); False when the queue's
        byte budget is full (the caller answers "retry later"). Never blocks."""
        sig = SIGNALS[signal]
        counts = self.stats.signals[signal]
        with self._cond:
            if self._done or (
                self._closing and self._deadline is not None and time.monotonic() > self._deadline
            ):
                accept = False
            else:
                accept = (
                    self._queued_bytes + nbytes <= self.max_queued_bytes or not self._queued_bytes
                )
            if not accept:
                self._count_refusal(counts, nbytes)
            else:
                counts.received_requests += 1
                counts.received_bytes += nbytes
                self._queue.append(_Item(sig, payload, nbytes, local))
                self._queued_bytes += nbytes
                self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, self._queued_bytes)
                self._cond.notify()
        if not accept:
            self._say_full()
        return accept

    def refuse(self, signal: str, nbytes: int) -> None:
        """Count (and log once) a request refused before it was read (see :meth:`has_room`)."""
        with self._lock:
            self._count_refusal(self.stats.signals[signal], nbytes)
        self._say_full()

    @staticmethod
    def _count_refusal(counts: SignalCounts, nbytes: int) -> None:
        counts.rejected_requests += 1
        counts.rejected_bytes += nbytes

    def _say_full(self) -> None:
        self.problem(
            "full",
            f"queue full ({self.max_queued_bytes // 2**20} MiB): asking workers to retry"
            f" (counted in {lay.receiver_stats_file(self.run_dir, self.node_rank).name})",
        )

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` would be queued now (lets the HTTP frontend refuse a
        body before reading it into memory)."""
        with self._lock:
            return self._queued_bytes + nbytes <= self.max_queued_bytes or not self._queued_bytes

    def ingest_traces(self, request: Any, *, local_file: Path | None = None) -> bool:
        """In-process API: an ``ExportTraceServiceRequest`` through the same path as a worker's
        (written per ``dl.rank``, or relayed and spooled). ``local_file``: write (embedded) or
        spool next to (relay: ``spool-<name>``) this file instead of the rank's. Never blocks;
        False when refused (queue full or closed)."""
        return self.submit("traces", request, request.ByteSize(), local_file)

    def ingest_metrics(self, request: Any, *, local_file: Path | None = None) -> bool:
        """In-process API for an ``ExportMetricsServiceRequest`` (see :meth:`ingest_traces`)."""
        return self.submit("metrics", request, request.ByteSize(), local_file)

    def malformed(self, signal: str, message: str) -> None:
        """Count an undecodable request (from a handler or the writer) and log it once."""
        with self._lock:
            self.stats.signals[signal].malformed_requests += 1
        self.problem("malformed", message)

    def problem(self, key: str, message: str) -> None:
        """Log a problem of the receiver's own once (and keep it for the stats file)."""
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
            self.stats.errors.append(message)
        with contextlib.suppress(Exception):
            self._log(f"mlaunch: OTLP receiver: {message}")

    # ---- the writer thread --------------------------------------------------------------

    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    timeout = FLUSH_INTERVAL_S if self._dirty else None
                    if not self._cond.wait(timeout) and self._dirty:
                        break
                if not self._queue and self._closing:
                    self._done = True
                    break
                item = self._queue.popleft() if self._queue else None
            if item is not None:
                try:
                    self._handle(item)
                except Exception as exc:  # never let one request kill the writer
                    self.problem("handle", f"internal error handling a request ({exc!r})")
                finally:
                    with self._cond:
                        self._queued_bytes -= item.nbytes
            now = time.monotonic()
            if self._dirty and (item is None or now - last_flush >= FLUSH_INTERVAL_S):
                self._flush()
                last_flush = now
        self._flush()

    def _handle(self, item: _Item) -> None:
        sig = item.signal
        counts = self.stats.signals[sig.name]
        try:
            request = sig.parse(item.payload)
        except Exception:
            self.malformed(sig.name, f"dropped an undecodable {sig.name} request (counted)")
            return
        n = sig.items(request)
        counts.received_items += n
        if sig.name == "traces":
            self._note_iterations(request)
        if sig.name in self._senders:
            if self._forward(sig, item, request):
                counts.forwarded_items += n
                return
            self._write(sig, request, item.local, spool=True)
            return
        self._write(sig, request, item.local, spool=False)

    def _note_iterations(self, request: Any) -> None:
        """Keep the ``megatron.train.iteration`` spans a request carries (rank, iteration, start,
        end): the launcher's hang watchdog reads them as Megatron-LM workers' progress."""
        for rs in request.resource_spans:
            rank = None
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.name != _STEP_SPAN:
                        continue
                    if rank is None:
                        rank = _rank_of(rs.resource)
                    iteration = next(
                        (int(kv.value.int_value) for kv in span.attributes
                         if kv.key == _ITERATION_ATTR), None,
                    )  # fmt: skip
                    if iteration is not None:
                        self._iterations.append(
                            (rank, iteration, span.start_time_unix_nano, span.end_time_unix_nano)
                        )

    def take_iterations(self) -> list[tuple[int | None, int, int, int]]:
        """The iteration spans seen since the last call (rank, iteration, start_ns, end_ns)."""
        out = []
        while self._iterations:
            out.append(self._iterations.popleft())
        return out

    def _forward(self, sig: Signal, item: _Item, request: Any) -> bool:
        now = time.monotonic()
        if self._down_until.get(sig.name, 0.0) > now:
            return False
        budget = None
        if self._deadline is not None:
            budget = self._deadline - now
            if budget <= 0.05:
                return False
        sender = self._senders[sig.name]
        body = item.payload if isinstance(item.payload, bytes) else request.SerializeToString()
        try:
            sender.send(body, budget if budget is not None else sender.upstream.timeout_s)
        except Exception as exc:
            backoff = self._backoff.get(sig.name, FIRST_BACKOFF_S / 2) * 2
            self._backoff[sig.name] = min(backoff, MAX_BACKOFF_S)
            self._down_until[sig.name] = time.monotonic() + self._backoff[sig.name]
            self.problem(
                f"upstream-{sig.name}",
                f"cannot deliver {sig.name} to {sender.upstream.describe()} ({exc}); spooling to"
                f" {lay.TELEMETRY_DIR}/spool-{sig.name}-*.jsonl (send later with"
                " `mlaunch trace replay`)",
            )
            return False
        self._backoff.pop(sig.name, None)
        return True

    def _write(self, sig: Signal, request: Any, local: Path | None, *, spool: bool) -> None:
        counts = self.stats.signals[sig.name]
        parts = {None: request} if local is not None else split_by_rank(sig, request)
        for rank, part in parts.items():
            n = sig.items(part)
            if local is not None:
                path = lay.spooled(local) if spool else local
            elif spool:
                path = lay.spool_file(self.run_dir, rank, sig.name)
            else:
                path = lay.received_file(self.run_dir, sig.name, rank)
            try:
                line = json.dumps(sig.to_json(part), separators=(",", ":")).encode() + b"\n"
                fh = self._files.get(path)
                if fh is None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fh = self._files[path] = open(path, "ab")  # noqa: SIM115 - kept open
                fh.write(line)
                self._dirty = True
                if self._store is not None and sig.name == "traces" and not spool:
                    self._store.note(len(line))
            except Exception as exc:
                counts.lost_items += n
                with contextlib.suppress(Exception):
                    self._files.pop(path).close()  # reopened (and retried) for the next request
                self.problem(f"write-{path}", f"cannot write {path} ({exc}); {sig.name} lost")
                continue
            if spool:
                counts.spooled_items += n
            else:
                counts.written_items += n
                if rank is None and local is None:
                    counts.unranked_items += n

    def _flush(self) -> None:
        self._dirty = False
        for path, fh in list(self._files.items()):
            try:
                fh.flush()
            except Exception as exc:
                self.problem(f"write-{path}", f"cannot write {path} ({exc})")

    # ---- close --------------------------------------------------------------------------

    def close(self, deadline_s: float = CLOSE_DEADLINE_S) -> ReceiverStats:
        """Stop listening, write or relay what is queued, spool what the upstream cannot take
        before the deadline, flush and close every file, write the stats file. Whatever the
        upstream does, it is cut at 80% of ``deadline_s``; what remains is local writing (the
        spool, the files), bounded by the queue's size, given up to LOCAL_DRAIN_S more. Never
        raises."""
        start = time.monotonic()
        deadline = start + deadline_s
        for fe in self._frontends:
            with contextlib.suppress(Exception):
                fe.stop(grace=min(1.0, deadline_s / 4))
        with self._cond:
            self._closing = True
            # Relay sends stop at 80% of the deadline: the rest is for spooling and flushing.
            self._deadline = start + deadline_s * 0.8
            self._cond.notify_all()
        # Relay: the deadline bounds the upstream (it may hang). After it, as in embedded mode,
        # only local writes remain (workers have exited), bounded by the queue's size: let them
        # finish. (Spooling a full queue in the deadline's last 20% lost requests on a loaded
        # machine: counted nowhere, neither spooled nor lost.)
        if self._senders:
            self._thread.join(max(0.0, start + deadline_s * 0.8 - time.monotonic()))
            if self._thread.is_alive():
                # Still sending at 80%: cut the call in flight (it is spooled); the rest of the
                # queue goes straight to the spool.
                for sender in self._senders.values():
                    with contextlib.suppress(Exception):
                        sender.abort()
        limit = deadline + LOCAL_DRAIN_S
        self._thread.join(max(0.1, limit - time.monotonic()))
        if self._thread.is_alive():
            with self._cond:
                self.stats.unsent_at_deadline = len(self._queue)
            self.problem("deadline", "close deadline passed with requests still queued")
        else:
            for fh in self._files.values():
                with contextlib.suppress(Exception):
                    fh.close()
            self._files.clear()
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                sender.close()
        if self._store is not None:
            self._store.close()
            self.stats.store_appends = self._store.appends
        self.stats.closed_in_s = round(time.monotonic() - start, 3)
        self._write_stats()
        return self.stats

    def _write_stats(self) -> None:
        path = lay.receiver_stats_file(self.run_dir, self.node_rank)
        try:
            write_json(path, self.stats.to_json(), indent=1)
        except Exception as exc:
            self.problem("stats", f"cannot write {path} ({exc})")

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
