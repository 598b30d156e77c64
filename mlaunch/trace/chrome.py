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

Two passes over the input keep memory small: lane assignment needs each thread's spans sorted,
so pass 1 keeps only start, end, span id and parent id per span (four int64s in ``array('q')``
columns) and assigns lanes; pass 2 re-reads the files in the same order and writes each event as
it goes, finding its lane by its position in its thread.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from mlaunch.model.spans import ResourceAttr, span_def
from mlaunch.otlp.otlp_json import attributes
from mlaunch.trace.links import LinkTargets
from mlaunch.trace.reader import Resource, TraceReader, is_error

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


def _thread_key(span: dict[str, Any]) -> tuple[Any, Any]:
    """(thread id, thread name) from the span's attributes, without decoding all of them."""
    tid = tname = None
    for kv in span.get("attributes") or ():
        k = kv.get("key") if isinstance(kv, dict) else None
        if k in (THREAD_ID_ATTR, THREAD_NAME_ATTR):
            v = attributes([kv])[k]
            if k == THREAD_ID_ATTR:
                tid = v
            else:
                tname = v
    return tid, tname


@dataclass
class _Thread:
    """Pass-1 columns of one (rank, OS thread), then its lanes."""

    label: str
    starts: array[int] = field(default_factory=lambda: array("q"))
    ends: array[int] = field(default_factory=lambda: array("q"))
    ids: array[int] = field(default_factory=lambda: array("q"))
    parents: array[int] = field(default_factory=lambda: array("q"))
    lanes: array[int] = field(default_factory=lambda: array("H"))
    base_tid: int = 0
    written: int = 0  # pass 2: spans of this thread written so far


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


