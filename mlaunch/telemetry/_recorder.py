"""The flight recorder: every rank keeps the spans of the recorder groups it does not export in an
in-memory ring of its last K iterations, and writes the ring out on a trigger.

Hot path
    A recorded span is a :class:`RecordedSpan`: the training thread stores its name, attributes,
    times and one reference to what was open below it, and appends the object to the current
    iteration's list. Nothing is encoded, locked or counted per span, and no id is made: ids and
    parents are worked out when something reads them, in practice when a trigger writes the ring
    out (:meth:`Recorder.dump`), which also encodes. Its ``__enter__``/``__exit__`` are C methods
    where the optional extension ``_cspan`` is built (``pip install`` compiles it where it can),
    else the pure-Python ones of :class:`_PySpanBase`, which define what the C code does.

Ring
    :meth:`Recorder.set_iteration` (called by ``telemetry.set_iteration``) seals the previous
    iteration's list into the ring; the ring keeps at most ``iters`` iterations and at most
    ``max_bytes`` of estimated memory (``SPAN_BYTES`` per span: a slotted record plus its
    attribute dict, measured with ``sys.getsizeof``), dropping the oldest iteration first. The
    estimate costs one multiplication per iteration, not one call per span.

Identity
    Recorded spans share the run's trace ids (the same deterministic ids every rank derives, see
    ``mlaunch.telemetry``), and a recorded span opened inside an exported one has that span as its
    parent, so a dump nests under the exported iteration spans. On a rank that exports nothing the
    recorder keeps the trace id itself (the runtime does it on an exporting rank), from the
    worker's identity (``_core.Identity``, the one ``setup`` derives for both). An exported
    ``megatron.train`` changes its ids when a new block re-roots it, so at each block change the
    recorder first fixes the ids of the exported parents of what it holds (one pass over the ring
    every block, not a cost per span).

Dumps
    One OTLP-JSON line per dump in ``telemetry/recorder-rank{R}.jsonl``; every span carries
    ``mlaunch.recorder.trigger``. What was written is dropped from the ring, so two triggers never
    write a span twice. A dump never raises (failures are logged once).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import statistics
import threading
from collections import deque
from pathlib import Path
from time import time_ns
from typing import TYPE_CHECKING, Any

from mlaunch import envcontract
from mlaunch.model.segments import train_block
from mlaunch.model.spans import RECORDER_TRIGGERS, Attr, ResourceAttr
from mlaunch.otlp.otlp_json import encode_span, trace_request
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json
from mlaunch.rundir.layout import RECORDER_FILE, RECORDER_INDEX_FILE
from mlaunch.rundir.records import append_line, dump_record
from mlaunch.telemetry import _spans
from mlaunch.telemetry._spans import (
    STARTUP_TRACE,
    FineSpan,
    _new_stack,
    _pop,
    _tls,
    error_description,
    segment_trace_id,
)

if TYPE_CHECKING:
    from mlaunch.settings import TelemetrySettings
    from mlaunch.telemetry._core import Identity

log = logging.getLogger("mlaunch.telemetry")

#: Estimated bytes one recorded span holds (record + attribute dict + name/ids), for the bound.
SPAN_BYTES = 512
#: Iterations timed before the slow trigger may fire (the first ones compile, warm caches).
SLOW_WARMUP_ITERS = 5
_TRIGGER = Attr.RECORDER_TRIGGER.value
_OPEN = Attr.RECORDER_OPEN.value
_DUMP = Attr.RECORDER_DUMP.value
_ERROR = 2


#: Span ids of recorded spans: a counter from a random start (one C call, cheaper than
#: ``getrandbits``); 63 random bits from the OS keep two ranks' ids apart (not from ``random``,
#: which the training seed sets alike on data-parallel ranks). Read with ``next(_ids)``: the
#: builtin reaches the iterator's slot directly, about 90 instructions less than calling the
#: bound ``__next__`` method-wrapper.
_ids = itertools.count((int.from_bytes(os.urandom(8), "big") >> 2 << 1) | 1)
#: The one span state object (``_spans.STATE`` is never rebound, only its fields change).
_STATE = _spans.STATE


class _PySpanBase:
    """A recorded span's fields and its training-thread path, in Python: the definition of what
    the C accelerator's ``SpanBase`` (``_cspan.c``, the same slots and the same steps) does when
    it is built; :class:`RecordedSpan` derives from whichever is in use (:data:`SPAN_BASE`)."""

    __slots__ = (
        "name",
        "attributes",
        "events",
        "status",
        #: The span open on the thread when this one began (any kind), or, when none was, the
        #: trace id root spans had then (an int); an ``(trace_id, span_id)`` pair once
        #: :func:`freeze_parents` has fixed an exported parent's ids.
        "parent",
        "_span_id",
        "start",
        "end",
        #: The stack ``__enter__`` pushed onto, so ``__exit__`` need not ask the thread-local
        #: again; None once a shutdown's ``truncate`` has ended it.
        "stack",
    )

    # Every line of ``__enter__``/``__exit__`` is on the training thread's hot path (the goal:
    # <= 0.5 us per recorded span; each ``time_ns()`` alone is 60-85 ns here). The root case has
    # its own ``_enter_root`` (RootRecordedSpan's ``__enter__``), so this one reads no class
    # attribute (``self.root``) per span. Globals are read at each call (the C code reads the
    # same names from this module's globals): a test or a shutdown may rebind them.
    def __enter__(self) -> Any:
        try:
            stack = _tls.stack
        except AttributeError:
            stack = _new_stack()
        self.stack = stack
        self.parent = stack[-1] if stack else _STATE.trace_id
        stack.append(self)
        self.start = time_ns()
        return self

    def _enter_root(self) -> Any:
        try:
            stack = _tls.stack
        except AttributeError:
            stack = _new_stack()
        self.stack = stack
        self.parent = _STATE.trace_id
        stack.append(self)
        self.start = time_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        end = time_ns()
        stack = self.stack
        if stack is None:  # already ended by shutdown (truncated)
            return
        self.end = end
        # Pop first and look after: one call when spans end innermost first, as they do.
        try:
            top = stack.pop()
        except IndexError:  # the stack was cleared under it
            top = self
        if top is not self:  # ended out of order (generators, threads)
            stack.append(top)
            _pop(stack, self)
        if exc is not None:
            self._record_error(exc, end)
        _CURRENT.append(self)
        # None (falsy): the exception, if any, propagates.


def _span_base() -> type:
    """The C ``SpanBase`` when it is built and not turned off, else :class:`_PySpanBase`."""
    if os.environ.get(envcontract.PURE_PYTHON_SPANS, "") == "1":
        return _PySpanBase
    try:
        from mlaunch.telemetry import _cspan
    except ImportError:  # not compiled here (no compiler or headers at install): same, slower
        return _PySpanBase
    _cspan.bind(globals())
    return _cspan.SpanBase


#: What :class:`RecordedSpan` derives from: ``_cspan.SpanBase`` or :class:`_PySpanBase`.
SPAN_BASE = _span_base()


class RecordedSpan(SPAN_BASE):  # type: ignore[misc,valid-type]
    """A span of a recorded (not exported) group: kept in the recorder's current iteration.

    Built by the span factories with no ``__init__`` (one Python frame less on the hot path),
    which set only ``name`` and ``attributes``: what every recorded span has alike (no links,
    kept whatever the sampler says, not a root) are class attributes, not per-span stores;
    ``events``, ``status`` and ``end`` stay unset until used. Not a :class:`FineSpan` subclass,
    so those names need no slot; it shares FineSpan's span API methods. Its fields and
    ``__enter__``/``__exit__`` are :data:`SPAN_BASE`'s (in C where the accelerator is built).

    Ids are not made on the training thread: ``__enter__`` stores one reference, ``parent`` (the
    span open below it, or the trace id when none is), and ``trace_id``, ``span_id`` and
    ``parent_id`` are properties worked out when something reads them, which is almost always a
    dump. A span id, once made, stays (a span written open by one dump keeps its id in the next)."""

    __slots__ = ()
    #: Dumps carry no links (never read a buffer a device copy may fill).
    links = None
    sampled = True
    root = False

    def _record_error(self, exc: BaseException, end: int) -> None:
        """``__exit__`` with an exception (the rare case; the C path calls back into this)."""
        self.record_exception(exc, timestamp=end)
        self.status = (_ERROR, error_description(exc))

    @property
    def span_id(self) -> int:
        """This span's id, made on first read."""
        try:
            return self._span_id
        except AttributeError:
            self._span_id = sid = next(_ids)
            return sid

    @property
    def trace_id(self) -> int:
        """The trace id: the parent's, or the root trace id when this span began."""
        return _trace_and_parent(self)[0]

    @property
    def parent_id(self) -> int:
        """The parent's span id (0: a root)."""
        return _trace_and_parent(self)[1]

    def truncate(self) -> None:
        """Shutdown with the span open: ended now, kept (not exported)."""
        if getattr(self, "stack", None) is None or getattr(self, "end", 0):
            return
        self.stack = None
        self.attributes[Attr.TRUNCATED.value] = True
        self.end = time_ns()
        _CURRENT.append(self)

    def add_event(
        self, name: str, attributes: dict[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        """Add a span event."""
        if getattr(self, "events", None) is None:
            self.events = []
        self.events.append((name, dict(attributes or {}), timestamp or time_ns()))

    def is_recording(self) -> bool:
        """Recorded spans are kept whatever the sampler says."""
        return not getattr(self, "end", 0)

    set_attribute = FineSpan.set_attribute
    set_attributes = FineSpan.set_attributes
    record_exception = FineSpan.record_exception
    set_status = FineSpan.set_status
    get_span_context = FineSpan.get_span_context


class RootRecordedSpan(RecordedSpan):
    """A recorded ``span(..., root=True)``: parentless whatever is open on the thread."""

    __slots__ = ()
    root = True
    __enter__ = SPAN_BASE._enter_root


def _trace_and_parent(rec: RecordedSpan) -> tuple[int, int]:
    """``(trace_id, parent span id)`` of a recorded span, from its ``parent`` reference."""
    parent = rec.parent
    if type(parent) is int:
        return parent, 0
    if type(parent) is tuple:
        return parent
    return parent.trace_id, parent.span_id


def freeze_parents(spans: Any) -> None:
    """Fix the ids of the exported parents of ``spans`` now: an exported span's ids can change
    later (a ``megatron.train`` span re-rooted into the next block's trace in place), and a
    recorded span keeps the parent it had when it began."""
    for rec in spans:
        parent = getattr(rec, "parent", None)
        while isinstance(parent, RecordedSpan):  # up to the chain's first exported span or root
            rec, parent = parent, getattr(parent, "parent", None)
        if parent is not None and not isinstance(parent, int | tuple):
            rec.parent = (parent.trace_id, parent.span_id)


def new_recorded(name: str, attributes: dict[str, Any], root: bool = False) -> RecordedSpan:
    """A :class:`RecordedSpan` (the caller inlines this on the hot path)."""
    rec = RootRecordedSpan() if root else RecordedSpan()
    rec.name = name
    rec.attributes = attributes
    return rec


class Recorder:
    """One process's flight recorder (the module-level :data:`RECORDER`)."""

    def __init__(self) -> None:
        self.active = False
        #: Spans ended in the iteration now running (the hot path appends here).
        self.current: list[Any] = []
        self.current_iteration = 0
        #: Sealed iterations, oldest first: (iteration, spans).
        self.ring: deque[tuple[int, list[Any]]] = deque()
        self.ring_spans = 0
        self.iters = 20
        self.max_bytes = 64 << 20
        self.slow_factor = 2.0
        self.step_times: deque[float] = deque(maxlen=20)
        self.path: Path | None = None
        self.resource: dict[str, Any] = {}
        self.own_trace_ids = False
        self.run_id = ""
        self.incarnation = ""
        self.block_iters = 100
        self.block: int | None = None
        self.dumps = 0
        self._lock = threading.Lock()  # a signal-path dump and the loop's never interleave
        self._failed = False
        self._written_open: set[int] = set()
        #: (iteration, time.time()) of the latest ``telemetry.set_iteration``: the progress beat
        #: the request watcher writes for the launcher's hang watchdog (one tuple store per step).
        self.mark: tuple[int, float] | None = None
        #: A trigger another thread asked for, handled at the next iteration boundary.
        self.pending: str | None = None

    # --- configuration ------------------------------------------------------------------------

    def start(
        self,
        *,
        iters: int,
        max_bytes: int,
        slow_factor: float,
        resource: dict[str, Any],
        own_trace_ids: bool,
        identity: Identity,
    ) -> None:
        """Keep the last ``iters`` iterations' spans (at most ``max_bytes``), dumped to this
        rank's recorder file of the run directory; ``own_trace_ids``: this rank exports nothing,
        so the recorder moves the block trace ids itself (from the same identity the exporter
        would use)."""
        run_id, incarnation = identity.run_id, identity.incarnation
        path = lay.recorder_file(identity.run_dir, identity.rank)
        block_iters = identity.block_iters
        self.iters = max(1, iters)
        self.max_bytes = max(SPAN_BYTES, max_bytes)
        self.slow_factor = slow_factor
        self.step_times = deque(maxlen=max(self.iters, SLOW_WARMUP_ITERS))
        self.path = path
        self.resource = resource
        self.own_trace_ids = own_trace_ids
        self.run_id, self.incarnation = run_id, incarnation
        self.block_iters = max(1, block_iters)
        self.block = None
        self.current.clear()
        self.ring, self.ring_spans = deque(), 0
        self.current_iteration = 0
        self.dumps = 0
        self._failed = False
        self._written_open = set()
        if own_trace_ids:
            _spans.STATE.trace_id = segment_trace_id(run_id, incarnation, STARTUP_TRACE)
        self.active = True

    def stop(self) -> None:
        self.active = False
        self.pending = None
        self.mark = None
        self.current.clear()
        self.ring, self.ring_spans = deque(), 0

    # --- iterations ---------------------------------------------------------------------------

    def set_iteration(self, iteration: int) -> None:
        """``iteration`` starts next: seal the previous one into the ring (bounded)."""
        if not self.active or iteration == self.current_iteration:
            return
        block = train_block(iteration, self.block_iters)
        if block != self.block:
            self.block = block
            # Before the runtime re-roots its megatron.train span into the new block's trace
            # (telemetry.set_iteration calls the recorder first): what was recorded under it
            # keeps the ids it had.
            freeze_parents(itertools.chain(self.current, *(b for _, b in self.ring)))
            freeze_parents(s for s in _spans.all_open_spans() if isinstance(s, RecordedSpan))
            if self.own_trace_ids:
                _spans.STATE.trace_id = segment_trace_id(self.run_id, self.incarnation, block)
        done = self.current[:]
        self.current.clear()  # the same list: the hot path holds its bound append
        if done:
            self.ring.append((self.current_iteration, done))
            self.ring_spans += len(done)
        self.current_iteration = iteration
        ring = self.ring
        while ring and (len(ring) > self.iters or (self.ring_spans * SPAN_BYTES > self.max_bytes)):
            _, dropped = ring.popleft()
            self.ring_spans -= len(dropped)
        if self.pending is not None:
            trigger, self.pending = self.pending, None
            self.dump(trigger)

    def request_dump(self) -> None:
        """Ask for a ``request`` dump at the next iteration boundary (from any thread: the ring
        is only ever touched by the training thread)."""
        self.pending = "request"

    def note_step(self, step_ms: float) -> bool:
        """Time of the iteration just finished; True when it is slower than ``slow_factor`` x
        the rolling median of the previous ones (after a warm-up)."""
        if not self.active:
            return False
        times = self.step_times
        slow = len(times) >= SLOW_WARMUP_ITERS and step_ms > self.slow_factor * statistics.median(
            times
        )
        times.append(step_ms)
        return slow

    def memory_bytes(self) -> int:
        """The estimated memory the ring and the current iteration hold."""
        return (self.ring_spans + len(self.current)) * SPAN_BYTES

    def held_iterations(self) -> list[int]:
        """The iterations the ring holds (and the current one, when it has spans)."""
        out = [it for it, _ in self.ring]
        if self.current:
            out.append(self.current_iteration)
        return out

    # --- dumps --------------------------------------------------------------------------------

    def dump(self, trigger: str) -> int:
        """Write what the ring and the current iteration hold to the recorder file, each span
        marked with ``trigger``; returns how many spans were written. Never raises."""
        if not self.active or self.path is None:
            return 0
        if trigger not in RECORDER_TRIGGERS:
            raise ValueError(f"unknown recorder trigger {trigger!r}")
        if not self._lock.acquire(timeout=1.0):
            return 0
        try:
            # Copies first (each one C call under the GIL): a ``hang`` dump runs on the watcher
            # thread, and a training thread that is not stuck after all may append meanwhile.
            held = [it for it, _ in list(self.ring)] + (
                [self.current_iteration] * bool(self.current)
            )
            spans = [s for _, batch in list(self.ring) for s in batch]
            current = self.current[:]
            del self.current[: len(current)]
            spans.extend(current)
            self.ring, self.ring_spans = deque(), 0
            if self._written_open:  # ended since an earlier dump wrote it open: not twice
                spans = [s for s in spans if s.span_id not in self._written_open]
            if not spans:
                _index_dump(self.path, self.dumps, trigger, 0, [])  # answered: nothing held
                return 0
            seq = self.dumps
            encoded = [_encode(s, trigger, seq) for s in spans]
            # Recorded spans still open (a non-exporting rank's megatron.train block) are the
            # parents of what is written: written once, marked open, so the dump is a tree.
            for entry in _spans.all_open_spans():
                if isinstance(entry, RecordedSpan) and entry.span_id not in self._written_open:
                    self._written_open.add(entry.span_id)
                    encoded.append(_encode(entry, trigger, seq, still_open=True))
            line = json.dumps(
                trace_request(self.resource, "mlaunch", encoded), separators=(",", ":")
            )
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One write of one line: a reader never sees half a dump from a finished process.
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                with contextlib.suppress(OSError):
                    os.fsync(f.fileno())
            self.dumps += 1
            _index_dump(self.path, seq, trigger, len(spans), held)
            log.info(
                "mlaunch telemetry: flight recorder wrote %d spans (%s) to %s",
                len(spans), trigger, self.path,
            )  # fmt: skip
            return len(spans)
        except Exception as exc:  # telemetry never breaks training
            if not self._failed:
                self._failed = True
                log.warning("mlaunch telemetry: flight recorder dump failed (%s)", exc)
            return 0
        finally:
            self._lock.release()


def _encode(rec: RecordedSpan, trigger: str, seq: int, still_open: bool = False) -> dict[str, Any]:
    attrs = {str(k): v for k, v in rec.attributes.items() if v is not None}
    attrs[_TRIGGER] = trigger
    attrs[_DUMP] = seq
    if still_open:
        attrs[_OPEN] = True
    code, message = getattr(rec, "status", None) or (0, "")
    trace_id, parent_id = _trace_and_parent(rec)
    return encode_span(
        name=rec.name,
        trace_id=f"{trace_id:032x}",
        span_id=f"{rec.span_id:016x}",
        parent_span_id=f"{parent_id:016x}" if parent_id else "",
        start_ns=rec.start,
        end_ns=getattr(rec, "end", 0) or time_ns(),
        attributes=attrs,
        status_code=code,
        status_message=message,
    )


RECORDER = Recorder()
#: The current iteration's list (the object never changes: iterations are sealed by copying it).
#: ``_CURRENT.append(x)`` is specialized by the interpreter (a list's own ``append``), cheaper
#: than calling a bound-method object held in a global.
_CURRENT = RECORDER.current


def recorder_resource(
    settings: TelemetrySettings,
    *,
    run_id: str,
    rank: int,
    world_size: int,
    local_rank: int,
    extra: Any,
) -> dict[str, Any]:
    """The resource of a rank's dumps: what the reader needs to place them (no SDK needed)."""
    attrs: dict[str, Any] = {
        ResourceAttr.SERVICE_NAME.value: settings.service_name,
        ResourceAttr.SERVICE_INSTANCE_ID.value: f"{run_id}-rank{rank}",
        ResourceAttr.RUN_ID.value: run_id,
        ResourceAttr.RANK.value: rank,
        ResourceAttr.WORLD_SIZE.value: world_size,
        ResourceAttr.LOCAL_RANK.value: local_rank,
    }
    for key, value in dict(extra or {}).items():
        if value is not None and isinstance(value, str | int | float | bool):
            attrs[str(key)] = value
    return attrs


def open_span_stacks() -> list[dict[str, Any]]:
    """Every thread's open spans (outermost first): name, attributes, start, per thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, spans in _spans.open_stacks_by_thread():
        entries = []
        for entry in spans:
            start = getattr(entry, "start", None)
            if not start:  # a coarse span: the SDK span holds its start
                start = getattr(getattr(entry, "span", None), "start_time", None)
            attrs = {
                str(k): v
                for k, v in dict(getattr(entry, "attributes", None) or {}).items()
                if isinstance(v, str | int | float | bool)
            }
            entries.append({"name": entry.name, "attributes": attrs, "start_ns": start})
        out.append({"thread": names.get(ident, str(ident)), "thread_id": ident, "spans": entries})
    return out


def _index_dump(path: Path, seq: int, trigger: str, spans: int, iterations: list[int]) -> None:
    """The dump's line in the recorder's index (what ``mlaunch status`` and the report read)."""
    rank = RECORDER_FILE.parse(path.name)
    if rank is not None:
        index = path.with_name(RECORDER_INDEX_FILE.name(rank))
        append_line(index, dump_record(rank, seq, trigger, spans, iterations))


def write_open_spans(path: Path, rank: int, request_id: str) -> None:
    """Write this process's open-span stacks for a hang report (atomically: the launcher reads
    the file once it appears)."""
    mark = RECORDER.mark
    body = {
        "rank": rank,
        "pid": os.getpid(),
        "request": request_id,
        "time_ns": time_ns(),
        "iteration": mark[0] if mark else None,
        "iteration_started": mark[1] if mark else None,
        "threads": open_span_stacks(),
    }
    write_json(path, body)
