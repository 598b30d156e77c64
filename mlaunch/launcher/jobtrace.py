"""The launcher's job trace: ``mlaunch.job`` for the whole ``mlaunch train`` and one
``mlaunch.job.attempt`` child per torchrun attempt, emitted by the launcher process itself so that
no worker crash (not even a SIGKILL) can take the run-long view with it.

What it knows and where from
    - attempt boundaries: torchrun creates ``<log-dir>/<id>/attempt_<N>/`` for each worker group it
      starts (``N`` = ``TORCHELASTIC_RESTART_COUNT`` of those workers);
    - how an attempt ended: torchrun's agent logs ``failed (exitcode: C) local_rank: L`` for the
      first worker of a group that failed (C < 0: killed by signal -C); at the end, torchrun's own
      exit code and the failure report of :func:`mlaunch.launcher.run.collect_failures`;
    - an interrupt: the signal the launcher forwarded (Ctrl-C/SIGTERM).

Span context handed to the workers
    Workers get ``TRACEPARENT`` = the span context of their attempt's span. torchrun gives every
    worker group the same environment, so the wrapper :mod:`mlaunch.launcher.attempt_entry` derives
    the attempt's span id from ``TORCHELASTIC_RESTART_COUNT`` and ``MLAUNCH_ATTEMPT_TRACE``
    (``<trace id>:<key>``); this module derives the same id for the span it emits.

Ids
    One node: a fresh random trace id and key per invocation. Several nodes: every node derives
    the same trace id and root span id from the run id and the run identity (no communication);
    only node 0 writes ``mlaunch.job``, every node writes its own attempts as children of it. An
    inherited ``TRACEPARENT`` (a CI pipeline, a workflow engine) becomes the parent of
    ``mlaunch.job`` (its trace id is kept).

Where spans go
    Each span is encoded when it ends, as one OTLP/JSON line (a complete
    ``ExportTraceServiceRequest``), and handed to every sink: always :class:`FileSink`
    (``telemetry/traces-launcher-node<N>.jsonl``); with an OTLP endpoint and the ``otlp`` exporter
    also :class:`UpstreamSink` (a bounded background send) or, once the launcher hosts the OTLP
    receiver, a :class:`ReceiverSink`. A sink's failure is logged once and never reaches training.

Nothing here imports torch, protobuf or the OpenTelemetry SDK on the launcher's start-up path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import mlaunch
from mlaunch import envcontract as ec
from mlaunch.launcher import attempt_entry
from mlaunch.launcher.attempt_entry import attempt_span_id, traceparent
from mlaunch.model.identity import RUN_UUID, run_identity
from mlaunch.model.spans import Attr, ResourceAttr, SpanName
from mlaunch.otlp import traceparent as traceparent_header
from mlaunch.rundir import layout as lay
from mlaunch.rundir.worker_logs import launch_attempts

if TYPE_CHECKING:  # the types only: importing this module never loads the settings layer
    from mlaunch.launcher.plan import LaunchPlan
    from mlaunch.settings import Settings

log = logging.getLogger("mlaunch.launcher.jobtrace")

#: The instrumentation scope of the launcher's spans.
SCOPE = "mlaunch.launcher"
#: OTLP status codes.
STATUS_UNSET, STATUS_ERROR = 0, 2
#: torchrun's agent line for the first failed worker of a group.
FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
#: How long closing waits for an upstream send at most (the launcher's exit is never held longer).
UPSTREAM_CLOSE_S = 5.0
#: torchrun options that take no value (everything else before the entry takes one).
_TORCHRUN_FLAGS = frozenset(
    {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path"}
)


def enabled(settings: Settings) -> bool:
    """Whether a launch with these settings emits a job trace: telemetry and traces on."""
    t = settings.telemetry
    return bool(t.enabled and t.traces_enabled and not t.otel.sdk_disabled)


def _hex(n: int, *parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:n]


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """(trace id, span id) of a W3C ``traceparent`` value, or None when it is not one."""
    parsed = traceparent_header.parse(value)
    if parsed is None:
        return None
    return f"{parsed.trace_id:032x}", f"{parsed.span_id:016x}"


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9 (``SIG<n>`` for a number Python has no name for)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


# --------------------------------------------------------------------------------------------
# Sinks


class SpanSink(Protocol):
    """Where the job trace goes. ``export`` gets one OTLP/JSON ``ExportTraceServiceRequest`` (a
    dict, hex ids) per ended span and its encoded line; it must not block for long."""

    def export(self, request: dict[str, Any], line: str) -> None: ...

    def close(self, timeout_s: float) -> None: ...


class FileSink:
    """Appends each request as one line to the node's launcher traces file, at once (a line is
    on disk as soon as the span ends, whatever happens to the launcher afterwards)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def export(self, request: dict[str, Any], line: str) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, (line + "\n").encode())  # one write: nodes never interleave lines

    def close(self, timeout_s: float) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ReceiverSink:
    """Hands each request to the launcher's embedded OTLP receiver (anything with
    ``ingest_traces(ExportTraceServiceRequest)``), which writes or relays it like a worker's."""

    def __init__(self, receiver: Any, local_file: Path) -> None:
        self.receiver = receiver
        self.local_file = local_file

    def export(self, request: dict[str, Any], line: str) -> None:
        from mlaunch.otlp.otlp_json import decode_traces_line

        self.receiver.ingest_traces(decode_traces_line(line), local_file=self.local_file)

    def close(self, timeout_s: float) -> None:
        pass  # the receiver's owner flushes and stops it


