"""mlaunch's telemetry runtime: the public API instrumented code uses.

Instrumented code (the trainer, user scripts) imports only this module. It never imports torch,
and imports the OpenTelemetry SDK only on an exporting rank with telemetry enabled (in
``mlaunch.telemetry._runtime``); with only ``opentelemetry-api`` installed everything is a no-op.

Hot path
    ``span(group, name)`` checks ``group`` against a module-level frozenset and, when the group is
    off, returns one preallocated null span: no generator, no span, no context object. It is its
    own context manager and has the span methods instrumented code calls, all doing nothing, so
    ``with span(...) as s: s.set_attribute(...)`` needs no "is telemetry on" branch. Disabled
    telemetry has an empty enabled set, and so has a non-exporting rank but for the groups its
    flight recorder keeps and a running live capture adds. Inside
    :func:`suppressed` every span of the calling thread is that null span, and no span context is
    handed on (:func:`inject`, :func:`current_context_ints`).

One route, three span paths, one stack
    Every constructor (``span``, ``linked_span``, ``device_span``, ``deferred_linked_span``,
    ``trace_region``, ``trace_fn``) goes through :func:`span`'s route, in one order: off (or
    suppressed) -> the null span; a group of the flight recorder -> a recorded span; an exported
    fine group -> a record; a group a live capture added -> exported and marked with its id;
    anything else -> an SDK span. The others only add what they carry to what it returns (a link,
    device timing). Groups in ``FINE_GRAINED_GROUPS`` (microbatch, layer, communication,
    activation_offload, trace_region) go through a record: the training thread stores name, ids,
    parent, times, attributes and links, and the export thread turns records into SDK spans.
    Other groups are SDK spans. A recorded span (``_recorder``) is kept in the flight recorder's
    ring of the last iterations, on every rank, and written only when a trigger dumps it. All
    three push onto one per-thread stack, so parents are right in every direction. Fine spans are
    not attached to the OTel context (that would cost what the record saves): OTel-instrumented
    code inside a fine span sees the nearest coarse span as current.

State and identity
    Everything between :func:`setup` and :func:`shutdown` lives in one state object
    (``_core.Core``); the route reads a few module globals that ``_publish`` alone derives from
    it. The worker's identity (run id, incarnation, block size, run directory) is derived once in
    ``setup`` (``_core.worker_identity``) and handed to the runtime (the exporter), the flight
    recorder, the request watcher and the progress beat.

Live capture and the flight recorder
    ``mlaunch trace capture`` asks a running worker, through a request file its watcher thread
    reads, for a window of extra groups (a live capture, switched on and off at iteration
    boundaries by ``set_iteration``: the state machine is in ``_capture``) or a dump of the
    flight recorder. Under ``mlaunch train`` the same thread keeps this rank's progress beat and
    answers the launcher's hang requests, with telemetry on or off.

Trace structure and identity (as Megatron-LM's code emits them)
    A worker emits no run-long span. ``megatron.startup`` is the root of the start-up trace;
    training runs in ``megatron.train`` blocks of ``save_interval`` iterations (``setup``'s
    ``save_interval``; K = ``trace_segment_iters`` when there are no saves), each the root of
    a new trace. Every rank derives the same trace ids from the run id, the incarnation (the
    restart count, ``dl.restart_count`` or ``TORCHELASTIC_RESTART_COUNT``, and Megatron-LM's
    ``nemo.lens.run_uuid``, which a SLURM requeue changes too) and the block, with no
    communication (``T`` = the first 128 bits of a SHA-256, so ids are stable, distinct per
    restart, and identical on every rank):

    - until the first ``set_iteration`` call, root spans get ``T(run_id, incarnation, "startup")``;
    - ``set_iteration(it)`` (call it before each train step and before opening a block, outside
      the step span) switches root spans to ``T(run_id, incarnation, (it - 1) // N)``; iterations
      1..N are block 0, so the save after iteration N belongs to block 0;
    - a root ``megatron.startup`` carries a Link to the launcher's attempt span when the worker
      was started with a valid ``TRACEPARENT`` (an invalid one is ignored, logged once); a root
      ``megatron.train`` carries a Link to the previous block, the first one to the startup
      span, and ``mlaunch.train.block`` = its block number;
    - a script that keeps one ``with span(JOB, TRAIN)`` open across blocks still gets one trace
      per block: when ``set_iteration`` enters a new block while ``megatron.train`` is the
      innermost open span of the calling thread, that span ends and a new root
      ``megatron.train`` starts in the new trace (same attributes, linked to the previous one);
      the object the ``with`` yielded stays the first block's (ended) span;
    - child spans always share their parent's trace id; a span with no open parent on its
      thread is a root in the current trace.

Shutdown
    The handle :func:`setup` returns is the end-of-job context manager: ``with setup(...):``
    shuts telemetry down when the job's block is left, however it is left. ``shutdown()`` is
    idempotent, ends still-open spans with ``nemo.span.truncated=true``,
    and returns within ``shutdown_timeout_s`` even when the endpoint hangs; undelivered spans and
    metrics go to the spool files of the run directory. An atexit hook calls it; no signal
    handlers are installed (the trainer calls ``shutdown`` from its own SIGTERM handling).
    A second ``setup`` while telemetry is active raises ``RuntimeError``; after ``shutdown``
    a new ``setup`` is allowed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from threading import Lock, get_ident
from typing import TYPE_CHECKING, Any

from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import GOODPUT_SPAN_NAMES, Attr, region_name
from mlaunch.model.strategies import should_export
from mlaunch.otlp import traceparent
from mlaunch.telemetry import _capture, _devicetime, _spans
from mlaunch.telemetry._context_ints import context_from_ints, context_ints
from mlaunch.telemetry._core import ALL_FINE, Core, Identity, worker_identity
from mlaunch.telemetry._devicetime import CudaEventTimer, HostClock
from mlaunch.telemetry._recorder import RECORDER, RecordedSpan
from mlaunch.telemetry._recorder import RootRecordedSpan as _RootRecorded
from mlaunch.telemetry._spans import CoarseSpan, FineSpan

if TYPE_CHECKING:  # the type only: importing the telemetry API never loads pydantic
    from mlaunch.settings import TelemetrySettings

log = logging.getLogger("mlaunch.telemetry")

__all__ = [
    "Telemetry",
    "setup",
    "shutdown",
    "is_enabled",
    "span",
    "NullSpan",
    "suppressed",
    "linked_span",
    "device_span",
    "deferred_linked_span",
    "set_event_timer",
    "device_mark",
    "resolve_device_spans",
    "CudaEventTimer",
    "HostClock",
    "trace_region",
    "trace_fn",
    "set_iteration",
    "inject",
    "extract",
    "current_context_ints",
    "context_from_ints",
    "record_step",
    "recorder_step",
    "recorder_dump",
    "recorder_active",
    "set_profiler_hooks",
]

#: Everything this process's telemetry holds (the handle, the runtimes, the worker's identity, the
#: groups by route): the one state object. The span constructors read the module globals below,
#: which :func:`_publish` alone derives from it.
_CORE = Core()

# The hot path's routes (see ``Core.routes``), published from :data:`_CORE`. Plain ``str``
# members (not the StrEnum) so membership tests hash and compare at C speed whether callers pass
# ``SpanGroup.X`` or ``"x"``.
_ENABLED: frozenset[str] = frozenset()
_FINE: frozenset[str] = frozenset()
#: The flight recorder's groups this rank does not export (recorded, see ``_recorder``); also
#: members of ``_ENABLED``, so the disabled path pays nothing more.
_RECORDED: frozenset[str] = frozenset()
#: The groups a running live capture adds (exported, each span marked with the capture's id
#: :data:`_CAPTURE_VALUE`); checked after the fine and recorded paths, so outside a capture
#: they pay nothing for it.
_CAPTURED: frozenset[str] = frozenset()
_CAPTURE_VALUE = ""
_CAPTURE_ID = Attr.CAPTURE_ID.value
_ALL_FINE: frozenset[str] = ALL_FINE
#: Names that carry ``is_goodput_span=true`` (Megatron-LM's marks; none is fine-grained).
_GOODPUT: frozenset[str] = GOODPUT_SPAN_NAMES
_IS_GOODPUT = Attr.IS_GOODPUT.value
_TRACE_REGION = SpanGroup.TRACE_REGION.value
#: The threads inside :func:`suppressed`. Consulted only after a group is found enabled, so the
#: disabled path never pays for it.
_SUPPRESSED: set[int] = set()
#: ``bool(_SUPPRESSED)``, kept with it under :data:`_SUPPRESSED_LOCK`: an enabled span tests this
#: bool first, which costs about half of what asking a set for its truthiness does.
_ANY_SUPPRESSED = False
_SUPPRESSED_LOCK = Lock()


def _publish() -> None:
    """Derive the hot path's routes from :data:`_CORE` (after setup, a capture's switch,
    shutdown, a fork): the one writer of those globals."""
    global _ENABLED, _FINE, _RECORDED, _CAPTURED, _CAPTURE_VALUE
    _ENABLED, _FINE, _RECORDED, _CAPTURED = _CORE.routes()
    _CAPTURE_VALUE = _CORE.capture_id


class Telemetry:
    """Handle returned by :func:`setup`."""

    def __init__(
        self,
        enabled_groups: frozenset[str] = frozenset(),
        exporting: bool = False,
        runtime: Any = None,
    ) -> None:
        #: The groups whose spans this process creates (empty on non-exporting ranks).
        self.enabled_groups = enabled_groups
        #: Whether this rank exports telemetry.
        self.exporting = exporting
        self._runtime = runtime

    @property
    def run_dir(self) -> Path | None:
        """The run directory telemetry writes to (None when not exporting)."""
        return self._runtime.run_dir if self._runtime is not None else None

    @property
    def tracer_provider(self) -> Any:
        """The SDK TracerProvider (None when not exporting), for OTel-instrumented libraries."""
        return self._runtime.tracer_provider if self._runtime is not None else None

    @property
    def meter_provider(self) -> Any:
        """The SDK MeterProvider (None when not exporting or metrics are off)."""
        return self._runtime.meter_provider if self._runtime is not None else None

    def span_counts(self) -> dict[str, Any] | None:
        """Where the spans handed to telemetry went (None when not exporting): ``emitted`` =
        ``delivered`` + ``spooled`` + ``dropped`` (+ ``pending``, 0 after shutdown), and
        ``dropped_by`` (reason -> count). The shutdown warning states the same numbers."""
        return self._runtime.span_counts() if self._runtime is not None else None

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush and stop exporters within a hard deadline; idempotent."""
        if _CORE.handle is self:
            shutdown(timeout_s)
        elif self._runtime is not None:
            self._runtime.shutdown(timeout_s)

    # The end of the job: ``with telemetry.setup(...):`` around it shuts telemetry down on every
    # way out (a return, an exception), so instrumented code never calls shutdown itself.
    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.shutdown()
        return False