class ChromeExporter:
    """Pass 1 (:meth:`scan`) then pass 2 (:meth:`write`) over the same files."""

    def __init__(self) -> None:
        self.threads: dict[tuple[int, Any], _Thread] = {}
        self.hosts: dict[int, str | None] = {}
        self.run_id: Any = None
        self.t0: int | None = None
        self.link_targets: set[int] = set()

    def scan(self, res: Resource, spans: list[dict[str, Any]]) -> None:
        """Pass 1: keep four int64s per span, per thread; note link targets."""
        rank = _pid(res)
        if rank not in self.hosts:
            host = res.attrs.get(ResourceAttr.HOST_NAME)
            self.hosts[rank] = None if host is None else str(host)
            self.run_id = self.run_id or res.attrs.get(ResourceAttr.RUN_ID)
        t0 = self.t0
        for s in spans:
            start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
            if t0 is None or start < t0:
                t0 = start
            tkey, tname = _thread_key(s)
            th = self.threads.get((rank, tkey))
            if th is None:
                label = "main" if tkey is None else f"thread {tkey}"
                if tname:
                    label = f"{tname} ({tkey})"
                th = self.threads[(rank, tkey)] = _Thread(label)
            th.starts.append(start)
            th.ends.append(max(start, end))  # a clock step back must not break nesting
            th.ids.append(_sid(s.get("spanId")))
            th.parents.append(_sid(s.get("parentSpanId")))
            for lk in s.get("links") or ():
                self.link_targets.add(_sid(lk.get("spanId")))
        self.t0 = t0

    def layout(self) -> ChromeStats:
        """Between the passes: lanes per thread, tids per process."""
        st = ChromeStats(
            processes=len(self.hosts),
            launchers=sum(pid >= LAUNCHER_PID for pid in self.hosts),
            threads=len(self.threads),
        )
        next_tid: dict[int, int] = {}
        for (rank, _), th in sorted(self.threads.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            th.lanes = assign_lanes_columns(th.starts, th.ends, th.ids, th.parents)
            th.base_tid = next_tid.get(rank, 0)
            n_lanes = 1 + max(th.lanes, default=0)
            next_tid[rank] = th.base_tid + n_lanes
            st.lanes += n_lanes
        return st

    def _link_sources(self) -> LinkTargets[tuple[int, int, int]]:
        """Where each linked-to span was placed: (pid, tid, start), by rank and span id."""
        out: LinkTargets[tuple[int, int, int]] = LinkTargets()
        if not self.link_targets:
            return out
        for (rank, _), th in self.threads.items():
            for i, sid in enumerate(th.ids):
                if sid in self.link_targets:
                    out.add(rank, sid, (rank, th.base_tid + th.lanes[i], th.starts[i]))
        return out

    def write(self, reader: TraceReader, out: TextIO, st: ChromeStats) -> ChromeStats:
        """Pass 2: stream every event to ``out``."""
        t0 = self.t0 or 0
        sources = self._link_sources()
        out.write('{"displayTimeUnit":"ms","otherData":')
        out.write(_dumps({"generator": "mlaunch trace export", "run_id": self.run_id,
                          "t0_unix_nano": str(t0)}))  # fmt: skip
        out.write(',"traceEvents":[\n')
        first = True

        def emit(ev: str) -> None:
            nonlocal first
            out.write(ev if first else ",\n" + ev)
            first = False

        for rank in sorted(self.hosts):
            host = self.hosts[rank]
            pname = (
                f"launcher (node {rank - LAUNCHER_PID})" if rank >= LAUNCHER_PID else f"rank {rank}"
            ) + (f" ({host})" if host else "")
            emit(_dumps({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                         "args": {"name": pname}}))  # fmt: skip
            emit(_dumps({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                         "args": {"sort_index": rank}}))  # fmt: skip
        for (rank, _), th in sorted(self.threads.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            for k in range(1 + max(th.lanes, default=0)):
                label = th.label if k == 0 else f"{th.label} lane {k}"
                tid = th.base_tid + k
                emit(_dumps({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                             "args": {"name": label}}))  # fmt: skip
                emit(_dumps({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                             "args": {"sort_index": tid}}))  # fmt: skip

        cats: dict[str, str] = {}
        flow_id = 0
        for res, spans, _ in reader:
            rank = _pid(res)
            for s in spans:
                args = attributes(s.get("attributes"))
                try:
                    th = self.threads[(rank, args.get(THREAD_ID_ATTR))]
                    i = th.written
                    lane = th.lanes[i]
                except (KeyError, IndexError):
                    raise reader.error_here(
                        "the trace changed between export's two reads",
                        fix="export again once the run has finished writing",
                    ) from None
                th.written += 1
                tid = th.base_tid + lane
                name = s["name"]
                cat = cats.get(name)
                if cat is None:
                    try:
                        cat = cats[name] = str(span_def(name).group)
                    except KeyError:
                        cat = cats[name] = "span"
                args["span_id"] = s.get("spanId", "")
                if is_error(s):
                    args["status"] = "ERROR"
                    if msg := (s.get("status") or {}).get("message"):
                        args["status_message"] = msg
                start = th.starts[i]
                emit(
                    f'{{"name":{_dumps(name)},"cat":"{cat}","ph":"X","pid":{rank},"tid":{tid},'
                    f'"ts":{_us(start - t0)},"dur":{_us(th.ends[i] - start)},"args":{_dumps(args)}}}'
                )
                st.spans += 1
                for ev in s.get("events") or ():
                    emit(
                        f'{{"name":{_dumps(str(ev.get("name", "event")))},"cat":"event","ph":"i",'
                        f'"s":"t","pid":{rank},"tid":{tid},'
                        f'"ts":{_us(int(ev["timeUnixNano"]) - t0)},'
                        f'"args":{_dumps(attributes(ev.get("attributes")))}}}'
                    )
                    st.instant_events += 1
                for lk in s.get("links") or ():
                    src = sources.resolve(rank, _sid(lk.get("spanId")))
                    if src is None:
                        st.unresolved_links += 1  # the linked span's rank did not export
                        continue
                    flow_id += 1
                    spid, stid, sstart = src
                    emit(_dumps({"name": "link", "cat": "link", "ph": "s", "id": flow_id,
                                 "pid": spid, "tid": stid, "ts": _us(sstart - t0)}))  # fmt: skip
                    emit(_dumps({"name": "link", "cat": "link", "ph": "f", "bp": "e",
                                 "id": flow_id, "pid": rank, "tid": tid,
                                 "ts": _us(start - t0)}))  # fmt: skip
                    st.flows += 1
        out.write("\n]}\n")
        return st
