"""Span recording for the two exported paths (records and SDK spans), sharing one span stack.

- Fine-grained groups (``FINE_GRAINED_GROUPS``) use :class:`FineSpan`: the training thread only
  records name, ids, parent, times, attributes, events and links into a slotted object and appends
  it to a deque; the export thread turns it into an SDK ``ReadableSpan``.
- Coarse groups use :class:`CoarseSpan`: a real SDK span (samplers, processors, OTel context),
  started with an explicit parent taken from the same stack.

Because both kinds push themselves onto the same per-thread stack (as the flight recorder's
recorded spans, ``_recorder``, do too), a fine span's parent can be a coarse span and a coarse
span's parent can be a fine span. This module imports nothing from OpenTelemetry: the runtime
(the only module importing the SDK) installs the few callables the coarse path needs into
:data:`STATE`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import traceback
from collections import deque
from random import Random
from time import time_ns
from typing import Any

from mlaunch.model.spans import Attr

_TRUNCATED = Attr.TRUNCATED.value
#: Every span id's random bits, from a generator of its own seeded by the OS: Python's ``random``
#: is seeded alike on every data-parallel rank (the trainer's --seed, as Megatron-LM's), so ids
#: drawn from it were identical across those ranks (as nemo-lens 0.1.0's are, Lens #28). A bound
#: method, as the module-level ``getrandbits`` was: the hot path pays the same call.
span_id_bits = Random(os.urandom(16)).getrandbits
_ERROR = 2  # StatusCode.ERROR

_tls = threading.local()
#: Every thread's span stack, so shutdown can end spans still open on any thread.
_ALL_STACKS: list[list[Any]] = []
# Re-entrant: shutdown may run from a signal handler that interrupted this very thread.
_STACKS_LOCK = threading.RLock()
#: ``id(stack)`` -> the ident of the thread that owns it: a hang report names each stack's thread.
_STACK_THREADS: dict[int, int] = {}


def _new_stack() -> list[Any]:
    stack: list[Any] = []
    _tls.stack = stack
    with _STACKS_LOCK:
        _ALL_STACKS.append(stack)
        _STACK_THREADS[id(stack)] = threading.get_ident()
    return stack


def current_stack() -> list[Any]:
    """This thread's span stack (innermost last)."""
    try:
        return _tls.stack
    except AttributeError:
        return _new_stack()


def segment_trace_id(run_id: str, restart: int | str, segment: int | str) -> int:
    """The deterministic 128-bit trace id of one trace of a run (never 0): ``segment`` is
    ``"startup"`` for the start-up trace or a ``megatron.train`` block number. Here (not in the
    runtime) because a non-exporting rank's flight recorder needs the same ids without the SDK."""
    digest = hashlib.sha256(f"mlaunch/{run_id}/{restart}/{segment}".encode()).hexdigest()
    return int(digest[:32], 16) or 1


#: The trace of a worker incarnation's ``megatron.startup`` (and anything before the first block).
STARTUP_TRACE = "startup"


class _State:
    """What the span classes need from the runtime; replaced wholesale by ``setup``."""

    __slots__ = (
        "trace_id",
        "queue",
        "root_sampled",
        "start_sdk_span",
        "attach",
        "detach",
    )

    def __init__(self) -> None:
        #: The trace id root spans get now (see the trace identity rules in ``mlaunch.telemetry``).
        self.trace_id: int = 1
        #: Ended fine spans waiting for the export thread.
        self.queue: deque[Any] = deque()
        self.root_sampled: Any = lambda trace_id, name: False
        self.start_sdk_span: Any = None
        self.attach: Any = lambda span: None
        self.detach: Any = lambda token: None


STATE = _State()


def exception_event_attributes(exc: BaseException) -> dict[str, str]:
    """The ``exception`` event attributes, exactly as the SDK's ``Span.record_exception`` sets them."""
    module = type(exc).__module__
    qualname = type(exc).__qualname__
    return {
        "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
        "exception.message": str(exc),
        "exception.stacktrace": "".join(traceback.format_exception(exc)),
        "exception.escaped": "False",
    }


def error_description(exc: BaseException) -> str:
    """The ERROR status description the SDK's ``use_span`` would set."""
    return f"{type(exc).__name__}: {exc}"


def _pop(stack: list[Any], entry: Any) -> None:
    if stack and stack[-1] is entry:
        stack.pop()
    else:  # exited out of order (generators, threads): remove wherever it is
        with contextlib.suppress(ValueError):
            stack.remove(entry)