def setup(
    settings: TelemetrySettings | None = None,
    *,
    rank: int,
    world_size: int,
    local_rank: int = 0,
    resource: Mapping[str, Any] | None = None,
    run_dir: str | Path | None = None,
    save_interval: int = 0,
) -> Telemetry:
    """Configure telemetry for this process.

    ``settings`` None reads them from the environment, as a torchrun worker does
    (``mlaunch.settings.load_telemetry_settings``). ``resource`` holds extra resource attributes
    (parallel sizes/ranks, batch size, model dims, precision, ``host.gpu.count``,
    ``dl.restart_count``). ``run_dir`` overrides ``MLAUNCH_RUN_DIR`` / ``./runs/<run_id>``.
    ``save_interval`` > 0 makes each ``megatron.train`` block that many iterations (else
    ``trace_segment_iters``).

    The export strategy decides whether this rank exports; a non-exporting rank gets an empty
    enabled set. Raises ``RuntimeError`` if telemetry is already set up in this process, and
    ``mlaunch.settings.SettingsError`` for invalid settings; exporter problems are only logged.
    """
    core = _CORE
    if core.handle is not None:
        raise RuntimeError(
            "mlaunch telemetry is already set up in this process; call shutdown() first"
        )
    core.off_reason = None
    if settings is None:
        from mlaunch.settings import load_telemetry_settings

        settings = load_telemetry_settings()
    telemetry_on = bool(settings.enabled) and not settings.otel.sdk_disabled
    exporting = (
        telemetry_on
        and should_export(
            settings.export_strategy,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            export_rank=settings.export_rank,
            sample_rate=settings.export_sample_rate,
        )
        and (settings.traces_enabled or settings.metrics_enabled or settings.logs_enabled)
    )
    identity = None
    if telemetry_on or _under_launcher():
        try:  # once: the runtime, the recorder, the watcher and the beat all get this one
            identity = worker_identity(
                settings,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                resource=resource,
                run_dir=run_dir,
                save_interval=save_interval,
                environ=os.environ,
            )
        except Exception as exc:  # telemetry must never stop training from starting
            if exporting:
                _turn_off(f"setup failed ({type(exc).__name__}: {exc})")
                exporting = False
            else:
                log.warning("mlaunch telemetry: run identity unavailable (%s); no recorder", exc)
            # No recorder and no captures, but under ``mlaunch train`` the progress beat (and
            # the reason telemetry is off) still go: the run and its directory without the
            # caller's block size and resource, which are what can be wrong here.
            telemetry_on = False
            with contextlib.suppress(Exception):
                identity = worker_identity(
                    settings,
                    rank=rank,
                    world_size=world_size,
                    local_rank=local_rank,
                    resource=None,
                    run_dir=run_dir,
                    save_interval=0,
                    environ=os.environ,
                )
    runtime = _start_runtime(settings, identity) if exporting and identity is not None else None
    handle = Telemetry()
    if runtime is not None:
        groups = (
            frozenset(str(getattr(g, "value", g)) for g in settings.groups)
            if settings.traces_enabled
            else frozenset()
        )
        handle = Telemetry(groups, True, runtime)
    core.handle, core.settings, core.identity = handle, settings, identity
    core.runtime, core.exported = runtime, handle.enabled_groups
    if telemetry_on and identity is not None:
        core.recorded = _start_recorder(settings, identity, own_trace_ids=runtime is None)
    _publish()
    if identity is not None:
        _start_watch(settings, identity, telemetry_on)
    return handle


