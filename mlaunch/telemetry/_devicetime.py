"""Spans that time device work: boundaries recorded as device events, resolved at a sync point.

On a GPU the host only enqueues kernels, so a span's host-clock duration measures the enqueue, not
the work. A *device-timed* span records an event of an :class:`EventTimer` at its start and end
(on CUDA: ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream) and is not
handed to the export queue when it ends; it waits in :data:`PENDING` until the training step's
existing sync point. There the trainer records an anchor event just before the sync and calls
:func:`resolve` just after it, with the host clock read then: every event recorded before the anchor
has run, and an event's wall time is ``anchor_host_ns - elapsed(event, anchor)``. The span's start
and end become the wall times at which the device reached its two events, so its duration is the
device's time between them and it sits on the device's timeline. Nothing here synchronizes.

:class:`HostClock` is the timer on CPU and in tests: its "event" is the host clock, elapsed time is
a difference, and resolution gives back the host times (the span is exactly a host-timed span).
Spans whose end event has not run at a resolution (recorded after the anchor, e.g. the optimizer's
kernels after the step's sync) wait for the next one; at shutdown the rest leave with their host
times.

Deferred links work the same way: a span whose link is read from a device tensor (the pipeline's
span context) is held until the sync point and gets its link then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from time import time_ns
from typing import Any, Protocol

from mlaunch.telemetry import _spans
from mlaunch.telemetry._context_ints import context_from_ints
from mlaunch.telemetry._spans import FineSpan


class EventTimer(Protocol):
    """Where a device-timed span's boundaries come from."""

    def record(self) -> Any:
        """An event recorded now, in stream order."""

    def done(self, event: Any) -> bool:
        """Whether the device has reached ``event`` (never blocks)."""

    def elapsed_ns(self, first: Any, second: Any) -> int:
        """Device time from ``first`` to ``second`` (both done)."""

    def anchor_wall_ns(self, anchor: Any, now_ns: int) -> int:
        """The wall time at which the device reached ``anchor``, read ``now_ns`` just after the
        sync that followed it."""


class HostClock:
    """The CPU timer: an event is ``time_ns()``."""

    def record(self) -> int:
        return time_ns()

    def done(self, event: int) -> bool:
        return True

    def elapsed_ns(self, first: int, second: int) -> int:
        return second - first

    def anchor_wall_ns(self, anchor: int, now_ns: int) -> int:
        return anchor  # the host clock is the timeline


class CudaEventTimer:
    """CUDA events on the current stream (``enable_timing=True``); ``elapsed_time`` is in ms with
    about 0.5 us resolution. ``query`` never blocks; ``elapsed_time`` is only called on events
    that have run, so it never blocks either."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event

    def record(self) -> Any:
        event = self._event(enable_timing=True)
        event.record()
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_ns(self, first: Any, second: Any) -> int:
        return int(first.elapsed_time(second) * 1e6)

    def anchor_wall_ns(self, anchor: Any, now_ns: int) -> int:
        # The sync returned just after the device passed the anchor (what lies between is the
        # step's small stats all-reduce and its copy to the host): a few microseconds early.
        return now_ns


#: The timer of this process; None: device-timed spans are plain host-timed spans.
TIMER: EventTimer | None = None
#: Ended device-timed spans waiting for a sync point: (span, start event, end event, link reader).
PENDING: list[tuple[FineSpan, Any, Any, Callable[[], Any] | None]] = []
_LOCK = threading.Lock()


class DeviceTimedSpan:
    """Context manager for a device-timed span (see the module docstring). The span itself is a
    plain :class:`FineSpan` (what ``as s`` gets, and what the encoder expects); this wrapper adds
    the two events and holds the ended span back from the export queue until a sync point."""

    __slots__ = ("span", "_first", "_link_reader")

    def __init__(
        self,
        name: str,
        attributes: dict[str, Any],
        link_reader: Callable[[], Any] | None = None,
    ) -> None:
        self.span = FineSpan(name, attributes, None)
        self._first: Any = None
        self._link_reader = link_reader

    @classmethod
    def around(
        cls, span: FineSpan, link_reader: Callable[[], Any] | None = None
    ) -> DeviceTimedSpan:
        """Device timing for ``span``, a fine span the span route made (not yet entered)."""
        self = cls.__new__(cls)
        self.span = span
        self._first = None
        self._link_reader = link_reader
        return self

    def __enter__(self) -> FineSpan:
        span = self.span.__enter__()
        timer = TIMER
        self._first = timer.record() if timer is not None else None
        return span

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        timer = TIMER
        last = timer.record() if timer is not None and self._first is not None else None
        span = self.span
        if span.end:  # already ended (and queued) by shutdown, truncated
            return False
        sampled = span.sampled
        span.sampled = False  # FineSpan.__exit__ must not queue it: the sync point will
        try:
            span.__exit__(exc_type, exc, tb)
        finally:
            span.sampled = sampled
        if not sampled:
            return False
        if last is None and self._link_reader is None:
            _spans.STATE.queue.append(span)
        else:
            with _LOCK:
                PENDING.append((span, self._first, last, self._link_reader))
        return False


def mark() -> Any:
    """The anchor: an event recorded just before the step's sync (None without a timer)."""
    timer = TIMER
    return timer.record() if timer is not None else None


def resolve(anchor: Any, *, final: bool = False) -> int:
    """Call right after the sync that followed :func:`mark`: pending spans whose events have run
    get device times and links, and go to the export queue. ``final`` (shutdown): the rest leave
    with their host times. Returns how many spans were released."""
    timer = TIMER
    now = time_ns()
    if timer is not None and anchor is not None:
        now = timer.anchor_wall_ns(anchor, now)
    with _LOCK:
        entries = list(PENDING)
        PENDING.clear()
    keep = []
    released = 0
    for entry in entries:
        span, first, last, reader = entry
        timed = timer is not None and first is not None and last is not None and anchor is not None
        if timed and not (timer.done(last) and timer.done(anchor)):
            if not final:
                keep.append(entry)
                continue
            timed = False
        try:
            if timed:
                span.start = now - timer.elapsed_ns(first, anchor)
                span.end = max(span.start, now - timer.elapsed_ns(last, anchor))
            if reader is not None:
                ctx = context_from_ints(reader())
                if ctx is not None and getattr(ctx, "is_valid", False):
                    from opentelemetry.trace import Link

                    span.links = [Link(ctx)]
        except Exception:  # telemetry never breaks training: keep the host times
            pass
        _spans.STATE.queue.append(span)
        released += 1
    if keep:
        with _LOCK:
            PENDING[:0] = keep
    return released


def reset() -> None:
    """Forget the timer and every pending span (shutdown, fork)."""
    global TIMER
    TIMER = None
    with _LOCK:
        PENDING.clear()