class FineSpan:
    """A fine-grained span record; also the object ``with span(...) as s`` yields for it.

    Offers the subset of the OTel ``Span`` API instrumented code uses (``set_attribute``,
    ``set_attributes``, ``add_event``, ``record_exception``, ``set_status``, ``is_recording``,
    ``get_span_context``).
    """

    __slots__ = (
        "name",
        "attributes",
        "links",
        "events",
        "status",
        "trace_id",
        "span_id",
        "parent_id",
        "sampled",
        "start",
        "end",
        "root",
    )

    def __init__(
        self, name: str, attributes: dict[str, Any], links: Any = None, root: bool = False
    ) -> None:
        self.name = name
        self.attributes = attributes
        self.links = links
        self.events: list[Any] | None = None
        self.status: tuple[int, str] | None = None
        self.end = 0
        #: Parentless whatever is open on the thread (``span(..., root=True)``).
        self.root = root

    def __enter__(self) -> FineSpan:
        try:
            stack = _tls.stack
        except AttributeError:
            stack = _new_stack()
        if stack and not self.root:
            parent = stack[-1]
            self.trace_id = parent.trace_id
            self.parent_id = parent.span_id
            self.sampled = parent.sampled
        else:
            state = STATE
            self.trace_id = state.trace_id
            self.parent_id = 0
            self.sampled = state.root_sampled(self.trace_id, self.name)
        self.span_id = span_id_bits(64) or 1
        stack.append(self)
        self.start = time_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        end = time_ns()
        if self.end:  # already ended by shutdown (truncated)
            return False
        self.end = end
        _pop(_tls.stack, self)
        if exc is not None:
            self.record_exception(exc, timestamp=end)
            self.status = (_ERROR, error_description(exc))
        if self.sampled:
            STATE.queue.append(self)
        return False

    def truncate(self) -> None:
        """End the span now, marked ``nemo.span.truncated=true`` (shutdown with it open)."""
        if self.end:
            return
        self.attributes[_TRUNCATED] = True
        self.end = time_ns()
        if self.sampled:
            STATE.queue.append(self)

    # --- the Span API subset -----------------------------------------------------------------

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute."""
        self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        """Set several attributes."""
        self.attributes.update(attributes)

    def add_event(
        self, name: str, attributes: dict[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        """Add a span event."""
        if self.events is None:
            self.events = []
        self.events.append((name, dict(attributes or {}), timestamp or time_ns()))

    def record_exception(
        self,
        exception: BaseException,
        attributes: dict[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """Record an ``exception`` event with the SDK's attributes."""
        attrs: dict[str, Any] = exception_event_attributes(exception)
        attrs["exception.escaped"] = str(escaped)
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def set_status(self, status: Any, description: str | None = None) -> None:
        """Set the status (an OTel ``Status`` or ``StatusCode``)."""
        code = getattr(status, "status_code", status)
        desc = getattr(status, "description", None) or description or ""
        self.status = (int(getattr(code, "value", code)), desc)

    def is_recording(self) -> bool:
        """Whether the span will be exported (sampled)."""
        return bool(self.sampled) and not self.end

    def get_span_context(self) -> Any:
        """The OTel ``SpanContext`` of this span."""
        from opentelemetry.trace import SpanContext, TraceFlags

        return SpanContext(self.trace_id, self.span_id, False, TraceFlags(1 if self.sampled else 0))


class CoarseSpan:
    """Context manager for a coarse-group span: a real SDK span, parented from the shared stack."""

    __slots__ = (
        "name",
        "attributes",
        "links",
        "span",
        "trace_id",
        "span_id",
        "sampled",
        "token",
        "ended",
        "root",
    )

    def __init__(
        self, name: str, attributes: dict[str, Any], links: Any = None, root: bool = False
    ) -> None:
        self.name = name
        self.attributes = attributes
        self.links = links
        self.ended = False
        #: Parentless whatever is open on the thread (``span(..., root=True)``).
        self.root = root

    def _start(self, parent: Any) -> None:
        span = STATE.start_sdk_span(self.name, parent, self.attributes, self.links)
        ctx = span.get_span_context()
        self.span = span
        self.trace_id = ctx.trace_id
        self.span_id = ctx.span_id
        self.sampled = ctx.trace_flags.sampled

    def __enter__(self) -> Any:
        stack = current_stack()
        self._start(stack[-1] if stack and not self.root else None)
        self.token = STATE.attach(self.span)
        stack.append(self)
        return self.span

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self.ended:
            return False
        self.ended = True
        _pop(current_stack(), self)
        # Detaching out of order only warns in OTel; never break training over it.
        with contextlib.suppress(Exception):
            STATE.detach(self.token)
        span = self.span
        if exc is not None:
            span.record_exception(exc)
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error_description(exc)))
        span.end()
        return False

    def truncate(self) -> None:
        """End the span now, marked ``nemo.span.truncated=true``."""
        if self.ended:
            return
        self.ended = True
        self.span.set_attribute(_TRUNCATED, True)
        self.span.end()

    def reroot(self, extra_attributes: dict[str, Any], links: list[Any]) -> None:
        """End the current SDK span and continue as a new root span (a new megatron.train block).

        The trace id of the new root is whatever :data:`STATE` says now; the caller sets it first.
        """
        old = self.span
        STATE.detach(self.token)
        old.end()
        # Carry over attributes set on the span after it started (old.attributes has them all).
        self.attributes = {
            **dict(getattr(old, "attributes", None) or self.attributes),
            **extra_attributes,
        }
        self.links = links
        self._start(None)
        self.token = STATE.attach(self.span)


def all_open_spans() -> list[Any]:
    """Every span still open on any thread, innermost first per thread."""
    with _STACKS_LOCK:
        stacks = list(_ALL_STACKS)
    out: list[Any] = []
    for stack in stacks:
        out.extend(reversed(list(stack)))
    return out


def open_stacks_by_thread() -> list[tuple[int, list[Any]]]:
    """``(thread ident, its open spans outermost first)`` for every thread with an open span (a
    copy: safe to read from another thread while the owner runs on)."""
    with _STACKS_LOCK:
        stacks = [(_STACK_THREADS.get(id(s), 0), list(s)) for s in _ALL_STACKS]
    return [(ident, spans) for ident, spans in stacks if spans]


def clear_stacks() -> None:
    """Forget all open spans (after shutdown ended them)."""
    with _STACKS_LOCK:
        for stack in _ALL_STACKS:
            stack.clear()