def _under_launcher() -> bool:
    """Whether this worker runs under ``mlaunch train`` (``MLAUNCH_RUN_DIR`` set)."""
    from mlaunch import envcontract

    return bool(os.environ.get(envcontract.RUN_DIR, "").strip())


def _turn_off(reason: str) -> None:
    """This rank's telemetry is off although it was asked for: say why (the progress beat
    carries the reason to the launcher's console)."""
    _CORE.off_reason = reason
    log.warning("mlaunch telemetry: %s; telemetry is off", reason)


def _start_runtime(settings: TelemetrySettings, identity: Identity) -> Any:
    """This exporting rank's runtime; None (and the reason noted) when it cannot start."""
    try:
        from mlaunch.telemetry._runtime import Runtime
    except ImportError as exc:  # only opentelemetry-api installed: stay a no-op
        _turn_off(f"OpenTelemetry SDK unavailable ({exc})")
        return None
    try:
        return Runtime(settings, identity, environ=os.environ)
    except Exception as exc:  # telemetry must never stop training from starting
        _turn_off(f"setup failed ({type(exc).__name__}: {exc})")
        return None


def _start_recorder(
    settings: TelemetrySettings, identity: Identity, *, own_trace_ids: bool
) -> frozenset[str]:
    """Start the flight recorder on this rank (every rank, exporting or not) when telemetry is
    on and ``recorder_groups`` names groups this rank does not export; returns those groups."""
    spec = getattr(settings, "recorder_group_set", frozenset())
    if not spec:
        return frozenset()
    recorded = frozenset(str(getattr(g, "value", g)) for g in spec) - _CORE.exported
    if not recorded:
        return frozenset()
    try:
        from mlaunch.telemetry._recorder import recorder_resource

        RECORDER.start(
            iters=int(settings.recorder_iters),
            max_bytes=int(float(settings.recorder_max_mib) * (1 << 20)),
            slow_factor=float(settings.recorder_slow_factor),
            resource=recorder_resource(
                settings,
                run_id=identity.run_id,
                rank=identity.rank,
                world_size=identity.world_size,
                local_rank=identity.local_rank,
                extra=identity.resource,
            ),
            own_trace_ids=own_trace_ids,
            identity=identity,
        )
    except Exception as exc:  # the recorder must never stop training from starting
        log.warning("mlaunch telemetry: flight recorder setup failed (%s); it is off", exc)
        return frozenset()
    return recorded


