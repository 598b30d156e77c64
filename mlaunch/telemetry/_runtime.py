"""The exporting rank's runtime: resource, samplers, providers, instruments, the export thread
and the bounded shutdown. Where the data goes (the sinks: OTLP gRPC / HTTP, console, file, none;
and the spool) is :mod:`mlaunch.telemetry._sinks`; the logging bridge is
:mod:`mlaunch.telemetry._logbridge`.

These modules are the only ones that import the OpenTelemetry SDK and exporters;
``mlaunch.telemetry`` imports the runtime only on an exporting rank with telemetry enabled.

Why mlaunch owns the export thread instead of using the SDK's BatchSpanProcessor: the SDK's
``force_flush(timeout_millis=...)`` ignores its timeout and can block ~28 s on an unreachable
endpoint. Here the one export thread does all encoding and I/O; shutdown waits for it only until
a hard deadline, then writes everything undelivered (queued or in flight) to the spool file and
returns. A daemon thread stuck in a network call cannot keep the process alive.

Nothing is lost: the thread takes one batch at a time from the queue (so only that batch is ever
in flight; the rest stays queued where the deadline finds it), and every span taken is counted
as delivered, spooled or dropped with a logged reason (:meth:`Runtime.span_counts`). Spans are
encoded straight from their fields (:mod:`mlaunch.telemetry._encode`), not through SDK
ReadableSpans and the SDK's encoder, which cost more CPU than recording them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, TraceFlags

import mlaunch
from mlaunch import envcontract
from mlaunch.model.identity import run_identity
from mlaunch.model.segments import train_block
from mlaunch.model.spans import (
    K8S_RESOURCE_ATTRS,
    METRICS,
    Attr,
    Metric,
    ResourceAttr,
    SpanName,
)
from mlaunch.otlp import traceparent
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json
from mlaunch.settings import TelemetrySettings
from mlaunch.telemetry import _spans
from mlaunch.telemetry._core import Identity
from mlaunch.telemetry._encode import Limits, SpanEncoder
from mlaunch.telemetry._logbridge import LogBridge, install_log_bridge
from mlaunch.telemetry._sinks import FailingSink, LineFile, Sink, Spool, build_sink
from mlaunch.telemetry._spans import STARTUP_TRACE, segment_trace_id
from mlaunch.telemetry.samplers import build_sampler

log = logging.getLogger("mlaunch.telemetry")

SCOPE_NAME = "mlaunch"
#: How often the export thread wakes to drain ended spans (the training thread never signals it,
#: so ending a span costs no lock or syscall).
DRAIN_INTERVAL_S = 0.25
#: Spans per export request.
BATCH_SIZE = 512
#: After a failed export, batches go straight to the spool for a while instead of each waiting
#: for the exporter's timeout against a dead endpoint. The pause starts short and doubles with
#: each consecutive failure up to the maximum, so a collector that comes back (a restart, a
#: rolling update) is used again within seconds, while a dead one costs one try per 30 s.
FAILURE_BACKOFF_S = 30.0
FIRST_FAILURE_BACKOFF_S = 1.0
DEFAULT_METRIC_INTERVAL_MS = 60_000  # the OTel default (OTEL_METRIC_EXPORT_INTERVAL)
#: Local file writes are cheap; a shorter default period means a killed process loses little.
DEFAULT_FILE_METRIC_INTERVAL_MS = 10_000
#: More ended spans than this waiting in one drain means the exporter is behind; the oldest go
#: to the spool file instead of growing memory without bound.
MAX_PENDING_SPANS = 200_000

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


# ------------------------------------------------------------------------------------------------
# Trace identity


def parse_traceparent(value: str) -> SpanContext | None:
    """A W3C ``traceparent`` as a remote SpanContext; None when it is not a valid one (the rules:
    :mod:`mlaunch.otlp.traceparent`)."""
    parsed = traceparent.parse(value)
    if parsed is None:
        return None
    return SpanContext(parsed.trace_id, parsed.span_id, True, TraceFlags(parsed.flags & 0x01))


# ------------------------------------------------------------------------------------------------
# Resource


def build_resource_attributes(
    settings: TelemetrySettings,
    *,
    run_id: str,
    rank: int,
    world_size: int,
    local_rank: int,
    extra: Mapping[str, Any] | None,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """Every span's and metric's resource attributes: ``OTEL_RESOURCE_ATTRIBUTES`` first, then
    mlaunch's attributes over them, including the run identity Megatron-LM computes
    (``nemo.lens.job_uuid`` / ``nemo.lens.run_uuid``, SLURM and NVRx attributes)."""
    from opentelemetry.sdk.version import __version__ as sdk_version

    attrs: dict[str, Any] = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": sdk_version,
    }
    attrs.update(getattr(settings.otel, "resource_attributes", None) or {})
    for env_key, attr in K8S_RESOURCE_ATTRS.items():
        value = environ.get(env_key, "").strip()
        if value:
            attrs[attr] = value
    attrs.update(run_identity(environ))
    attrs.update(
        {
            ResourceAttr.SERVICE_NAME: settings.service_name,
            ResourceAttr.SERVICE_VERSION: mlaunch.__version__,
            ResourceAttr.SERVICE_INSTANCE_ID: f"{run_id}-rank{rank}",
            ResourceAttr.RUN_ID: run_id,
            ResourceAttr.RANK: rank,
            ResourceAttr.WORLD_SIZE: world_size,
            ResourceAttr.LOCAL_RANK: local_rank,
            ResourceAttr.HOST_NAME: socket.gethostname(),
            ResourceAttr.PROCESS_PID: os.getpid(),
        }
    )
    if settings.user_id:
        attrs[ResourceAttr.USER_ID] = settings.user_id
    for key, value in (extra or {}).items():
        if value is not None:
            attrs[str(key)] = value
    return {str(k): v for k, v in attrs.items()}


# ------------------------------------------------------------------------------------------------
# SDK plumbing


class _SegmentIdGenerator(IdGenerator):
    """Root spans get the current trace id (startup or block); span ids are random as in the SDK,
    from the fast path's seed-independent source (:data:`_spans.span_id_bits`)."""

    def generate_span_id(self) -> int:
        return _spans.span_id_bits(64) or 1

    def generate_trace_id(self) -> int:
        return _spans.STATE.trace_id


