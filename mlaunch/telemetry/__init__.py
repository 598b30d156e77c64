"""mlaunch's telemetry runtime: the public API instrumented code uses.

Instrumented code (the trainer, user scripts) imports only this module. It never imports torch,
and imports the OpenTelemetry SDK only on an exporting rank with telemetry enabled (in
``mlaunch.telemetry._runtime``); with only ``opentelemetry-api`` installed everything is a no-op.

Hot path
    ``span(group, name)`` checks ``group`` against a module-level frozenset and, when the group is
    off, returns one preallocated null span: no generator, no span, no context object. It is its
    own context manager and has the span methods instrumented code calls, all doing nothing, so
    ``with span(...) as s: s.set_attribute(...)`` needs no "is telemetry on" branch. A
    non-exporting rank, or disabled telemetry, has an empty enabled set. Inside
    :func:`suppressed` every span of the calling thread is that null span, and no span context is
    handed on (:func:`inject`, :func:`current_context_ints`).

Two span paths, one stack
    Groups in ``FINE_GRAINED_GROUPS`` (microbatch, layer, communication, activation_offload,
    trace_region) go through a record: the training thread stores name, ids, parent, times,
    attributes and links, and the export thread turns records into SDK spans. Other groups are
    SDK spans. Both push onto one per-thread stack, so parents are right in both directions.
    Fine spans are not attached to the OTel context (that would cost what the record saves):
    OTel-instrumented code inside a fine span sees the nearest coarse span as current.

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

from mlaunch.model.groups import FINE_GRAINED_GROUPS, SpanGroup
from mlaunch.model.segments import block_iterations
from mlaunch.model.spans import GOODPUT_SPAN_NAMES, Attr, region_name
from mlaunch.model.strategies import should_export
from mlaunch.otlp import traceparent
from mlaunch.telemetry import _capture, _devicetime, _spans
from mlaunch.telemetry._context_ints import context_from_ints, context_ints
from mlaunch.telemetry._devicetime import CudaEventTimer, HostClock
from mlaunch.telemetry._recorder import RECORDER, RecordedSpan, new_recorded
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

# The hot-path state. Plain ``str`` members (not the StrEnum) so membership tests hash and compare
# at C speed whether callers pass ``SpanGroup.X`` or ``"x"``.
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
_ALL_FINE: frozenset[str] = frozenset(g.value for g in FINE_GRAINED_GROUPS)
#: What ``setup`` was given (the on-demand exporter of a live capture is built from it).
_SETUP: dict[str, Any] | None = None
#: A live capture's exporter on a rank that exports nothing (built on demand, then idle).
_CAPTURE_RUNTIME: Any = None
#: The enabled sets and runtime from before a running capture (restored when it ends).
_SAVED: tuple[Any, ...] | None = None
#: ``set_profiler_hooks``: (start, stop), or None.
_PROFILER_HOOKS: tuple[Callable[..., Any], Callable[..., Any]] | None = None
#: When this process imported telemetry: a capture request written before it is not for it.
_STARTED_NS = time.time_ns()
#: Names that carry ``is_goodput_span=true`` (Megatron-LM's marks; none is fine-grained).
_GOODPUT: frozenset[str] = GOODPUT_SPAN_NAMES
_IS_GOODPUT = Attr.IS_GOODPUT.value
_TRACE_REGION = SpanGroup.TRACE_REGION.value
_RUNTIME: Any = None  # mlaunch.telemetry._runtime.Runtime on an exporting rank
_HANDLE: Telemetry | None = None
#: Why this rank's telemetry is off although it was asked for (its setup failed), or None: the
#: progress beat carries it to the launcher, which shows it on its console and in ``mlaunch
#: status`` (a warning in the rank's own log alone would go unseen).
_OFF_REASON: str | None = None
#: The threads inside :func:`suppressed`. Consulted only after a group is found enabled, so the
#: disabled path never pays for it.
_SUPPRESSED: set[int] = set()
#: ``bool(_SUPPRESSED)``, kept with it under :data:`_SUPPRESSED_LOCK`: an enabled span tests this
#: bool first, which costs about half of what asking a set for its truthiness does.
_ANY_SUPPRESSED = False
_SUPPRESSED_LOCK = Lock()


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
        if _HANDLE is self:
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
    global _ENABLED, _FINE, _RECORDED, _RUNTIME, _HANDLE, _OFF_REASON
    if _HANDLE is not None:
        raise RuntimeError(
            "mlaunch telemetry is already set up in this process; call shutdown() first"
        )
    _OFF_REASON = None
    if settings is None:
        from mlaunch.settings import load_telemetry_settings

        settings = load_telemetry_settings()
    handle = Telemetry()
    exporting = (
        bool(settings.enabled)
        and not settings.otel.sdk_disabled
        and should_export(
            settings.export_strategy,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            export_rank=settings.export_rank,
            sample_rate=settings.export_sample_rate,
        )
    )
    if exporting and not (
        settings.traces_enabled or settings.metrics_enabled or settings.logs_enabled
    ):
        exporting = False
    if exporting:
        try:
            from mlaunch.telemetry._runtime import Runtime
        except ImportError as exc:  # only opentelemetry-api installed: stay a no-op
            _OFF_REASON = f"OpenTelemetry SDK unavailable ({exc})"
            log.warning("mlaunch telemetry: %s; telemetry is off", _OFF_REASON)
            exporting = False
    if exporting:
        try:
            runtime = Runtime(
                settings,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                resource=resource,
                run_dir=run_dir,
                environ=os.environ,
                save_interval=save_interval,
            )
        except Exception as exc:  # telemetry must never stop training from starting
            _OFF_REASON = f"setup failed ({type(exc).__name__}: {exc})"
            log.warning("mlaunch telemetry: %s; telemetry is off", _OFF_REASON)
            exporting = False
    if exporting:
        groups = (
            frozenset(str(getattr(g, "value", g)) for g in settings.groups)
            if settings.traces_enabled
            else frozenset()
        )
        handle = Telemetry(groups, True, runtime)
        _RUNTIME = runtime
        _FINE = groups & frozenset(g.value for g in FINE_GRAINED_GROUPS)
        _ENABLED = groups
    _HANDLE = handle
    if not settings.enabled or settings.otel.sdk_disabled:
        _start_beat(settings, rank=rank, run_dir=run_dir)
        return handle
    try:
        identity = _identity(settings, handle, resource, run_dir, save_interval)
    except Exception as exc:  # the recorder and captures are optional; never stop training
        log.warning("mlaunch telemetry: run identity unavailable (%s); no recorder", exc)
        _start_beat(settings, rank=rank, run_dir=run_dir)  # the beat (and its reason) still go
        return handle
    recorded = _start_recorder(
        settings,
        handle,
        identity,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        resource=resource,
    )
    if recorded:
        _RECORDED = recorded
        _ENABLED = _ENABLED | recorded
    _start_capture_watch(
        settings,
        identity,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        resource=resource,
        save_interval=save_interval,
    )
    return handle


def _identity(
    settings: TelemetrySettings,
    handle: Telemetry,
    resource: Mapping[str, Any] | None,
    run_dir: str | Path | None,
    save_interval: int,
) -> tuple[str, str, int, Path]:
    """This rank's run id, incarnation, block size and run directory: the runtime's on an
    exporting rank, else derived by the same rules (``Runtime._init_identity``), so a rank that
    exports nothing still names the same traces and reads the same request file."""
    runtime = handle._runtime
    if runtime is not None:
        return runtime.run_id, runtime.incarnation, runtime.block_iters, runtime.run_dir
    from mlaunch import envcontract
    from mlaunch.model.identity import RUN_UUID, run_identity
    from mlaunch.model.spans import ResourceAttr
    from mlaunch.settings.run_id import choose_run_id, torchrun_shared_ids

    run_id = choose_run_id(settings.run_id, os.environ, shared=torchrun_shared_ids(os.environ))
    restart = dict(resource or {}).get(
        ResourceAttr.RESTART_COUNT, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    try:
        restart = int(restart)
    except (TypeError, ValueError):
        restart = 0
    incarnation = f"{restart}/{run_identity(os.environ)[RUN_UUID]}"
    block_iters = block_iterations(save_interval, settings.trace_segment_iters)
    where = Path(run_dir) if run_dir else envcontract.worker_run_dir(os.environ, run_id)
    return run_id, incarnation, block_iters, where


def _start_recorder(
    settings: TelemetrySettings,
    handle: Telemetry,
    identity: tuple[str, str, int, Path],
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    resource: Mapping[str, Any] | None,
) -> frozenset[str]:
    """Start the flight recorder on this rank (every rank, exporting or not) when telemetry is
    on and ``recorder_groups`` names groups this rank does not export; returns those groups."""
    spec = getattr(settings, "recorder_group_set", frozenset())
    if not spec:
        return frozenset()
    recorded = frozenset(str(getattr(g, "value", g)) for g in spec) - handle.enabled_groups
    if not recorded:
        return frozenset()
    try:
        from mlaunch import envcontract
        from mlaunch.telemetry._recorder import recorder_resource

        run_id, incarnation, block_iters, where = identity
        RECORDER.start(
            iters=int(settings.recorder_iters),
            max_bytes=int(float(settings.recorder_max_mib) * (1 << 20)),
            slow_factor=float(settings.recorder_slow_factor),
            path=envcontract.recorder_file(where, rank),
            resource=recorder_resource(
                settings,
                run_id=run_id,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                extra=resource,
            ),
            own_trace_ids=handle._runtime is None,
            run_id=run_id,
            incarnation=incarnation,
            block_iters=block_iters,
        )
    except Exception as exc:  # the recorder must never stop training from starting
        log.warning("mlaunch telemetry: flight recorder setup failed (%s); it is off", exc)
        return frozenset()
    return recorded


# ------------------------------------------------------------------------------------------------
# Live capture (``mlaunch trace capture --groups``; the request channel is ``_capture``)


def _start_capture_watch(
    settings: TelemetrySettings,
    identity: tuple[str, str, int, Path],
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    resource: Mapping[str, Any] | None,
    save_interval: int,
) -> None:
    """Watch the run directory's request file on this rank (any rank with telemetry on)."""
    global _SETUP
    run_id, incarnation, block_iters, where = identity
    _SETUP = {
        "settings": settings,
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "resource": resource,
        "run_dir": where,
        "save_interval": save_interval,
        "run_id": run_id,
        "incarnation": incarnation,
        "block_iters": block_iters,
    }
    try:
        _capture.start_watcher(
            where,
            run_id,
            rank,
            _STARTED_NS,
            RECORDER.request_dump,
            world_size=world_size,
            exporting=_HANDLE is not None and _HANDLE.exporting,
            # A console or "none" run leaves no files unasked (the CLI still learns its world
            # size from resolved.json).
            announce=settings.exporter not in ("console", "none"),
            prepare=_prepare_capture,
            **_hang_watch(where, rank),
        )
    except Exception as exc:  # captures are optional; never stop training for them
        log.warning("mlaunch telemetry: capture requests are off (%s)", exc)