class UpstreamSink:
    """Sends each request to the configured OTLP endpoint (gRPC or HTTP/protobuf) from a daemon
    thread: ``export`` never waits, each send has a deadline, ``close`` waits at most
    ``timeout_s``. What is not delivered (a failed send, a full queue, what is still queued or
    in flight when ``close`` gives up) goes to ``spool`` (``spool-traces-launcher-node<N>.jsonl``,
    which ``mlaunch trace replay`` sends later), once: a line is either delivered or spooled. The
    first failure is logged at warning level, once."""

    def __init__(self, otel: Any, timeout_s: float, spool: Path | None = None) -> None:
        self.otel = otel
        self.timeout_s = timeout_s
        self.spool = spool
        self.failed = 0
        self.spooled = 0
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize=256)
        self._lock = threading.Lock()
        self._inflight: str | None = None
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="mlaunch-jobtrace", daemon=True)
        self._thread.start()

    def export(self, request: dict[str, Any], line: str) -> None:
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self._undelivered([line], "the send queue is full")

    def close(self, timeout_s: float) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(min(timeout_s, self.timeout_s))  # one send's deadline, at most
        with self._lock:  # what the thread did not get to: spooled now, never sent later
            self._closed = True
            left = [self._inflight] if self._inflight is not None else []
            self._inflight = None
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    left.append(item)
        if left:
            self._undelivered(left, f"not sent within {min(timeout_s, self.timeout_s):g} s")

    def _run(self) -> None:
        send = None
        while True:
            with self._lock:
                if self._closed:
                    return
            line = self._queue.get()
            if line is None:
                return
            with self._lock:
                if self._closed:  # close gave up on us and spooled the rest: this one too?
                    self._undelivered_locked([line], "not sent before close")
                    return
                self._inflight = line
            error = None
            try:
                from mlaunch.otlp.otlp_json import decode_traces_line

                send = send or self._sender()
                send(decode_traces_line(line))
            except Exception as exc:  # a collector's trouble is never the launcher's
                error = exc
            with self._lock:
                if self._inflight is None:  # close spooled it already
                    return
                self._inflight = None
                if error is not None:
                    from mlaunch.otlp.send import failure_text

                    self._undelivered_locked([line], failure_text(error))

    def _undelivered(self, lines: list[str], why: str) -> None:
        with self._lock:
            self._undelivered_locked(lines, why)

    def _undelivered_locked(self, lines: list[str], why: str) -> None:
        self.failed += len(lines)
        fate = "lost (no spool)"
        if self.spool is not None:
            try:
                self.spool.parent.mkdir(parents=True, exist_ok=True)
                with self.spool.open("a", encoding="utf-8") as fh:
                    fh.write("".join(line + "\n" for line in lines))
                self.spooled += len(lines)
                fate = f"spooled to {self.spool}; send them later with mlaunch trace replay"
            except OSError as exc:
                fate = f"lost: cannot write {self.spool} ({exc})"
        if not self._warned:
            self._warned = True
            # One line: the endpoint, the status, what happens to the spans.
            log.warning(
                "job trace: cannot deliver to %s (%s); its spans are %s",
                self.otel.endpoint, why, fate,
            )  # fmt: skip

    def _sender(self) -> Any:
        from mlaunch.otlp import send

        otel = self.otel
        headers = {str(k).lower(): str(v) for k, v in (otel.headers or {}).items()}
        if otel.protocol == "grpc":
            endpoint = otel.endpoint
            target = endpoint.split("://", 1)[-1].rstrip("/")
            scheme = endpoint.split("://", 1)[0] if "://" in endpoint else ""
            tls = send.grpc_tls(scheme, otel.insecure, insecure_first=True)
            channel = send.grpc_channel(target, tls=tls, certificate=otel.certificate)
            export = send.grpc_unary(channel, send.EXPORT_METHODS["traces"])
            metadata = send.grpc_metadata(headers)
            return lambda req: export(
                req.SerializeToString(), timeout=self.timeout_s, metadata=metadata
            )
        # Built before the first send, so a bad certificate path fails every send alike.
        context = send.ssl_context(otel.certificate)

        def post(req: Any) -> None:
            send.http_post(
                otel.endpoint, req.SerializeToString(),
                {**headers, "Content-Type": "application/x-protobuf"}, self.timeout_s,
                context=context,
            )  # fmt: skip

        return post


