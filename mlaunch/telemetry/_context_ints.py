"""A span context as four signed int64 values (trace id high and low halves, span id, flags): the
row a pipeline stage sends with its activation tensor so the receiving stage can link to the
sender's span. Both directions live here, below the API module (:mod:`mlaunch.telemetry`, which
re-exports them) and the device timer (:mod:`mlaunch.telemetry._devicetime`), which decodes the
row it reads at the step's sync point.
"""

from __future__ import annotations

from typing import Any

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


def context_ints(trace_id: int, span_id: int, sampled: bool) -> tuple[int, int, int, int]:
    """A span's ids and sampled flag as the four signed int64 values of a context row."""
    return (
        _signed(trace_id >> 64),
        _signed(trace_id & _MASK64),
        _signed(span_id),
        1 if sampled else 0,
    )


def context_from_ints(values: tuple[int, int, int, int] | list[int]) -> Any:
    """Inverse of :func:`mlaunch.telemetry.current_context_ints`; None for an all-zero (absent)
    context."""
    hi, lo, sid, flags = (int(v) for v in values)
    trace_id = ((hi & _MASK64) << 64) | (lo & _MASK64)
    span_id = sid & _MASK64
    if not trace_id or not span_id:
        return None
    try:
        from opentelemetry.trace import SpanContext, TraceFlags
    except ImportError:
        return None
    return SpanContext(trace_id, span_id, True, TraceFlags(flags & 0x01))