def _hang_watch(where: Path, rank: int) -> dict[str, Any]:
    """The request watcher's part for the launcher's hang watchdog: its answer to a hang
    request and, under ``mlaunch train`` (``MLAUNCH_RUN_DIR`` set), this rank's progress beat."""
    from mlaunch import envcontract

    def on_hang(request_id: str, open_spans: bool) -> None:
        from mlaunch.telemetry._recorder import write_open_spans

        if open_spans:
            path = where / envcontract.HANG_DIR / envcontract.HANG_SPANS_FILE.name(rank)
            write_open_spans(path, rank, request_id)
        RECORDER.dump("hang")  # no-op when the recorder is off

    under_launcher = bool(os.environ.get(envcontract.RUN_DIR, "").strip())
    return {
        "heartbeat": envcontract.heartbeat_file(where, rank) if under_launcher else None,
        "mark": lambda: RECORDER.mark,
        "on_hang": on_hang,
        "telemetry_off": _OFF_REASON,
    }


def _start_beat(settings: TelemetrySettings, *, rank: int, run_dir: str | Path | None) -> None:
    """Under ``mlaunch train``, a rank with telemetry off still keeps a progress beat and
    answers the launcher's hang requests (the request watcher's thread, one ``stat`` a second);
    it takes no captures (the command refuses them on such a run)."""
    from mlaunch import envcontract

    if not os.environ.get(envcontract.RUN_DIR, "").strip():
        return
    try:
        from mlaunch.settings.run_id import choose_run_id, torchrun_shared_ids

        run_id = choose_run_id(settings.run_id, os.environ, shared=torchrun_shared_ids(os.environ))
        where = Path(run_dir) if run_dir else envcontract.worker_run_dir(os.environ, run_id)
        _capture.start_watcher(
            where, run_id, rank, _STARTED_NS, RECORDER.request_dump,
            world_size=0, exporting=False, announce=False, captures=False,
            **_hang_watch(where, rank),
        )  # fmt: skip
    except Exception as exc:  # never stops training from starting
        log.warning("mlaunch telemetry: progress beat not started (%s)", exc)