def _start_watch(settings: TelemetrySettings, identity: Identity, telemetry_on: bool) -> None:
    """Watch the run directory's request file on this rank: with telemetry on, for live
    captures, recorder dumps and the launcher's hang requests (and, under ``mlaunch train``, the
    progress beat); with it off, under ``mlaunch train`` only, for the beat and hang requests
    (one ``stat`` a second; the command refuses captures on such a run)."""
    from mlaunch.rundir import layout as lay

    under_launcher = _under_launcher()
    if not telemetry_on and not under_launcher:
        return
    where, rank = identity.run_dir, identity.rank

    def on_hang(request_id: str, open_spans: bool) -> None:
        from mlaunch.telemetry._recorder import write_open_spans

        if open_spans:
            path = where / lay.HANG_DIR / lay.HANG_SPANS_FILE.name(rank)
            write_open_spans(path, rank, request_id)
        RECORDER.dump("hang")  # no-op when the recorder is off

    try:
        _capture.start_watcher(
            identity,
            _CORE.started_ns,
            RECORDER.request_dump,
            exporting=_CORE.runtime is not None,
            # A console or "none" run leaves no files unasked (the CLI still learns its world
            # size from resolved.json).
            announce=telemetry_on and settings.exporter not in ("console", "none"),
            prepare=functools.partial(_capture.prepare_exporter, _CORE),
            captures=telemetry_on,
            heartbeat=lay.heartbeat_file(where, rank) if under_launcher else None,
            mark=lambda: RECORDER.mark,
            on_hang=on_hang,
            telemetry_off=_CORE.off_reason,
        )
    except Exception as exc:  # captures and the beat are optional; never stop training
        log.warning("mlaunch telemetry: capture requests are off (%s)", exc)


