"""``mlaunch trace export --format chrome``: Chrome trace-event JSON for Perfetto and
chrome://tracing.

Layout: one process per rank (named ``rank R (host)`` through ``process_name`` metadata), one
thread per OS thread (the span's ``thread.id`` attribute when present, else one per rank). The
viewers draw complete events (``ph: X``) of one thread as a stack, so they must nest; spans of a
thread that overlap without nesting (async P2P, overlapped communication) go to extra *lanes*,
each its own tid named ``<thread> lane k``. A span prefers its parent's lane, so trees stay
together. Span attributes become ``args``; span events become thread-scoped instant events
(``ph: i``); links become flow events (``ph: s`` on the linked span, ``ph: f`` with
``bp: e`` on the linking span, same ``id``), bound to those slices.

Timestamps are microseconds relative to the earliest span (``otherData.t0_unix_nano`` holds the
origin): absolute Unix microseconds as doubles would lose the nanoseconds and break nesting.

This module holds the format's rules that the writer (:mod:`mlaunch.trace.store_chrome`, over
the span store) and the report's timeline (:func:`assign_lanes`) share: process ids, span ids as
integers, microsecond times and the lane rule (:class:`LaneSweep`).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlaunch.trace.reader import Resource

#: Span attributes that name the OS thread (OpenTelemetry semantic conventions).
THREAD_ID_ATTR = "thread.id"
THREAD_NAME_ATTR = "thread.name"
_dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode
_SORT_CHUNK = 1 << 16
#: The launcher's job trace of node N is process ``LAUNCHER_PID + N`` (after every rank).
LAUNCHER_PID = 1_000_000


def _pid(res: Resource) -> int:
    """The Chrome process of a batch: its rank, or the launcher's process for its node."""
    return LAUNCHER_PID + (-1 - res.rank) if res.launcher else res.rank


def _sid(hex_id: str | None) -> int:
    """A 64-bit span id as a signed int64 (fits ``array('q')``); 0 for none."""
    if not hex_id:
        return 0
    try:
        v = int(hex_id, 16) & ((1 << 64) - 1)
    except ValueError:  # not hex: any stable number keeps links and nesting consistent
        v = int.from_bytes(hex_id.encode()[-8:].rjust(8, b"\0"), "big")
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass
class ChromeStats:
    """Counts reported after an export."""

    spans: int = 0
    processes: int = 0
    """Every Chrome process: the ranks, and the launcher of each node whose job trace was read."""
    launchers: int = 0
    """Of :attr:`processes`, the launchers' (a job trace is no rank's)."""
    threads: int = 0
    lanes: int = 0
    flows: int = 0
    unresolved_links: int = 0
    instant_events: int = 0


def _us(ns: int) -> float:
    """Nanoseconds -> microseconds with nanosecond precision kept (3 decimals)."""
    return round(ns / 1000.0, 3)


class SpanLike(Protocol):
    """What :func:`assign_lanes` needs of a span: its interval, ``key[1]`` = its span id (hex)
    and ``parent`` = its parent's span id (hex, "" for none)."""

    start: int
    end: int
    key: tuple[str, str]
    parent: str


def assign_lanes(spans: Sequence[SpanLike]) -> list[int]:
    """:func:`assign_lanes_columns` for a list of span records (used by ``mlaunch trace report``)."""
    starts, ends = array("q", (s.start for s in spans)), array("q", (s.end for s in spans))
    ids = array("q", (_sid(s.key[1]) for s in spans))
    parents = array("q", (_sid(s.parent) for s in spans))
    return list(assign_lanes_columns(starts, ends, ids, parents))


def assign_lanes_columns(starts: array[int], ends: array[int], ids: array[int],
                         parents: array[int]) -> array[int]:  # fmt: skip
    """A lane per span such that spans of one lane nest properly (each is inside or disjoint from
    every other). Greedy over spans sorted by (start, -end) (:class:`LaneSweep`). Returns lanes
    in input order."""
    import numpy as np  # only here: an argsort without a Python object per span

    n = len(starts)
    st = np.frombuffer(starts, dtype=np.int64) if n else np.zeros(0, np.int64)
    en = np.frombuffer(ends, dtype=np.int64) if n else np.zeros(0, np.int64)
    order = np.lexsort((-en, st))  # primary key start, then longest first (parents first)
    lanes = array("H", bytes(2 * n))
    sweep = LaneSweep()
    for lo in range(0, n, _SORT_CHUNK):
        rows = order[lo : lo + _SORT_CHUNK].tolist()
        got = sweep.feed([starts[i] for i in rows], [ends[i] for i in rows],
                         [ids[i] for i in rows], [parents[i] for i in rows])  # fmt: skip
        for i, la in zip(rows, got, strict=True):
            lanes[i] = la
    return lanes


class LaneSweep:
    """The lane rule over one thread's spans fed in order of (start, -end, read order), in
    pieces of any size: a span goes to the lane where its parent is open if it fits there, else
    the first lane where it fits, else a new lane. It holds only the open spans, so the span
    store's export can stream a thread's spans sorted by DuckDB (spilling) at any size."""

    def __init__(self) -> None:
        self.stacks: list[list[tuple[int, int]]] = []  # per lane: (end, span id) of open spans
        self.open_lane: dict[int, int] = {}  # span id -> lane, for spans pushed, not popped

    @property
    def lanes(self) -> int:
        return len(self.stacks)

    def feed(self, starts: Sequence[int], ends: Sequence[int], ids: Sequence[int],
             parents: Sequence[int]) -> list[int]:  # fmt: skip
        """The lanes of the next spans in sweep order."""
        stacks, open_lane = self.stacks, self.open_lane
        out = []
        for s, e, sid, parent in zip(starts, ends, ids, parents, strict=True):
            preferred = open_lane.get(parent)
            chosen = -1
            for k in ([preferred] if preferred is not None else []) + list(range(len(stacks))):
                stack = stacks[k]
                while stack and stack[-1][0] <= s:
                    open_lane.pop(stack.pop()[1], None)
                if not stack or e <= stack[-1][0]:
                    chosen = k
                    break
            if chosen < 0:
                chosen = len(stacks)
                stacks.append([])
            stacks[chosen].append((e, sid))
            open_lane[sid] = chosen
            out.append(chosen)
        return out