def _prepare_capture(capture: _capture.Capture) -> None:
    """Before a capture is armed (the watcher thread): on a rank that exports nothing, build
    the exporter now, off the training thread, with the run's settings (the same sink: file,
    OTLP or the embedded receiver), traces only and no rank sampling; the training thread
    installs it at the switch. It stays, idle, for later captures until shutdown."""
    global _CAPTURE_RUNTIME
    setup_args = _SETUP
    if setup_args is None:
        raise RuntimeError("telemetry is not set up")
    if _HANDLE is not None and _HANDLE._runtime is not None:
        return  # this rank exports: its runtime takes the captured spans
    capture.exporter_started = True
    if _CAPTURE_RUNTIME is not None:
        return
    from mlaunch.telemetry._runtime import Runtime

    settings = setup_args["settings"].model_copy(
        update={
            "traces_enabled": True,
            "metrics_enabled": False,
            "logs_enabled": False,
            "sampler_enabled": False,
        }
    )
    _CAPTURE_RUNTIME = Runtime(
        settings,
        rank=setup_args["rank"],
        world_size=setup_args["world_size"],
        local_rank=setup_args["local_rank"],
        resource=setup_args["resource"],
        run_dir=setup_args["run_dir"],
        environ=os.environ,
        save_interval=setup_args["save_interval"],
        install_now=False,
    )