def set_profiler_hooks(
    start: Callable[[Path], Any] | None, stop: Callable[[Any, dict[str, Any]], None] | None = None
) -> None:
    """Install the profiler a live capture with ``--profiler`` runs (mlaunch's trainer installs
    torch.profiler; telemetry never imports torch): ``start(path)`` starts it and returns a
    handle, ``stop(handle, metadata)`` stops it and writes the trace to ``path`` with
    ``metadata`` (capture id, rank, the run's trace ids) in it. None removes them."""
    _CORE.profiler_hooks = (start, stop) if start is not None and stop is not None else None


def _forget_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) inherits the state but not the export thread:
    make telemetry a no-op there instead of queueing spans nobody exports."""
    for rt in (_CORE.runtime, _CORE.capture_runtime):
        if rt is not None:
            rt._closed = True  # its atexit hook must not flush the parent's data from here
    RECORDER.stop()
    _capture.CONTROL.reset()
    _CORE.forget()
    _publish()
    _devicetime.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def shutdown(timeout_s: float | None = None) -> None:
    """Shut down the process's telemetry (idempotent): ends open spans as truncated, exports or
    spools everything within the hard deadline (``shutdown_timeout_s`` by default)."""
    core = _CORE
    with contextlib.suppress(Exception):
        _capture.end_at_shutdown(core)
    _capture.stop_watcher()
    runtime = core.active_runtime
    extra = core.capture_runtime if core.capture_runtime is not runtime else None
    core.forget()
    _publish()  # new spans are no-ops from here on
    RECORDER.stop()  # what was not dumped on a trigger is dropped (it was never to be exported)
    with contextlib.suppress(Exception):  # device-timed spans still pending leave, host-timed
        _devicetime.resolve(None, final=True)
    _devicetime.reset()
    for rt in (runtime, extra):
        if rt is None:
            continue
        try:
            rt.shutdown(timeout_s)
        except Exception as exc:  # never raise into training
            log.warning("mlaunch telemetry: shutdown failed (%s)", exc)


def is_enabled(group: str) -> bool:
    """Whether spans of ``group`` are created here (in this process, and on this thread: not
    inside :func:`suppressed`)."""
    return group in _ENABLED and not (_ANY_SUPPRESSED and get_ident() in _SUPPRESSED)


class NullSpan:
    """The span every disabled (or suppressed) site gets: one shared instance, its own context
    manager, with the span methods instrumented code calls, all doing nothing.

    Its ``__enter__`` and ``__exit__`` are C callables, not Python methods, which takes two
    Python frames off every disabled ``with span(...)`` (about a third of its cost). ``with``
    looks both up on the type and, as neither is a descriptor, calls them without ``self``:
    ``__enter__`` is the ``__next__`` of an endless ``itertools.repeat`` of the one instance
    (``as s`` gets the null span itself), and ``"".format(exc_type, exc, tb)`` returns "" (false:
    an exception propagates).
    """

    __slots__ = ()
    __exit__ = "".format

    def set_attribute(self, key: str, value: Any) -> None:
        """Do nothing (the span is not recorded)."""

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Do nothing."""

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        """Do nothing."""

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """Do nothing."""

    def set_status(self, status: Any, description: str | None = None) -> None:
        """Do nothing."""

    def update_name(self, name: str) -> None:
        """Do nothing."""

    def is_recording(self) -> bool:
        """Always False: nothing is recorded."""
        return False

    def get_span_context(self) -> Any:
        """The invalid span context (as OTel's non-recording span has)."""
        from opentelemetry.trace import INVALID_SPAN_CONTEXT

        return INVALID_SPAN_CONTEXT