def default_sinks(plan: LaunchPlan) -> list[SpanSink]:
    """The file, plus the endpoint when the run exports over OTLP."""
    sinks: list[SpanSink] = [FileSink(lay.launcher_traces_file(plan.run_dir, _node(plan)))]
    t = plan.settings.telemetry
    if t.exporter == "otlp" and t.otel.endpoint_configured:
        spool = lay.spooled(lay.launcher_traces_file(plan.run_dir, _node(plan)))
        sinks.append(UpstreamSink(t.otel, min(t.shutdown_timeout_s, UPSTREAM_CLOSE_S), spool))
    return sinks


def relay_sinks(plan: LaunchPlan, receiver: Any) -> list[SpanSink] | None:
    """With the launcher's relay, the file plus the receiver (which forwards the job trace
    upstream and spools it next to the launcher file when the collector is down); else None (the
    default sinks)."""
    if receiver is None or receiver.stats.mode != "relay":
        return None
    path = lay.launcher_traces_file(plan.run_dir, _node(plan))
    return [FileSink(path), ReceiverSink(receiver, path)]


def _node(plan: LaunchPlan) -> int:
    return int(plan.settings.launch.node_rank)


# --------------------------------------------------------------------------------------------
# Spans


@dataclass
class _Span:
    name: str
    span_id: str
    parent_id: str
    start_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    end_ns: int = 0
    status: int = STATUS_UNSET
    message: str = ""


def unix_seconds(ns: int) -> str:
    """``ns`` (Unix time in nanoseconds) as the decimal seconds Megatron-LM parses with
    ``float()``: exact to the nanosecond in the text."""
    return f"{ns // 10**9}.{ns % 10**9:09d}"


def launch_times(env: Mapping[str, str], started_ns: int, presrun_ns: int) -> dict[str, str]:
    """Megatron-LM's launch stamps (``envcontract.LAUNCH_SCRIPT_START_TIME`` /
    ``_PRESRUN_TIME``): the launcher's start (the ``mlaunch.job`` span's) and the moment it starts
    torchrun. A stamp already in ``env`` is kept: the user's own launch script began earlier."""
    stamps = {
        ec.LAUNCH_SCRIPT_START_TIME: unix_seconds(started_ns),
        ec.LAUNCH_SCRIPT_PRESRUN_TIME: unix_seconds(presrun_ns),
    }
    return {k: v for k, v in stamps.items() if not env.get(k, "").strip()}


def entry_index(argv: Sequence[str]) -> int:
    """Where the entry point (``-m MODULE ...`` or ``SCRIPT ...``) starts in a torchrun command
    line ``python -m torch.distributed.run [OPTIONS] ENTRY...``."""
    i = list(argv).index("torch.distributed.run") + 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module") or not arg.startswith("-"):
            return i
        i += 1 if arg in _TORCHRUN_FLAGS or "=" in arg else 2
    return len(argv)