def _capture_boundary(iteration: int) -> None:
    """The training thread reached :data:`_capture.AT`: start, continue or end the capture.
    While a capture runs this is called at every iteration (it notes how far the window got, so
    a run that ends inside it acks the right last iteration); outside one, never."""
    capture = _capture.CONTROL.capture
    try:
        if capture is None or capture.state in _capture.FINAL_STATES:
            _capture.AT = _capture.NEVER
            return
        if capture.state == "scheduled":
            if capture.end is not None and iteration >= capture.end:
                capture.state, capture.note = "missed", f"this rank was at iteration {iteration}"
                _capture.AT = _capture.NEVER
                _capture.CONTROL.changed()
                return
            _switch_on(capture, iteration)
            capture.last = iteration
            _capture.AT = iteration + 1
            _capture.CONTROL.changed()
            return
        if iteration == capture.last:  # set_iteration again for the same iteration
            return
        if capture.end is not None:
            over = iteration >= capture.end
        else:
            over = time.time_ns() >= capture.switched_ns + int(capture.seconds * 1e9)  # type: ignore[operator]
        if not over:
            capture.last = iteration
            _capture.AT = iteration + 1
            return
        _switch_off(capture)
        _capture.AT = _capture.NEVER
        _capture.CONTROL.changed()
    except Exception as exc:  # telemetry never breaks training: the capture ends here
        log.warning("mlaunch telemetry: live capture failed (%s)", exc)
        _capture.AT = _capture.NEVER
        if capture is not None and capture.state == "running":
            with contextlib.suppress(Exception):
                _switch_off(capture)
        if capture is not None:
            capture.state, capture.note = "done", f"ended early: {exc}"
        _capture.CONTROL.changed()


def _switch_on(capture: _capture.Capture, iteration: int) -> None:
    global _ENABLED, _FINE, _RECORDED, _CAPTURED, _CAPTURE_VALUE, _RUNTIME, _SAVED
    _SAVED = (_ENABLED, _FINE, _RECORDED, _RUNTIME)
    exported = _HANDLE.enabled_groups if _HANDLE is not None else frozenset()
    if _RUNTIME is None and _CAPTURE_RUNTIME is not None:
        _CAPTURE_RUNTIME.install_spans(iteration)
        _RUNTIME = _CAPTURE_RUNTIME  # its set_iteration keeps the block trace ids during it
    added = capture.groups - exported
    _CAPTURE_VALUE = capture.id
    _CAPTURED = added
    _RECORDED = _RECORDED - added  # exported, not recorded, while the capture runs
    _ENABLED = _ENABLED | added
    capture.state, capture.first, capture.switched_ns = "running", iteration, time.time_ns()
    if capture.profiler:
        _start_profiler(capture)


