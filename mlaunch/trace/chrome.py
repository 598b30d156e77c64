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
Unlike summary and goodput, export holds one compact record per span until it writes, because
lane assignment needs each thread's spans sorted.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from mlaunch.model.spans import ResourceAttr, span_def
from mlaunch.trace.reader import Resource, TraceReader, attributes, is_error
from mlaunch.trace.summary import no_spans_error

#: Span attributes that name the OS thread (OpenTelemetry semantic conventions).
THREAD_ID_ATTR = "thread.id"
THREAD_NAME_ATTR = "thread.name"
_dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode


class _Span(NamedTuple):
    """What export keeps of a span until it writes (args already serialized)."""

    start: int
    end: int
    name: str
    cat: str
    args_json: str
    key: tuple[str, str]  # (traceId, spanId)
    parent: str
    events: list[tuple[int, str, str]] | None  # (time, name, args json)
    links: list[tuple[str, str]] | None


@dataclass
class _Thread:
    """Spans of one (rank, OS thread)."""

    label: str
    spans: list[_Span] = field(default_factory=list)


@dataclass
class ChromeStats:
    """Counts reported after an export."""

    spans: int = 0
    processes: int = 0
    threads: int = 0
    lanes: int = 0
    flows: int = 0
    unresolved_links: int = 0
    instant_events: int = 0


def _us(ns: int) -> float:
    """Nanoseconds -> microseconds with nanosecond precision kept (3 decimals)."""
    return round(ns / 1000.0, 3)


class ChromeBuilder:
    """Collects spans per (rank, thread) and writes Chrome trace-event JSON."""

    def __init__(self) -> None:
        self.threads: dict[tuple[int, Any], _Thread] = {}
        self.hosts: dict[int, str | None] = {}
        self.run_id: Any = None
        self.t0: int | None = None

    def add(
        self, res: Resource, spans: list[dict[str, Any]], maybe_truncated: bool = False
    ) -> None:
        """Fold one batch in."""
        rank = res.rank
        if rank not in self.hosts:
            host = res.attrs.get(ResourceAttr.HOST_NAME)
            self.hosts[rank] = None if host is None else str(host)
            self.run_id = self.run_id or res.attrs.get(ResourceAttr.RUN_ID)
        for s in spans:
            start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
            if self.t0 is None or start < self.t0:
                self.t0 = start
            name = s["name"]
            args = attributes(s.get("attributes"))
            tkey = args.get(THREAD_ID_ATTR)
            tname = args.get(THREAD_NAME_ATTR)
            args["span_id"] = s.get("spanId", "")
            if is_error(s):
                args["status"] = "ERROR"
                if msg := (s.get("status") or {}).get("message"):
                    args["status_message"] = msg
            events = None
            if evs := s.get("events"):
                events = [
                    (int(e["timeUnixNano"]), str(e.get("name", "event")),
                     _dumps(attributes(e.get("attributes"))))
                    for e in evs
                ]  # fmt: skip
            links = None
            if lks := s.get("links"):
                links = [(lk.get("traceId", ""), lk.get("spanId", "")) for lk in lks]
            try:
                cat = str(span_def(name).group)
            except KeyError:
                cat = "span"
            th = self.threads.get((rank, tkey))
            if th is None:
                label = "main" if tkey is None else f"thread {tkey}"
                if tname:
                    label = f"{tname} ({tkey})"
                th = self.threads[(rank, tkey)] = _Thread(label)
            th.spans.append(
                _Span(start, end, name, cat, _dumps(args), (s.get("traceId", ""), s.get("spanId", "")),
                      s.get("parentSpanId") or "", events, links)
            )  # fmt: skip

    def write(self, out: TextIO) -> ChromeStats:
        """Write the trace JSON to ``out`` (streamed event by event) and return counts."""
        st = ChromeStats(processes=len(self.hosts))
        t0 = self.t0 or 0
        placed: dict[tuple[str, str], tuple[int, int, int]] = {}  # span key -> (pid, tid, start)
        wanted = {lk for th in self.threads.values() for sp in th.spans for lk in sp.links or ()}
        pending: list[tuple[int, int, int, tuple[str, str]]] = []  # (pid, tid, ts, target)

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
            pname = f"rank {rank}" + (f" ({host})" if host else "")
            emit(_dumps({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                         "args": {"name": pname}}))  # fmt: skip
            emit(_dumps({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                         "args": {"sort_index": rank}}))  # fmt: skip
        next_tid: dict[int, int] = {}
        for (rank, _tkey), th in sorted(
            self.threads.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))
        ):
            lanes = assign_lanes(th.spans)
            st.threads += 1
            base = next_tid.get(rank, 0)
            n_lanes = 1 + max(lanes, default=0)
            next_tid[rank] = base + n_lanes
            st.lanes += n_lanes
            for k in range(n_lanes):
                label = th.label if k == 0 else f"{th.label} lane {k}"
                emit(_dumps({"name": "thread_name", "ph": "M", "pid": rank, "tid": base + k,
                             "args": {"name": label}}))  # fmt: skip
                emit(_dumps({"name": "thread_sort_index", "ph": "M", "pid": rank,
                             "tid": base + k, "args": {"sort_index": base + k}}))  # fmt: skip
            for sp, lane in zip(th.spans, lanes, strict=True):
                tid = base + lane
                ts = _us(sp.start - t0)
                emit(
                    f'{{"name":{_dumps(sp.name)},"cat":"{sp.cat}","ph":"X","pid":{rank},'
                    f'"tid":{tid},"ts":{ts},"dur":{_us(sp.end - sp.start)},"args":{sp.args_json}}}'
                )
                st.spans += 1
                if sp.key in wanted:
                    placed[sp.key] = (rank, tid, sp.start)
                for t, name, args_json in sp.events or ():
                    emit(
                        f'{{"name":{_dumps(name)},"cat":"event","ph":"i","s":"t","pid":{rank},'
                        f'"tid":{tid},"ts":{_us(t - t0)},"args":{args_json}}}'
                    )
                    st.instant_events += 1
                for target in sp.links or ():
                    pending.append((rank, tid, sp.start, target))
        for flow_id, (pid, tid, start, target) in enumerate(pending, start=1):
            src = placed.get(target)
            if src is None:
                st.unresolved_links += 1  # the linked span's rank did not export
                continue
            spid, stid, sstart = src
            emit(_dumps({"name": "link", "cat": "link", "ph": "s", "id": flow_id, "pid": spid,
                         "tid": stid, "ts": _us(sstart - t0)}))  # fmt: skip
            emit(_dumps({"name": "link", "cat": "link", "ph": "f", "bp": "e", "id": flow_id,
                         "pid": pid, "tid": tid, "ts": _us(start - t0)}))  # fmt: skip
            st.flows += 1
        out.write("\n]}\n")
        return st