def wrapper_argv() -> list[str]:
    """What goes before the entry in torchrun's command: torchrun runs ``python -S -u
    attempt_entry.py ENTRY...`` as is (``--no-python``: its own ``python -u`` would import
    ``site``, the largest part of an interpreter's start on a machine with many ``.pth`` files)."""
    return ["--no-python", sys.executable, "-S", "-u", str(Path(attempt_entry.__file__).resolve())]


class JobTrace:
    """The job trace of one ``mlaunch train``: create it before torchrun starts, :meth:`wrap` the
    command, call :meth:`spawned`, then :meth:`poll` while following torchrun, and
    :meth:`finish` (or :meth:`abort`) once. No method raises: a failure turns the trace off."""

    def __init__(
        self,
        plan: LaunchPlan,
        environ: Mapping[str, str] | None = None,
        sinks: list[SpanSink] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        launch, t = plan.settings.launch, plan.settings.telemetry
        self.plan = plan
        self.node = _node(plan)
        self.sinks = default_sinks(plan) if sinks is None else sinks
        self._env = {k: v for k, v in environ.items() if k != ec.RESTART_COUNT}
        identity = run_identity(self._env)
        parent = parse_traceparent(environ.get(ec.TRACEPARENT))
        if launch.nnodes > 1:  # every node derives the same ids: one trace, one root
            seed = _hex(32, "mlaunch.job", plan.run_id, identity[RUN_UUID], parent or "")
        else:
            seed = secrets.token_hex(16)
        self.trace_id = parent[0] if parent else _hex(32, seed, "trace")
        self.key = _hex(16, seed, "node", self.node)  # attempt n's span id: key + n
        self.resource: dict[str, Any] = {
            ResourceAttr.SERVICE_NAME.value: t.service_name,
            ResourceAttr.RUN_ID.value: plan.run_id,
            ResourceAttr.USER_ID.value: t.user_id or None,
            ResourceAttr.HOST_NAME.value: socket.gethostname(),
            ResourceAttr.PROCESS_PID.value: os.getpid(),
            ResourceAttr.NODE_RANK.value: self.node,
            ResourceAttr.WORLD_SIZE.value: plan.world_size,
            **identity,
        }
        self.job = _Span(SpanName.JOB.value, _hex(16, seed, "job"), parent[1] if parent else "",
                         mlaunch.STARTED_NS)  # fmt: skip
        self.attempts: list[_Span] = []
        self._log_offset = self._size(plan.log_dir / lay.TORCHRUN_LOG)
        self._since = time.time()
        self._interrupt: int | None = None
        self._failed_rank: int | None = None
        self._broken = False

    # ---- the command ------------------------------------------------------------------------

    def wrap(self, argv: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """torchrun's command with the entry wrapped by :mod:`~mlaunch.launcher.attempt_entry`,
        and the environment with ``MLAUNCH_ATTEMPT_TRACE`` and the launch stamps (call it right
        before starting torchrun: that moment is the PRESRUN stamp)."""
        i = entry_index(argv)
        wrapped = [*argv[:i], *wrapper_argv(), *argv[i:]]
        return wrapped, {
            **env,
            ec.ATTEMPT_TRACE: f"{self.trace_id}:{self.key}",
            **launch_times(env, self.job.start_ns, time.time_ns()),
        }

    def traceparent(self, attempt: int) -> str:
        """The ``TRACEPARENT`` the workers of ``attempt`` see."""
        return traceparent(self.trace_id, attempt_span_id(self.key, attempt))

    # ---- following torchrun -----------------------------------------------------------------

    def spawned(self) -> None:
        """torchrun has started: attempt 0 begins (rendezvous included)."""
        self._guard(self._open_attempt, 0, time.time_ns())

    def interrupted(self, signum: int) -> None:
        """The launcher forwarded ``signum`` to the job (safe in a signal handler)."""
        if self._interrupt is None:
            self._interrupt = signum

    def poll(self) -> None:
        """Look at torchrun's new log lines and attempt folders; end/start attempt spans."""
        self._guard(self._poll)

    def hung(self) -> None:
        """The hang watchdog declared the current attempt hung: ``mlaunch.hang=true`` on it."""

        def mark() -> None:
            span = self._current()
            if span is not None:
                span.attributes[Attr.HANG.value] = True

        self._guard(mark)

    def finish(
        self, exit_code: int, failures: Sequence[Any] = (), interrupted: int | None = None
    ) -> None:
        """torchrun has exited (the launch's final ``exit_code``): end what is open, write the
        root, close the sinks."""
        self._guard(self._finish, exit_code, failures, interrupted)
        self._close()

    def abort(self, why: str) -> None:
        """The launcher is leaving abnormally: end everything as truncated, write, close."""

        def end_all() -> None:
            now = time.time_ns()
            for span in (self._current(), self.job):
                if span is not None and not span.end_ns:
                    span.attributes[Attr.TRUNCATED.value] = True
                    self._end(span, now, STATUS_ERROR, why)

        self._guard(end_all)
        self._close()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around the launcher's following of torchrun: any exception leaving it (a bug, a
        KeyboardInterrupt outside the forwarding handlers) ends and writes the spans first."""
        try:
            yield
        except BaseException as exc:
            self.abort(f"launcher stopped: {type(exc).__name__}")
            raise

    # ---- internals --------------------------------------------------------------------------

    def _guard(self, fn: Any, *args: Any) -> None:
        if self._broken:
            return
        try:
            fn(*args)
        except Exception as exc:  # telemetry never breaks a launch
            self._broken = True
            log.warning("job trace disabled: %s: %s", type(exc).__name__, exc)

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0

    def _current(self) -> _Span | None:
        return self.attempts[-1] if self.attempts and not self.attempts[-1].end_ns else None

    def _open_attempt(self, n: int, start_ns: int) -> None:
        worker_identity = run_identity({**self._env, ec.RESTART_COUNT: str(n)})
        self.attempts.append(
            _Span(SpanName.JOB_ATTEMPT.value, attempt_span_id(self.key, n), self.job.span_id,
                  start_ns, {Attr.ATTEMPT.value: n, RUN_UUID: worker_identity[RUN_UUID]})
        )  # fmt: skip

    def _global_rank(self, local_rank: int, since_ns: int) -> int | None:
        launch = self.plan.settings.launch
        if launch.nnodes == 1:  # one node: torchrun's ranks are the local ranks
            return local_rank
        # Several: the rendezvous orders the nodes, so only the trainer's error file (written by
        # the failing rank itself during this attempt) can say which global rank it was.
        for path in self.plan.run_dir.glob(lay.ERROR_FILE.glob):
            rank = lay.ERROR_FILE.parse(path.name)
            if rank is None:
                continue
            with contextlib.suppress(OSError):
                fresh = path.stat().st_mtime_ns >= since_ns
                if fresh and rank % launch.nproc_per_node == local_rank:
                    return rank
        return None

    def _new_lines(self) -> list[str]:
        path = self.plan.log_dir / lay.TORCHRUN_LOG
        try:
            with path.open("rb") as fh:
                fh.seek(self._log_offset)
                data = fh.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a half-written line waits for the next poll
        self._log_offset += len(complete)
        return complete.decode("utf-8", "replace").splitlines()

    def _attempt_numbers(self) -> list[int]:
        return sorted(launch_attempts(self.plan.log_dir, self._since))

    def _poll(self) -> None:
        now = time.time_ns()
        # Folders first, then the log: torchrun logs a group's failure before it creates the next
        # attempt's folder, so every failure of an attempt seen here is in the lines read after.
        numbers = self._attempt_numbers()
        for line in self._new_lines():
            m = FAILED_LINE.search(line)
            span = self._current()
            if m and span is not None:
                code, local = int(m.group(1)), int(m.group(2))
                if self._interrupt is not None:
                    self._end_interrupted(span, now)
                    continue
                rank = self._global_rank(local, span.start_ns)
                self._record_exit(span, code, rank)
                self._end(span, now, STATUS_ERROR, self._describe(code, rank))
        last = self.attempts[-1].attributes[Attr.ATTEMPT.value] if self.attempts else -1
        for n in numbers:
            if n <= last or self._interrupt is not None:
                continue
            span = self._current()
            if span is not None:  # a restart with no local failure: another node's group failed
                self._end(span, now, STATUS_ERROR, "worker group restarted")
            start = self.attempts[-1].end_ns if self.attempts else now
            self._open_attempt(n, min(start, now))
            last = n

    def _record_exit(self, span: _Span, code: int, rank: int | None) -> None:
        if code < 0:
            span.attributes[Attr.SIGNAL.value] = signal_name(-code)
        else:
            span.attributes[Attr.EXIT_CODE.value] = code
        if rank is not None:
            span.attributes[Attr.FAILED_RANK.value] = rank
            if self._failed_rank is None:
                self._failed_rank = rank

    @staticmethod
    def _describe(code: int, rank: int | None) -> str:
        who = f"rank {rank}" if rank is not None else "a worker"
        how = f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        return f"{who} {how}"

    def _end_interrupted(self, span: _Span, now: int) -> None:
        name = signal_name(self._interrupt or signal.SIGTERM)
        span.attributes[Attr.SIGNAL.value] = name
        span.attributes[Attr.TRUNCATED.value] = True
        self._end(span, now, STATUS_ERROR, f"interrupted by {name}")

    def _finish(self, exit_code: int, failures: Sequence[Any], interrupted: int | None) -> None:
        if interrupted is not None:
            self.interrupted(interrupted)
        self._poll()
        now = time.time_ns()
        rank = next((f.rank for f in failures if getattr(f, "rank", None) is not None), None)
        span = self._current()
        if span is not None:
            if self._interrupt is not None:
                self._end_interrupted(span, now)
            elif exit_code == 0:
                span.attributes[Attr.EXIT_CODE.value] = 0
                self._end(span, now, STATUS_UNSET, "")
            else:
                self._record_exit(span, exit_code, rank)
                self._end(span, now, STATUS_ERROR, self._describe(exit_code, rank))
        job = self.job
        if self.attempts:
            job.attributes[Attr.ATTEMPT.value] = self.attempts[-1].attributes[Attr.ATTEMPT.value]
        if self._interrupt is not None:
            name = signal_name(self._interrupt)
            job.attributes[Attr.SIGNAL.value] = name
            job.attributes[Attr.TRUNCATED.value] = True
            status, message = STATUS_ERROR, f"interrupted by {name}"
        else:
            job.attributes[Attr.EXIT_CODE.value] = exit_code
            status, message = (STATUS_UNSET, "") if exit_code == 0 else (STATUS_ERROR, "failed")
        failed = rank if rank is not None else self._failed_rank
        if failed is not None and exit_code != 0:
            job.attributes[Attr.FAILED_RANK.value] = failed
        if self.node == 0 or self.plan.settings.launch.nnodes == 1:
            self._end(job, now, status, message)
        else:
            job.end_ns = now  # other nodes' attempts point at node 0's root; it is not theirs

    def _end(self, span: _Span, now: int, status: int, message: str) -> None:
        span.end_ns = max(now, span.start_ns)
        span.status, span.message = status, message
        self._write(span)

    def _write(self, span: _Span) -> None:
        import json

        from mlaunch.otlp.otlp_json import encode_span, trace_request

        body = encode_span(
            name=span.name, trace_id=self.trace_id, span_id=span.span_id,
            parent_span_id=span.parent_id, start_ns=span.start_ns, end_ns=span.end_ns,
            attributes=span.attributes, status_code=span.status, status_message=span.message,
        )  # fmt: skip
        request = trace_request(self.resource, SCOPE, [body])
        line = json.dumps(request, separators=(",", ":"))
        for sink in self.sinks:
            try:
                sink.export(request, line)
            except Exception as exc:  # one sink's trouble never stops the others
                log.warning("job trace: %s failed: %s", type(sink).__name__, exc)

    def _close(self) -> None:
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink.close(UPSTREAM_CLOSE_S)


class _NoJobTrace:
    """What :func:`start` returns when there is no job trace: every call does nothing."""

    def wrap(self, argv: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        return argv, dict(env)

    def spawned(self) -> None: ...

    def interrupted(self, signum: int) -> None: ...

    def poll(self) -> None: ...

    def hung(self) -> None: ...

    def finish(
        self, exit_code: int, failures: Sequence[Any] = (), interrupted: int | None = None
    ) -> None: ...

    def abort(self, why: str) -> None: ...

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        yield


def start(plan: LaunchPlan, sinks: list[SpanSink] | None = None) -> JobTrace | _NoJobTrace:
    """The job trace of this launch (a do-nothing stand-in when telemetry or traces are off, or
    when it cannot be set up: that never stops the launch)."""
    if not enabled(plan.settings):
        return _NoJobTrace()
    try:
        return JobTrace(plan, sinks=sinks)
    except Exception as exc:
        log.warning("job trace disabled: %s: %s", type(exc).__name__, exc)
        return _NoJobTrace()