def _switch_off(capture: _capture.Capture) -> None:
    global _ENABLED, _FINE, _RECORDED, _CAPTURED, _RUNTIME, _SAVED
    if _SAVED is not None:
        _ENABLED, _FINE, _RECORDED, _RUNTIME = _SAVED
        _SAVED = None
    _CAPTURED = frozenset()
    capture.state = "done"
    if capture.profiler_handle is not None:
        _stop_profiler(capture)


def _start_profiler(capture: _capture.Capture) -> None:
    hooks = _PROFILER_HOOKS
    if hooks is None or _SETUP is None:
        capture.note = "no profiler here: the worker registered none (mlaunch's trainer does)"
        return
    from mlaunch import envcontract

    path = envcontract.profiler_trace_file(_SETUP["run_dir"], _SETUP["rank"], capture.id)
    try:
        capture.profiler_handle = hooks[0](path)
        capture.profiler_file = str(path)
    except Exception as exc:
        capture.note = f"profiler did not start: {exc}"


def _stop_profiler(capture: _capture.Capture) -> None:
    handle, capture.profiler_handle = capture.profiler_handle, None
    try:
        _PROFILER_HOOKS[1](handle, _profiler_metadata(capture))  # type: ignore[index]
    except Exception as exc:
        capture.note = f"profiler trace not written: {exc}"
        capture.profiler_file = None


def _profiler_metadata(capture: _capture.Capture) -> dict[str, Any]:
    """What a profiler trace carries to tie it to the run's spans: the capture, the rank and
    the trace ids of the ``megatron.train`` blocks the window covers."""
    from mlaunch.model.segments import DEFAULT_SEGMENT_ITERS, train_block

    s = _SETUP or {}
    first = capture.first or capture.start
    last = capture.last if capture.last is not None else first
    per = s.get("block_iters", DEFAULT_SEGMENT_ITERS)
    blocks = sorted({train_block(it, per) for it in range(first, last + 1)})
    return {
        "mlaunch.capture.id": capture.id,
        "mlaunch.run_id": s.get("run_id"),
        "rank": s.get("rank"),
        "first_iteration": first,
        "last_iteration": last,
        "trace_ids": [
            f"{_spans.segment_trace_id(s.get('run_id', ''), s.get('incarnation', ''), b):032x}"
            for b in blocks
        ],
    }


def _end_capture_at_shutdown() -> None:
    """A capture still running when the job ends (its last iteration was the run's) ends here,
    and its ack is written before the watcher stops."""
    capture = _capture.CONTROL.capture
    _capture.AT = _capture.NEVER
    if capture is None:
        return
    if capture.state == "running":
        _switch_off(capture)
    elif capture.state == "scheduled":
        capture.state, capture.note = "missed", "the run ended before the capture started"


def set_profiler_hooks(
    start: Callable[[Path], Any] | None, stop: Callable[[Any, dict[str, Any]], None] | None = None
) -> None:
    """Install the profiler a live capture with ``--profiler`` runs (mlaunch's trainer installs
    torch.profiler; telemetry never imports torch): ``start(path)`` starts it and returns a
    handle, ``stop(handle, metadata)`` stops it and writes the trace to ``path`` with
    ``metadata`` (capture id, rank, the run's trace ids) in it. None removes them."""
    global _PROFILER_HOOKS
    _PROFILER_HOOKS = (start, stop) if start is not None and stop is not None else None