def assign_lanes(spans: list[_Span]) -> list[int]:
    """A lane per span such that spans of one lane nest properly (each is inside or disjoint from
    every other). Greedy over spans sorted by (start, -end): a span goes to its parent's lane if it
    fits there, else the first lane where it fits, else a new lane. Returns lanes in input order."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end, i))
    stacks: list[list[int]] = []  # per lane: ends of the open spans, innermost last
    lane_of_span: dict[str, int] = {}
    lanes = [0] * len(spans)
    for i in order:
        sp = spans[i]
        preferred = lane_of_span.get(sp.parent)
        candidates: Iterable[int] = range(len(stacks))
        if preferred is not None:
            candidates = [preferred, *range(len(stacks))]
        chosen = -1
        for k in candidates:
            stack = stacks[k]
            while stack and stack[-1] <= sp.start:
                stack.pop()
            if not stack or sp.end <= stack[-1]:
                chosen = k
                break
        if chosen < 0:
            chosen = len(stacks)
            stacks.append([])
        stacks[chosen].append(sp.end)
        lanes[i] = chosen
        lane_of_span[sp.key[1]] = chosen
    return lanes


def export_chrome(reader: TraceReader, out_path: Path) -> ChromeStats:
    """Read every batch of ``reader`` and write Chrome trace-event JSON to ``out_path``. Raises
    ``TraceInputError`` for a malformed span (naming its file and line) or a trace without spans."""
    # The builder holds millions of small tuples and creates no reference cycles; the cyclic
    # GC would rescan them over and over as they accumulate (measured ~1.5x slower with it on).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        b = ChromeBuilder()
        for res, spans, _ in reader:
            try:
                b.add(res, spans)
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                raise reader.error_here(f"malformed span ({type(e).__name__}: {e})") from None
        if b.t0 is None:
            raise no_spans_error(reader)
        tmp = out_path.with_name(out_path.name + ".tmp")
        with open(tmp, "w") as f:
            stats = b.write(f)
        tmp.replace(out_path)  # never leave a half-written trace that looks complete
        return stats
    finally:
        if gc_was_enabled:
            gc.enable()