class _QueueProcessor(SpanProcessor):
    """Hands ended (sampled) SDK spans to the export thread's queue."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def on_end(self, span: ReadableSpan) -> None:
        self.queue.append(span)


class _LogOnce:
    """Logs each distinct failure cause once."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.lock = threading.RLock()  # shutdown may run in a signal handler on a logging thread

    def __call__(self, cause: str, message: str, *args: Any) -> None:
        with self.lock:
            if cause in self.seen:
                return
            self.seen.add(cause)
        log.warning(message, *args)


class _OnceFilter(logging.Filter):
    """Lets each distinct message of the SDK's attribute cleaning through once: a bad value set
    on a span in a loop is one log line, not one per span."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            key = record.getMessage()[:300]
        except Exception:
            key = str(record.msg)[:300]
        if key in self.seen:
            return False
        if len(self.seen) < 1000:
            self.seen.add(key)
        return True


_ATTRIBUTE_LOG_FILTER = _OnceFilter()
logging.getLogger("opentelemetry.attributes").addFilter(_ATTRIBUTE_LOG_FILTER)


# ------------------------------------------------------------------------------------------------
# The runtime


class Runtime:
    """Everything an exporting rank holds; built by ``mlaunch.telemetry.setup`` (and, on a rank
    that exports nothing, by a live capture) with the worker's :class:`Identity`, derived once."""

    def __init__(
        self,
        settings: TelemetrySettings,
        identity: Identity,
        *,
        environ: Mapping[str, str],
        install_now: bool = True,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.rank = rank = identity.rank
        self.run_id = identity.run_id
        self.run_dir = identity.run_dir
        self.incarnation = identity.incarnation
        self.block_iters = identity.block_iters
        self.log_once = _LogOnce()
        self._init_chain(environ)
        extra = dict(identity.resource)
        extra.setdefault(ResourceAttr.RESTART_COUNT, identity.restart)
        self.traces_on = bool(settings.traces_enabled)
        self.metrics_on = bool(settings.metrics_enabled)
        self.resource = Resource(
            build_resource_attributes(
                settings,
                run_id=self.run_id,
                rank=rank,
                world_size=identity.world_size,
                local_rank=identity.local_rank,
                extra=extra,
                environ=environ,
            )
        )
        self.scope = InstrumentationScope(SCOPE_NAME, mlaunch.__version__)
        # Queues the export thread drains: ended fine records and ended SDK spans share one.
        self.queue: deque[Any] = deque()
        _spans.STATE.queue = self.queue
        self._init_tracing()
        self._init_metrics()
        self._init_export(environ)
        if install_now:  # else the training thread calls install_spans (a live capture)
            self._install_span_state()
        self.thread = threading.Thread(
            target=self._run, name="mlaunch-telemetry-export", daemon=True
        )
        self.thread.start()
        self.log_bridge: LogBridge | None = None
        if settings.logs_enabled:
            try:
                self.log_bridge = install_log_bridge(settings, self.resource)
            except Exception as exc:  # the bridge is optional; never stop training for it
                self.log_once("logs", "mlaunch telemetry: OTel log bridge unavailable (%s)", exc)
        atexit.register(self.shutdown)

    # --- construction steps ---------------------------------------------------------------------

    def _init_chain(self, environ: Mapping[str, str]) -> None:
        """The trace chain's start: no block yet, and the launcher's attempt span to link to."""
        self.block: int | None = None
        #: The span the next root megatron.train links to: this incarnation's megatron.startup,
        #: then the previous block.
        self.chain: SpanContext | None = None
        self.launcher_link = self._launcher_link(environ)

    def _init_tracing(self) -> None:
        """The sampler and the TracerProvider whose ended spans go to the export queue."""
        settings = self.settings
        self.sampler = build_sampler(
            rank=self.rank,
            traces_sampler=settings.otel.traces_sampler,
            traces_sampler_arg=settings.otel.traces_sampler_arg,
            rank_aware=settings.sampler_enabled,
            sample_rate=settings.export_sample_rate,
        )
        self.tracer_provider = TracerProvider(
            sampler=self.sampler,
            resource=self.resource,
            shutdown_on_exit=False,
            id_generator=_SegmentIdGenerator(),
        )
        self.tracer_provider.add_span_processor(_QueueProcessor(self.queue))
        self.tracer = self.tracer_provider.get_tracer(SCOPE_NAME, mlaunch.__version__)

    def _init_metrics(self) -> None:
        """The MeterProvider, one instrument per catalogue metric, and the collection period."""
        settings = self.settings
        self.reader: InMemoryMetricReader | None = None
        self.meter_provider: MeterProvider | None = None
        self.instruments: dict[str, Any] = {}
        if self.metrics_on:
            self.reader = InMemoryMetricReader()
            self.meter_provider = MeterProvider(
                metric_readers=[self.reader], resource=self.resource, shutdown_on_exit=False
            )
            meter = self.meter_provider.get_meter(SCOPE_NAME, mlaunch.__version__)
            makers = {
                "histogram": meter.create_histogram,
                "gauge": meter.create_gauge,
                "counter": meter.create_counter,
            }
            for m in METRICS:
                self.instruments[m.name] = makers[m.kind](
                    m.name, unit=m.unit, description=m.description
                )
        default_ms = (
            DEFAULT_FILE_METRIC_INTERVAL_MS
            if settings.exporter == "file"
            else DEFAULT_METRIC_INTERVAL_MS
        )
        interval = settings.otel.metric_export_interval_ms or default_ms
        self.metric_interval_s = max(0.05, interval / 1000)

    def _init_export(self, environ: Mapping[str, str]) -> None:
        """The sink, the spool, the encoder and the export thread's bookkeeping."""
        settings = self.settings
        # Only a remote exporter can fail to deliver: its counts go to the end-of-run report
        # (a console run writes nothing to disk; a file run's files are the record).
        self.remote = settings.exporter == "otlp"
        try:
            self.sink = build_sink(
                settings, self.run_dir, self.rank, self.traces_on, self.metrics_on
            )
        except Exception as exc:  # e.g. an unreadable CA file: keep the data, in the spool
            self.log_once(
                "sink",
                "mlaunch telemetry: cannot build the %s exporter (%s); spooling",
                settings.exporter,
                exc,
            )
            self.sink = FailingSink(f"no exporter: {exc}")
        # Re-entrant: the spool is written with it held, from the export thread or shutdown.
        self._lock = threading.RLock()
        self.encoder = SpanEncoder(
            self.resource, self.scope, Limits(), on_drop=self._on_encode_drop
        )
        self.spool = Spool(
            self.run_dir, self.rank, self.encoder, BATCH_SIZE, self._drop, self.log_once
        )
        self._taken = 0  # spans taken from the queue (exported, spooled or dropped)
        self._delivered = 0
        self._dropped: dict[str, int] = {}
        self._inflight_spans: list[Any] | None = None
        self._inflight_metrics: Any = None
        self._abandoned = False
        self._backoff_until = 0.0
        self._backoff_s = FIRST_FAILURE_BACKOFF_S
        # Test-only (MLAUNCH_TEST_TEE_SPANS): a copy of every span handed to the exporter, so a
        # fault test can check that each one was delivered or spooled.
        self.tee = (
            LineFile(lay.tee_file(self.run_dir, self.rank))
            if environ.get(envcontract.TEE_SPANS)
            else None
        )
        self._stop = threading.Event()
        self._closed = False

    def _install_span_state(self) -> None:
        """Point the span classes (module-level state they read) at this runtime."""
        self._root_cache: tuple[int, bool] = (0, False)
        state = _spans.STATE
        state.trace_id = segment_trace_id(self.run_id, self.incarnation, STARTUP_TRACE)
        state.root_sampled = self._root_sampled
        state.start_sdk_span = self._start_sdk_span
        state.attach = self._attach
        state.detach = otel_context.detach

    def install_spans(self, iteration: int) -> None:
        """Point the span classes at this runtime now, in ``iteration``'s block trace: a runtime
        built off the training thread for a live capture on a rank that exports nothing
        (``install_now=False``) is installed by the training thread at the switch, so no span
        ever sees a half-installed state."""
        self._install_span_state()
        _spans.STATE.queue = self.queue
        self.block = None
        self.set_iteration(iteration)

    # --- hooks used by the span classes -----------------------------------------------------------

    def _root_sampled(self, trace_id: int, name: str) -> bool:
        # mlaunch's samplers decide on the trace id alone (rank-aware: a per-rank constant;
        # ratio: the trace id), so one root decision per trace (startup or block) serves every fine root.
        cached = self._root_cache
        if cached[0] == trace_id:
            return cached[1]
        sampled = self.sampler.should_sample(None, trace_id, name).decision.is_sampled()
        self._root_cache = (trace_id, sampled)
        return sampled

    def _launcher_link(self, environ: Mapping[str, str]) -> Link | None:
        """A Link to the launcher's attempt span from ``TRACEPARENT``; a malformed value is
        ignored (logged once): it must never stop a worker."""
        value = environ.get(envcontract.TRACEPARENT, "").strip()
        if not value:
            return None
        ctx = parse_traceparent(value)
        if ctx is None:
            self.log_once(
                "traceparent",
                "mlaunch telemetry: ignoring %s=%r (not a W3C traceparent 00-<32 hex>-<16 hex>-<2 hex>)",
                envcontract.TRACEPARENT,
                value,
            )
            return None
        return Link(ctx)

    def _start_sdk_span(
        self, name: str, parent: Any, attributes: dict[str, Any], links: Any
    ) -> Any:
        if parent is None:
            ctx = otel_context.Context()  # root: trace id from the segment id generator
            # The trace chain: startup -> the launcher's attempt span (via
            # TRACEPARENT); each megatron.train block -> the previous block, the first -> startup.
            if not links:
                if name == SpanName.STARTUP and self.launcher_link is not None:
                    links = [self.launcher_link]
                elif name == SpanName.TRAIN and self.chain is not None:
                    links = [Link(self.chain)]
            if name == SpanName.TRAIN:
                attributes[Attr.TRAIN_BLOCK] = self.block or 0
        else:
            flags = _SAMPLED if parent.sampled else _NOT_SAMPLED
            parent_ctx = SpanContext(parent.trace_id, parent.span_id, False, flags)
            ctx = trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent_ctx))
        span = self.tracer.start_span(
            name,
            context=ctx,
            attributes=attributes,
            links=links,
            record_exception=False,
            set_status_on_exception=False,
        )
        if parent is None and name in (SpanName.STARTUP, SpanName.TRAIN):
            self.chain = span.get_span_context()
        return span

    @staticmethod
    def _attach(span: Any) -> Any:
        return otel_context.attach(trace_api.set_span_in_context(span))

    # --- iteration / trace segments -------------------------------------------------------------

    def set_iteration(self, iteration: int) -> None:
        """Switch to the trace of ``iteration``'s ``megatron.train`` block (see module docs)."""
        block = train_block(iteration, self.block_iters)
        if block == self.block:
            return
        self.block = block
        state = _spans.STATE
        state.trace_id = segment_trace_id(self.run_id, self.incarnation, block)
        stack = _spans.current_stack()
        entry = stack[-1] if stack else None
        # Only an SDK (coarse) span can be re-rooted in place; the job group is never fine-grained.
        if (
            isinstance(entry, _spans.CoarseSpan)
            and entry.name == SpanName.TRAIN
            and entry.trace_id != state.trace_id
        ):
            entry.reroot({Attr.TRAIN_BLOCK: block}, [])

    # --- metrics --------------------------------------------------------------------------------

    def record_step(
        self,
        iteration: int,
        step_ms: float,
        loss: float | None,
        grad_norm: float | None,
        learning_rate: float | None,
        tokens_per_sec: float | None,
        tflops: float | None,
        skipped: bool,
        memory_gb: float | None,
    ) -> None:
        """One sample per instrument; None values are not recorded."""
        inst = self.instruments
        if not inst or self._closed:
            return
        inst[Metric.STEP_DURATION_MS].record(step_ms)
        inst[Metric.SKIPPED_ITERS].add(1 if skipped else 0)
        for metric, value in (
            (Metric.LOSS, loss),
            (Metric.GRAD_NORM, grad_norm),
            (Metric.LEARNING_RATE, learning_rate),
            (Metric.TOKENS_PER_SEC, tokens_per_sec),
            (Metric.THROUGHPUT_TFLOPS, tflops),
            (Metric.MEMORY_ALLOCATED_GB, memory_gb),
        ):
            if value is not None:
                inst[metric].set(float(value))

    # --- the export thread ----------------------------------------------------------------------

    def span_counts(self) -> dict[str, Any]:
        """Where every span handed to this runtime went: ``emitted`` (taken from the queue so far,
        plus any still queued) = ``delivered`` + ``spooled`` + ``dropped``, with ``pending`` the
        spans still queued or in flight and ``dropped_by`` the reasons (after shutdown
        ``pending`` is 0)."""
        with self._lock:
            queued = len(self.queue)
            inflight = len(self._inflight_spans or ())
            dropped = dict(self._dropped)
            return {
                "emitted": self._taken + queued,
                "delivered": self._delivered,
                "spooled": self.spool.spans,
                "dropped": sum(dropped.values()),
                "dropped_by": dropped,
                "pending": queued + inflight,
            }

    def _write_span_counts(self, counts: dict[str, Any]) -> None:
        """Leave ``counts`` in the run directory for the launcher's end-of-run report (never
        raises: telemetry must not break a run's end)."""
        path = lay.span_counts_file(self.run_dir, self.rank)
        with contextlib.suppress(Exception):
            write_json(path, {**counts, "rank": self.rank, "spool": str(self.spool.traces.path)})

    def _drop(self, reason: str, n: int) -> None:
        """Count ``n`` spans as dropped for ``reason`` (the caller logged why; call locked)."""
        if n:
            self._dropped[reason] = self._dropped.get(reason, 0) + n

    def _on_encode_drop(self, cause: str, message: str) -> None:
        self.log_once(f"encode:{cause}", "mlaunch telemetry: %s", message)

    def _take_batch(self) -> list[Any] | None:
        """The next batch (oldest first, at most BATCH_SIZE), marked in flight; None when the queue
        is empty or shutdown gave up on this thread. The rest stays queued, so at the deadline
        shutdown finds everything that is not in flight still in the queue."""
        with self._lock:
            if self._abandoned:
                return None
            queue = self.queue
            excess = len(queue) - MAX_PENDING_SPANS
            if excess > 0 and type(self.sink) is not Sink:  # "none" keeps nothing anyway
                # The exporter cannot keep up: keep memory bounded, put the oldest in the spool.
                self.log_once(
                    "behind", "mlaunch telemetry: exporter falling behind; spooling spans"
                )
                pop = queue.popleft
                old = [pop() for _ in range(excess)]
                self._taken += excess
                self.spool.write_spans(old)
            n = min(len(queue), BATCH_SIZE)
            if not n:
                return None
            pop = queue.popleft
            batch = [pop() for _ in range(n)]
            self._taken += n
            self._inflight_spans = batch
        if self.tee is not None:
            with contextlib.suppress(Exception):
                self.tee.write(self.encoder.json_line(batch)[0])
        return batch

    def _deliver(self, kind: str, payload: Any) -> None:
        """Export one batch (span batches come marked in flight by ``_take_batch``); on failure
        log once per cause and spool it."""
        spans = kind == "spans"
        spool = self.spool.write_spans if spans else self.spool.write_metrics
        if time.monotonic() < self._backoff_until:
            with self._lock:
                if not self._abandoned:
                    spool(payload)
                    self._inflight_spans = None
            return
        with self._lock:
            if self._abandoned:
                return
            if not spans:
                self._inflight_metrics = payload
        dropped = 0
        try:
            if spans:
                dropped = self.sink.export_spans(payload, self.encoder)
            else:
                self.sink.export_metrics(payload)
            failed = None
            self._backoff_s = FIRST_FAILURE_BACKOFF_S
        except Exception as exc:
            failed = exc
        with self._lock:
            self._inflight_spans = self._inflight_metrics = None
            if self._abandoned:  # shutdown gave up on us and spooled this batch already
                return
            if failed is None:
                if spans:
                    self._delivered += len(payload) - dropped
                    self._drop("cannot be encoded", dropped)
                return
            self.log_once(
                f"export:{kind}:{type(failed).__name__}:{failed}",
                "mlaunch telemetry: %s export failed (%s); undelivered data goes to %s",
                kind,
                failed,
                self.spool.traces.path if spans else self.spool.metrics.path,
            )
            self._backoff_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(FAILURE_BACKOFF_S, 2 * self._backoff_s)
            spool(payload)

    def _flush_spans(self) -> None:
        """Export what is queued, one batch at a time."""
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            self._deliver("spans", batch)

    def _collect_metrics(self) -> Any:
        if self.reader is None:
            return None
        try:
            return self.reader.get_metrics_data()
        except Exception as exc:
            self.log_once("collect", "mlaunch telemetry: metric collection failed (%s)", exc)
            return None

    def _run(self) -> None:
        next_metrics = time.monotonic() + self.metric_interval_s
        while True:
            stopping = self._stop.wait(DRAIN_INTERVAL_S)
            try:
                self._flush_spans()
                if stopping or time.monotonic() >= next_metrics:
                    next_metrics = time.monotonic() + self.metric_interval_s
                    data = self._collect_metrics()
                    if data is not None and data.resource_metrics:
                        self._deliver("metrics", data)
            except Exception as exc:  # never let the export thread die silently
                self.log_once(
                    f"thread:{type(exc).__name__}", "mlaunch telemetry: export error (%s)", exc
                )
            if stopping:
                return

    # --- shutdown -------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float | None = None) -> None:
        """End open spans (truncated), flush, and stop within ``timeout_s`` (hard deadline).

        At the deadline everything not confirmed delivered (the batch in flight and the whole
        queue) goes to the spool; the warning states where every span went."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + max(0.0, float(timeout))
        try:
            atexit.unregister(self.shutdown)
            for entry in _spans.all_open_spans():
                with contextlib.suppress(Exception):
                    entry.truncate()
            _spans.clear_stacks()
            self._stop.set()
            self.thread.join(max(0.0, deadline - time.monotonic()))
            stuck = self.thread.is_alive()
            with self._lock:
                # Stuck exporter (hanging or unreachable endpoint), or a thread that died: spool
                # what is left. The export thread checks _abandoned under this lock, so a batch
                # is either delivered and counted by it, or spooled here, never both or neither.
                self._abandoned = True
                inflight_spans, self._inflight_spans = self._inflight_spans, None
                inflight_metrics, self._inflight_metrics = self._inflight_metrics, None
                queue = self.queue
                rest = [queue.popleft() for _ in range(len(queue))]
                self._taken += len(rest)
                self.spool.write_spans((inflight_spans or []) + rest)
            if stuck:
                self.spool.write_metrics(inflight_metrics)
                data = self._collect_metrics()
                if data is not None and data.resource_metrics:
                    self.spool.write_metrics(data)
                self.log_once(
                    "deadline",
                    "mlaunch telemetry: export did not finish within %.1fs; gave up on the exporter",
                    timeout,
                )
            counts = self.span_counts()
            if self.remote:
                self._write_span_counts(counts)
            if counts["spooled"] or counts["dropped"] or self.spool.metric_batches:
                reasons = ", ".join(f"{n} {why}" for why, n in counts["dropped_by"].items())
                log.warning(
                    "mlaunch telemetry: spans could not be delivered: %d emitted = %d delivered "
                    "+ %d spooled + %d dropped%s; spans kept in %s, and %d metric batches in %s",
                    counts["emitted"],
                    counts["delivered"],
                    counts["spooled"],
                    counts["dropped"],
                    f" ({reasons})" if reasons else "",
                    self.spool.traces.path,
                    self.spool.metric_batches,
                    self.spool.metrics.path,
                )
            if self.log_bridge is not None:
                self.log_bridge.detach()
        except Exception as exc:
            self.log_once("shutdown", "mlaunch telemetry: shutdown error (%s)", exc)
        finally:
            self.spool.close()
            if self.tee is not None:
                self.tee.close()
            # Closing exporters (gRPC channels) can block; never past the deadline.
            closer = threading.Thread(target=self._close_quietly, daemon=True)
            closer.start()
            closer.join(max(0.0, deadline - time.monotonic()))

    def _close_quietly(self) -> None:
        try:
            self.sink.close()
            if self.log_bridge is not None:
                self.log_bridge.shutdown()
        except Exception:
            pass