def _forget_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) inherits the state but not the export thread:
    make telemetry a no-op there instead of queueing spans nobody exports."""
    global _ENABLED, _FINE, _RECORDED, _RUNTIME, _HANDLE
    if _RUNTIME is not None:
        _RUNTIME._closed = True  # its atexit hook must not flush the parent's data from here
    global _CAPTURED, _CAPTURE_RUNTIME, _SAVED, _SETUP
    if _CAPTURE_RUNTIME is not None:
        _CAPTURE_RUNTIME._closed = True
    RECORDER.stop()
    _capture.CONTROL.reset()
    _ENABLED = _FINE = _RECORDED = _CAPTURED = frozenset()
    _RUNTIME = _HANDLE = _CAPTURE_RUNTIME = _SAVED = _SETUP = None
    _devicetime.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def shutdown(timeout_s: float | None = None) -> None:
    """Shut down the process's telemetry (idempotent): ends open spans as truncated, exports or
    spools everything within the hard deadline (``shutdown_timeout_s`` by default)."""
    global _ENABLED, _FINE, _RECORDED, _RUNTIME, _HANDLE
    global _CAPTURED, _CAPTURE_RUNTIME, _SAVED, _SETUP
    with contextlib.suppress(Exception):
        _end_capture_at_shutdown()
    _capture.stop_watcher()
    runtime = _RUNTIME
    extra = _CAPTURE_RUNTIME if _CAPTURE_RUNTIME is not runtime else None
    _ENABLED = _FINE = _RECORDED = _CAPTURED = frozenset()  # new spans are no-ops from here on
    _CAPTURE_RUNTIME = _SAVED = _SETUP = None
    RECORDER.stop()  # what was not dumped on a trigger is dropped (it was never to be exported)
    with contextlib.suppress(Exception):  # device-timed spans still pending leave, host-timed
        _devicetime.resolve(None, final=True)
    _devicetime.reset()
    _RUNTIME = None
    _HANDLE = None
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
    :func:`extract` or :func:`context_from_ints`), or None (no link).
    """
    if group not in _ENABLED or _suppressed_here():
        return _NULL
    if attrs is not None:
        attributes = _merged(attrs, attributes)
    links = None
    try:
        ctx = carrier_or_context
        if isinstance(ctx, Mapping):
            ctx = extract(ctx)
        if ctx is not None and getattr(ctx, "is_valid", False):
            from opentelemetry.trace import Link

            links = [Link(ctx)]
    except Exception as exc:  # a bad carrier must not break training
        log.debug("mlaunch telemetry: ignoring bad link context (%s)", exc)
    if group in _FINE:
        return FineSpan(name, attributes, links)
    if group in _RECORDED:
        return new_recorded(name, attributes)
    if group in _CAPTURED:
        attributes[_CAPTURE_ID] = _CAPTURE_VALUE
        if group in _ALL_FINE:
            return FineSpan(name, attributes, links)
    if name in _GOODPUT:
        attributes[_IS_GOODPUT] = True
    return CoarseSpan(name, attributes, links)


def device_span(
    group: str, name: str, attrs: Mapping[Any, Any] | None = None, **attributes: Any
) -> Any:
    """Like :func:`span`, for a span that covers device work: with an event timer installed
    (:func:`set_event_timer`; the trainer installs CUDA events on a GPU) its start and end are
    device events, and its times are resolved at the step's sync point
    (:func:`resolve_device_spans`); without one it is exactly :func:`span`. Fine-grained groups
    only (a coarse group gets a plain span)."""
    if _devicetime.TIMER is None or group not in _FINE:
        return span(group, name, attrs, False, **attributes)  # host-timed: exactly span()
    if group not in _ENABLED or _suppressed_here():
        return _NULL
    if attrs is not None:
        attributes = _merged(attrs, attributes)
    return _devicetime.DeviceTimedSpan(name, attributes)


def deferred_linked_span(
    group: str,
    name: str,
    read_ints: Callable[[], Any],
    attrs: Mapping[Any, Any] | None = None,
    **attributes: Any,
) -> Any:
    """A span linked to the span context ``read_ints()`` returns (as :func:`context_from_ints`
    takes it), read only at the step's sync point (:func:`resolve_device_spans`), so the context can
    sit in a buffer a device copy fills without anyone waiting for it. Fine-grained groups only."""
    if group not in _ENABLED or _suppressed_here():
        return _NULL
    if attrs is not None:
        attributes = _merged(attrs, attributes)
    if group in _RECORDED:  # dumps carry no links: never read a buffer a device copy may fill
        return new_recorded(name, attributes)
    if group not in _FINE:
        return linked_span(group, name, context_from_ints(read_ints()), **attributes)
    return _devicetime.DeviceTimedSpan(name, attributes, read_ints)


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
    if iteration >= _capture.AT:
        _capture_boundary(iteration)
    if RECORDER.active:
        try:
            RECORDER.set_iteration(int(iteration))
        except Exception as exc:
            log.warning("mlaunch telemetry: flight recorder: set_iteration failed (%s)", exc)
    runtime = _RUNTIME
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
    runtime = _RUNTIME
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