_NULL = NullSpan()
NullSpan.__enter__ = itertools.repeat(_NULL).__next__  # type: ignore[attr-defined]


def _suppressed_here() -> bool:
    """Whether the calling thread is inside :func:`suppressed` (only asked of enabled groups)."""
    return _ANY_SUPPRESSED and get_ident() in _SUPPRESSED


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """``with suppressed():`` — no tracing on this thread inside it: every span is the null
    span, and no span context is handed on (:func:`inject` writes nothing,
    :func:`current_context_ints` is all zeros), so code shared with traced paths (evaluation and
    generation reusing the training forward and the stage-to-stage exchange) needs no flag.
    Nests; other threads are unaffected."""
    global _ANY_SUPPRESSED
    ident = get_ident()
    if ident in _SUPPRESSED:
        yield
        return
    with _SUPPRESSED_LOCK:  # two threads leaving at once must not leave the flag stale
        _SUPPRESSED.add(ident)
        _ANY_SUPPRESSED = True
    try:
        yield
    finally:
        with _SUPPRESSED_LOCK:
            _SUPPRESSED.discard(ident)
            _ANY_SUPPRESSED = bool(_SUPPRESSED)


def _merged(attrs: Mapping[Any, Any], attributes: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` (keys may be ``Attr`` members) and the keyword attributes in one new dict of
    plain ``str`` keys, the type the encoder's fast path expects."""
    out = {}
    for key, value in attrs.items():  # a plain loop: a comprehension costs a frame more
        out[str(key)] = value  # str() of a str is itself; of an Attr member, its plain value
    if attributes:
        out.update(attributes)
    return out


def span(
    group: str,
    name: str,
    attrs: Mapping[Any, Any] | None = None,
    root: bool = False,  # not keyword-only: a keyword-only default costs the disabled path ~8 ns
    **attributes: Any,
) -> Any:
    """``with span(group, name, attrs) as s:`` — ``s`` is the span, or the null span
    (:class:`NullSpan`, whose methods do nothing) when the group is off.

    ``attrs`` is a mapping of attributes (keys may be ``Attr`` members); keyword attributes are
    added to it. ``root=True`` (pass it by name) starts a parentless span (a root in the current
    trace) whatever is open on this thread; spans opened inside it are its children as usual.

    The spans Megatron-LM marks (``SpanDef.goodput``) carry ``is_goodput_span=true``. A span left
    by an exception gets status ERROR and an ``exception`` event; the exception propagates.
    """
    if group not in _ENABLED:
        return _NULL
    if _ANY_SUPPRESSED and get_ident() in _SUPPRESSED:
        return _NULL
    # Recorded before fine: the recorded path is the one with the tighter budget (an exported
    # fine span costs its export many times over anyway); a rank's two sets never overlap.
    if group in _RECORDED:  # new_recorded() inlined: a Python frame less per recorded span
        # ``RecordedSpan()`` (no ``__init__``): type_call is cheaper than ``object.__new__(cls)``,
        # which parses its arguments through ``tp_new_wrapper`` (about 280 instructions less).
        rec = _RootRecorded() if root else RecordedSpan()
        rec.name = name
        # A copy in C: keys stay as given (Attr members); a dump converts them when it encodes.
        rec.attributes = attributes if attrs is None else {**attrs, **attributes}
        return rec
    if attrs is not None:
        attributes = _merged(attrs, attributes)
    if group in _FINE:
        return FineSpan(name, attributes, None, root)
    if group in _CAPTURED:  # a live capture added the group: exported, marked with its id
        attributes[_CAPTURE_ID] = _CAPTURE_VALUE
        if group in _ALL_FINE:
            return FineSpan(name, attributes, None, root)
    if name in _GOODPUT:
        attributes[_IS_GOODPUT] = True
    return CoarseSpan(name, attributes, None, root)


def linked_span(
    group: str,
    name: str,
    carrier_or_context: Any,
    attrs: Mapping[Any, Any] | None = None,
    **attributes: Any,
) -> Any:
    """Like :func:`span`, with an OTel Link to the span context in ``carrier_or_context``.

    ``carrier_or_context`` is a W3C carrier dict (``traceparent``), a ``SpanContext`` (from
    :func:`extract` or :func:`context_from_ints`), or None (no link). A recorded span carries no
    link (a dump has none).
    """
    s = span(group, name, _joined(attrs, attributes))  # the route: span's, with its order
    if type(s) is FineSpan or type(s) is CoarseSpan:
        s.links = _links(carrier_or_context)
    return s


def device_span(
    group: str, name: str, attrs: Mapping[Any, Any] | None = None, **attributes: Any
) -> Any:
    """Like :func:`span`, for a span that covers device work: with an event timer installed
    (:func:`set_event_timer`; the trainer installs CUDA events on a GPU) its start and end are
    device events, and its times are resolved at the step's sync point
    (:func:`resolve_device_spans`); without one it is exactly :func:`span`. Exported
    fine-grained groups only (any other group gets what :func:`span` gives it)."""
    s = span(group, name, _joined(attrs, attributes))  # the route: span's, with its order
    if _devicetime.TIMER is not None and type(s) is FineSpan and group in _FINE:
        return _devicetime.DeviceTimedSpan.around(s)
    return s


def deferred_linked_span(
    group: str,
    name: str,
    read_ints: Callable[[], Any],
    attrs: Mapping[Any, Any] | None = None,
    **attributes: Any,
) -> Any:
    """A span linked to the span context ``read_ints()`` returns (as :func:`context_from_ints`
    takes it), read only at the step's sync point (:func:`resolve_device_spans`), so the context can
    sit in a buffer a device copy fills without anyone waiting for it. Exported fine-grained groups
    only: any other group reads the context now (a coarse or captured span, as
    :func:`linked_span`), or never (a recorded span: dumps carry no links, and the buffer may
    still be filling)."""
    s = span(group, name, _joined(attrs, attributes))  # the route: span's, with its order
    if type(s) is FineSpan:
        if group in _FINE:
            return _devicetime.DeviceTimedSpan.around(s, read_ints)
        s.links = _links(context_from_ints(read_ints()))
    elif type(s) is CoarseSpan:
        s.links = _links(context_from_ints(read_ints()))
    return s


def _joined(attrs: Mapping[Any, Any] | None, attributes: dict[str, Any]) -> Mapping[Any, Any]:
    """The ``attrs`` and keyword attributes of a constructor built on :func:`span`, as the one
    mapping :func:`span` takes (so an attribute named like one of its parameters stays an
    attribute)."""
    if attrs is None:
        return attributes
    return {**attrs, **attributes} if attributes else attrs


def _links(carrier_or_context: Any) -> list[Any] | None:
    """``[Link(context)]`` for a carrier dict or a span context; None when there is no valid
    one. Never raises (a bad carrier must not break training)."""
    try:
        ctx = carrier_or_context
        if isinstance(ctx, Mapping):
            ctx = extract(ctx)
        if ctx is not None and getattr(ctx, "is_valid", False):
            from opentelemetry.trace import Link

            return [Link(ctx)]
    except Exception as exc:
        log.debug("mlaunch telemetry: ignoring bad link context (%s)", exc)
    return None


def set_event_timer(timer: Any) -> None:
    """Install the event timer device-timed spans use (None: host clocks)."""
    _devicetime.TIMER = timer


def device_mark() -> Any:
    """Record the anchor event just before the step's existing sync point."""
    return _devicetime.mark()


def resolve_device_spans(anchor: Any) -> int:
    """Right after the sync that followed :func:`device_mark`: give pending device-timed spans
    their device times (and deferred links) and hand them to the exporter. Never raises."""
    try:
        return _devicetime.resolve(anchor)
    except Exception as exc:  # telemetry never breaks training
        log.debug("mlaunch telemetry: resolving device spans failed (%s)", exc)
        return 0


def trace_region(name: str, attrs: Mapping[Any, Any] | None = None, **attributes: Any) -> Any:
    """A ``megatron.region.<name>`` marker span in the ``trace_region`` group."""
    if _TRACE_REGION not in _ENABLED:
        return _NULL
    return span(_TRACE_REGION, region_name(name), attrs, **attributes)


def trace_fn(group: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: run the function inside ``span(group, name)`` (checked at call time)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if group not in _ENABLED:
                return fn(*args, **kwargs)
            with span(group, name):
                return fn(*args, **kwargs)

        return wrapper

    return deco


def set_iteration(iteration: int) -> None:
    """Tell telemetry which training iteration starts next (the ``megatron.train`` block's trace;
    see the module docstring). Call it before each train step, outside the step's span, and
    before opening the block's ``megatron.train``.

    A live capture switches here: this compare is all it costs the loop outside its
    boundaries (see ``_capture``)."""
    RECORDER.mark = (iteration, time.time())  # the progress beat the hang watchdog reads
    if iteration >= _capture.AT and _capture.boundary(_CORE, iteration):
        _publish()  # a live capture switched its groups on or off
    if RECORDER.active:
        try:
            RECORDER.set_iteration(int(iteration))
        except Exception as exc:
            log.warning("mlaunch telemetry: flight recorder: set_iteration failed (%s)", exc)
    runtime = _CORE.active_runtime
    if runtime is None:
        return
    try:
        runtime.set_iteration(int(iteration))
    except Exception as exc:
        log.warning("mlaunch telemetry: set_iteration failed (%s)", exc)


def recorder_active() -> bool:
    """Whether this process's flight recorder is on (any rank, exporting or not)."""
    return RECORDER.active


def recorder_step(step_ms: float) -> bool:
    """The flight recorder's slow check: the iteration that just finished took ``step_ms``;
    True when it is slower than ``recorder_slow_factor`` x the rolling median (the trainer then
    tells every rank through its per-step reduce, and each calls :func:`recorder_dump`)."""
    try:
        return RECORDER.note_step(step_ms)
    except Exception:  # never breaks training
        return False


def recorder_dump(trigger: str) -> int:
    """Write the flight recorder's ring out now (``trigger`` is one of ``RECORDER_TRIGGERS``);
    returns the number of spans written, 0 when the recorder is off. Never raises."""
    try:
        return RECORDER.dump(trigger)
    except Exception as exc:
        log.warning("mlaunch telemetry: flight recorder dump failed (%s)", exc)
        return 0


def _current_entry() -> Any:
    """The innermost open span of this thread; None inside :func:`suppressed` (nothing is handed
    on from there)."""
    if _suppressed_here():
        return None
    stack = _spans.current_stack()
    return stack[-1] if stack else None


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current span context into ``carrier`` (W3C ``traceparent``); no-op without one."""
    entry = _current_entry()
    if entry is None:
        return
    carrier["traceparent"] = (
        f"00-{entry.trace_id:032x}-{entry.span_id:016x}-{'01' if entry.sampled else '00'}"
    )


def extract(carrier: Mapping[str, str]) -> Any:
    """Read a span context (an OTel ``SpanContext``, remote) from ``carrier``; None when absent
    or malformed."""
    parsed = traceparent.parse(carrier.get("traceparent") if carrier else None)
    if parsed is None:
        return None
    try:
        from opentelemetry.trace import SpanContext, TraceFlags
    except ImportError:
        return None
    return SpanContext(parsed.trace_id, parsed.span_id, True, TraceFlags(parsed.flags & 0x01))


def current_context_ints() -> tuple[int, int, int, int]:
    """The current span context as four signed int64 values (trace id high/low, span id, flags),
    for carrying through a tensor; all zero when no span is recording. :func:`context_from_ints`
    turns them back into a context."""
    entry = _current_entry()
    if entry is None:
        return (0, 0, 0, 0)
    return context_ints(entry.trace_id, entry.span_id, entry.sampled)


def record_step(
    iteration: int,
    *,
    step_ms: float,
    loss: float | None = None,
    grad_norm: float | None = None,
    learning_rate: float | None = None,
    tokens_per_sec: float | None = None,
    tflops: float | None = None,
    skipped: bool = False,
    memory_gb: float | None = None,
) -> None:
    """Record the ``megatron.training.*`` metrics for one training iteration (exporting ranks
    only): one step-duration histogram sample, the gauges given, and the skipped-iterations
    counter."""
    runtime = _CORE.active_runtime
    if runtime is None:
        return
    try:
        runtime.record_step(
            iteration,
            step_ms,
            loss,
            grad_norm,
            learning_rate,
            tokens_per_sec,
            tflops,
            skipped,
            memory_gb,
        )
    except Exception as exc:
        runtime.log_once("record_step", "mlaunch telemetry: record_step failed (%s)", exc)
