"""The W3C ``traceparent`` header (https://www.w3.org/TR/trace-context/#traceparent-header), read
one way everywhere: the launcher's inherited ``TRACEPARENT``, a worker's link to its attempt span,
and ``telemetry.extract`` of a carrier.

``version-traceid-parentid-flags``: 2, 32, 16 and 2 hex digits. Version ``ff`` is invalid, and so
is an all-zero trace or span id. Version ``00`` has exactly these four fields; a later version may
append more after another ``-`` (the spec's forward compatibility), which are ignored. Hex digits
are read in either case: the spec writes them lower-case, and every reader mlaunch had accepted
upper-case too, so a value some tool upper-cased still links.
"""

from __future__ import annotations

from typing import NamedTuple

_HEX = frozenset("0123456789abcdefABCDEF")
#: The field lengths, in order: version, trace id, parent (span) id, flags.
_LENGTHS = (2, 32, 16, 2)


class TraceParent(NamedTuple):
    """A parsed ``traceparent``: ids and flags as ints (``flags & 1`` is *sampled*)."""

    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        """Whether the caller sampled the parent (the ``sampled`` trace flag)."""
        return bool(self.flags & 0x01)


def parse(value: str | None) -> TraceParent | None:
    """``value`` as a :class:`TraceParent`, or None when it is not a valid W3C ``traceparent``
    (surrounding whitespace is ignored)."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4:
        return None
    version = parts[0]
    if len(parts) > 4 and version == "00":
        return None  # version 00 has exactly four fields
    for part, length in zip(parts, _LENGTHS, strict=False):
        if len(part) != length or not _HEX.issuperset(part):
            return None
    if version.lower() == "ff":
        return None
    trace_id, span_id = int(parts[1], 16), int(parts[2], 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, int(parts[3], 16))
