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

The writer (:func:`export_chrome`, over the span store) and the report's timeline
(:func:`assign_lanes`) share the format's rules: process ids, span ids as integers, microsecond
times and the lane rule (:class:`LaneSweep`).

The writer works column-wise. Pass 1 reads seven columns of every part (times, ids, resource,
attributes as a dictionary, links): span ids are decoded from hex in one ``bytes.fromhex`` per part,
the thread of a span comes from its attribute list, decoded once per dictionary entry of the part
(the parts store them dictionary-encoded; nothing is cached across parts, so memory does not grow
with the number of distinct lists), and each part's (row, thread, start, end, id, parent) columns
are written to a scratch Parquet file. The layout: DuckDB sorts those rows by thread, start, longest
first and read order (the order :func:`assign_lanes_columns` sorts each thread's spans in), spilling
to disk past its memory limit, and hands them over a record batch at a time to the same greedy rule
(:class:`LaneSweep`), which holds only the open spans. Pass 2 writes each part's complete events as
one Arrow string array (``binary_join_element_wise`` of per-span columns: name and args texts taken
from per-entry tables, times formatted from integer nanoseconds) and writes its bytes in one call.
Only the few spans the columns cannot say exactly are written span by span: spans with an ERROR
status (their message is in ``extra``), attribute lists with a key the exporter itself sets
(``span_id``, ``status``, ``status_message``), ids that are not 16 hex digits; and the span events
and links that follow a span.

Memory: one part's rows, DuckDB's limit, and each span's lane (2 bytes: 200 MB at 10^8 spans;
a list of span records would take 32 bytes a span). Disk: the scratch rows (about 45 bytes a span,
in the store's directory) and DuckDB's spill, both removed when the export ends.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from orjson import loads

from mlaunch.model.spans import ResourceAttr, span_def
from mlaunch.otlp.otlp_json import attributes
from mlaunch.outputs import open_output
from mlaunch.trace.links import LinkTargets
from mlaunch.trace.reader import Resource, no_spans_error
from mlaunch.trace.store import Store, StoreReader, _sql_str

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


#: Keys the exporter adds to ``args`` after the span's attributes: a list that already has one
#: would have it overwritten in place (dict order), so such spans take the span-by-span path.
_OWN_KEYS = frozenset({"span_id", "status", "status_message"})
_HEX16 = re.compile(r"^[0-9a-fA-F]{16}$")
_PASS1 = ["span_id", "parent_id", "start_ns", "end_ns", "resource_id", "attributes", "links"]
#: Rows whose event texts are built at once (about 8 MB of text).
_SLICE = 32_768
_PASS2 = ["name", "span_id", "status", "attributes", "links", "events", "extra", "start_ns",
          "end_ns", "resource_id"]  # fmt: skip
#: ``_us`` of the 1000 sub-microsecond remainders, as text after the point.
#: From here on (10^11 us) the text of an exact 3-decimal value may not be what repr prints.
_BIG_NS = 10**14
_FRAC = ["0"] + [f"{i:03d}".rstrip("0") for i in range(1, 1000)]


def _hex_ids(col: Any, np: Any) -> Any:
    """int64 span ids of an Arrow string column (null -> 0), as :func:`_sid` gives them."""
    import pyarrow.compute as pc

    n = len(col)
    col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    filled = pc.fill_null(col, "0" * 16)
    if n and pc.all(pc.equal(pc.utf8_length(filled), 16)).as_py():
        off, data = filled.buffers()[1], filled.buffers()[2]
        start = int(np.frombuffer(off, dtype=np.int32, count=n + 1, offset=filled.offset * 4)[0])
        try:
            raw = bytes.fromhex(data.to_pybytes()[start : start + 16 * n].decode())
        except ValueError:
            raw = None
        if raw is not None:
            return np.frombuffer(raw, dtype=">u8").astype(np.uint64).view(np.int64)
    return np.array([_sid(v) for v in col.to_pylist()], dtype=np.int64)


def _entries(col: Any, decode: Any, np: Any) -> tuple[list[Any], Any]:
    """``decode`` of each distinct attribute list of a column (its JSON text, or None), once
    per dictionary entry (the parts store them dictionary-encoded), and each row's entry."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        values = [decode(v) for v in col.dictionary.to_pylist()]
        idx = col.indices.fill_null(len(values)).to_numpy(zero_copy_only=False)
        values.append(decode(None))  # the null entry: a span without attributes
        return values, idx.astype(np.int64)
    values = [decode(v) for v in col.to_pylist()]
    return values, np.arange(len(values), dtype=np.int64)


def _args(text: str | None) -> dict[str, Any]:
    return attributes(loads(text)) if text is not None else {}


def _thread_of(text: str | None) -> tuple[Any, Any]:
    """(thread key, thread name) of an attribute list: ``thread.id`` and ``thread.name``."""
    a = _args(text)
    return a.get(THREAD_ID_ATTR), a.get(THREAD_NAME_ATTR)


def _head(text: str | None) -> tuple[str, bool]:
    """The ``args`` text of an attribute list up to where the exporter's own keys go ('{' or
    '{...,'), and whether it has one of those keys (then its spans go span by span)."""
    a = _args(text)
    body = _dumps(a)
    return ("{" if body == "{}" else body[:-1] + ","), not _OWN_KEYS.isdisjoint(a)


class _Threads:
    """The processes and threads of the spans, numbered in order of first appearance (pass 1
    registers them; pass 2, over the same parts, finds the same numbers)."""

    def __init__(self, resources: dict[int, Resource]) -> None:
        self.resources = resources
        self.pid_of = {rid: _pid(r) for rid, r in resources.items()}
        self.tkeys: dict[Any, int] = {}  # the distinct thread keys (few), numbered
        self.hosts: dict[int, str | None] = {}
        self.run_id: Any = None
        self.threads: dict[tuple[int, Any], int] = {}  # (pid, thread key) -> index
        self.labels: list[str] = []

    def of_part(self, t: Any, np: Any) -> tuple[Any, Any]:
        """Each row's pid and thread index (``t``: a part's ``resource_id`` and ``attributes``,
        the latter read as a dictionary)."""
        resources, pid_of, tkeys, threads, labels = (
            self.resources, self.pid_of, self.tkeys, self.threads, self.labels
        )  # fmt: skip
        rids = t.column("resource_id").to_numpy().astype(np.int64)
        first = np.unique(rids, return_index=True)
        for rid in first[0][np.argsort(first[1], kind="stable")].tolist():
            pid = pid_of[rid]
            if pid not in self.hosts:
                res = resources[rid]
                host = res.attrs.get(ResourceAttr.HOST_NAME)
                self.hosts[pid] = None if host is None else str(host)
                self.run_id = self.run_id or res.attrs.get(ResourceAttr.RUN_ID)
        lut = np.array([pid_of.get(r, 0) for r in range(int(rids.max()) + 1)], np.int64)
        pids = lut[rids]
        # thread of each span: its (pid, thread key), numbered in order of first appearance
        ents, rows = [], []
        for chunk in t.column("attributes").chunks:
            e, r = _entries(chunk, _thread_of, np)
            rows.append(r + len(ents))
            ents += e
        ent = np.concatenate(rows)
        tk_of = np.array([tkeys.setdefault(k, len(tkeys)) for k, _ in ents], np.int64)
        pair = pids * (len(tkeys) + 1) + tk_of[ent]
        upair, ufirst, inv = np.unique(pair, return_index=True, return_inverse=True)
        tmap = np.empty(len(upair), np.int32)
        for k in np.argsort(ufirst, kind="stable").tolist():
            tk, tn = ents[int(ent[ufirst[k]])]  # the thread's first span names it
            key = (int(pids[ufirst[k]]), tk)
            ti = threads.get(key)
            if ti is None:
                ti = threads[key] = len(labels)
                labels.append(f"{tn} ({tk})" if tn else ("main" if tk is None else f"thread {tk}"))
            tmap[k] = ti
        return pids, tmap[inv.reshape(-1)]

    def in_order(self) -> list[tuple[int, int]]:
        """(pid, thread index) of every thread, in the order of their tids: by pid, then key."""
        return [
            (pid, ti)
            for (pid, _), ti in sorted(
                self.threads.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))
            )
        ]


#: DuckDB's memory for the layout's sort (it spills past it): the export also holds each span's
#: lane meanwhile (200 MB at 10^8 spans), so it leaves DuckDB less than the other readers.
SORT_MEMORY = "256MB"
#: The sorted layout rows DuckDB hands over at a time.
_SWEEP_BATCH = 65_536


def _lanes(store: Store, scratch: Path, n: int, n_threads: int, targets: Any, np: Any,
           pa: Any) -> tuple[Any, Any, list[tuple[int, int, int, int, int]]]:  # fmt: skip
    """Lanes of the spans written to ``scratch`` by pass 1 (row, thread, start, end, id,
    parent), each thread's spans sorted by DuckDB (start, longest first, read order: the JSON
    path's order, spilling to disk past its memory limit) and swept by
    :class:`LaneSweep`: each row's lane (2 bytes a span: the only
    per-span state the export keeps), each thread's lane count, and the (thread, row, id,
    lane, start) of the spans whose id is in ``targets`` (link targets)."""
    lane = np.zeros(n, np.uint16)
    n_lanes = np.zeros(n_threads, np.int64)
    hits: list[tuple[int, int, int, int, int]] = []
    pa.default_memory_pool().release_unused()  # pass 1's part buffers, before DuckDB's
    con = store.connect(memory_limit=SORT_MEMORY)
    try:
        files = ", ".join(_sql_str(p) for p in sorted(scratch.glob("*.parquet")))
        rel = con.sql(
            f"SELECT tix, st, en, sid, par, row FROM read_parquet([{files}])"
            " ORDER BY tix, st, en DESC, row"
        )
        sweep, cur = LaneSweep(), -1
        # A stream of record batches (DuckDB < 1.4 names it fetch_record_batch)
        stream = getattr(rel, "to_arrow_reader", None) or rel.fetch_record_batch
        for batch in stream(_SWEEP_BATCH):
            tix, st, en, sid, par, row = (batch.column(i).to_numpy() for i in range(6))
            out = np.empty(len(row), np.int64)
            cuts = [0, *(np.flatnonzero(tix[1:] != tix[:-1]) + 1).tolist(), len(row)]
            for a, b in zip(cuts, cuts[1:], strict=False):
                if a == b:
                    continue
                if int(tix[a]) != cur:
                    if cur >= 0:
                        n_lanes[cur] = sweep.lanes
                    sweep, cur = LaneSweep(), int(tix[a])
                out[a:b] = sweep.feed(st[a:b].tolist(), en[a:b].tolist(), sid[a:b].tolist(),
                                      par[a:b].tolist())  # fmt: skip
            lane[row] = out
            if len(targets):
                for i in np.flatnonzero(np.isin(sid, targets)).tolist():
                    hits.append((int(tix[i]), int(row[i]), int(sid[i]), int(out[i]),
                                 int(st[i])))  # fmt: skip
        if cur >= 0:
            n_lanes[cur] = sweep.lanes
    finally:
        con.close()
    return lane, n_lanes, hits


def export_chrome_store(store: Store, out: TextIO) -> ChromeStats:
    """Write the store's spans as Chrome trace-event JSON to ``out``. Raises
    ``TraceInputError`` for a store without spans."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=".export-", dir=store.scratch_dir()) as tmp:
        return _export(store, out, Path(tmp))


def _export(store: Store, out: TextIO, scratch: Path) -> ChromeStats:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = StoreReader(store)
    th = _Threads(reader.resources())
    link_targets: set[int] = set()
    t0: int | None = None
    n = 0
    for k, part in enumerate(store.parts):
        t = pq.read_table(part, columns=_PASS1, read_dictionary=["attributes"])
        if not t.num_rows:
            continue
        pids, tix = th.of_part(t, np)
        starts = t.column("start_ns").to_numpy().astype(np.int64)
        lo = int(starts.min())
        t0 = lo if t0 is None else min(t0, lo)
        rows = t.num_rows
        cols = {
            "row": pa.array(np.arange(n, n + rows, dtype=np.int64)), "tix": pa.array(tix),
            "st": pa.array(starts),
            "en": pa.array(np.maximum(starts, t.column("end_ns").to_numpy().astype(np.int64))),
            "sid": pa.array(_hex_ids(t.column("span_id"), np)),
            "par": pa.array(_hex_ids(t.column("parent_id"), np)),
        }  # fmt: skip
        pq.write_table(pa.table(cols), scratch / f"{k:06d}.parquet", compression="lz4")
        n += rows
        for lk in t.column("links").drop_null().to_pylist():
            for x in loads(lk):
                link_targets.add(_sid(x.get("spanId")))
    if t0 is None:
        raise no_spans_error(reader)  # type: ignore[arg-type]

    # Layout: lanes per thread (in (pid, str(key)) order), tids per process.
    hosts, threads, labels = th.hosts, th.threads, th.labels
    st = ChromeStats(
        processes=len(hosts),
        launchers=sum(pid >= LAUNCHER_PID for pid in hosts),
        threads=len(threads),
    )
    targets = np.array(sorted(link_targets), np.int64)
    lane, n_lanes, hits = _lanes(store, scratch, n, len(labels), targets, np, pa)
    base = np.zeros(len(labels), np.int64)
    next_tid: dict[int, int] = {}
    for pid, ti in th.in_order():
        base[ti] = next_tid.get(pid, 0)
        next_tid[pid] = int(base[ti] + n_lanes[ti])
        st.lanes += int(n_lanes[ti])
    pid_of_thread = {ti: pid for (pid, _), ti in threads.items()}
    sources: LinkTargets[tuple[int, int, int]] = LinkTargets()
    for ti, _, sid, la, start in sorted(hits):  # read order: the last wins
        pid = pid_of_thread[ti]
        sources.add(pid, sid, (pid, int(base[ti]) + la, start))

    out.write('{"displayTimeUnit":"ms","otherData":')
    out.write(_dumps({"generator": "mlaunch trace export", "run_id": th.run_id,
                      "t0_unix_nano": str(t0)}))  # fmt: skip
    out.write(',"traceEvents":[\n')
    meta: list[str] = []
    for pid in sorted(hosts):
        host = hosts[pid]
        pname = (
            f"launcher (node {pid - LAUNCHER_PID})" if pid >= LAUNCHER_PID else f"rank {pid}"
        ) + (f" ({host})" if host else "")
        meta.append(_dumps({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                            "args": {"name": pname}}))  # fmt: skip
        meta.append(_dumps({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                            "args": {"sort_index": pid}}))  # fmt: skip
    for pid, ti in th.in_order():
        for k in range(int(n_lanes[ti])):
            label = labels[ti] if k == 0 else f"{labels[ti]} lane {k}"
            tid = int(base[ti]) + k
            meta.append(_dumps({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                "args": {"name": label}}))  # fmt: skip
            meta.append(_dumps({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                                "args": {"sort_index": tid}}))  # fmt: skip
    out.write(",\n".join(meta))
    writer = _Pass2(out, sources, t0, st)
    row = 0
    for part in store.parts:
        t = pq.read_table(part, columns=_PASS2, read_dictionary=["name", "attributes"])
        if not t.num_rows:
            continue
        pids, tix = th.of_part(t, np)
        tids = base[tix] + lane[row : row + t.num_rows]
        starts = t.column("start_ns").to_numpy().astype(np.int64)
        ends = np.maximum(starts, t.column("end_ns").to_numpy().astype(np.int64))
        at = 0
        for b in t.to_batches():  # one dictionary per batch
            sl = slice(at, at + b.num_rows)
            writer.part(b, pids[sl], tids[sl], starts[sl], ends[sl])
            at += b.num_rows
        row += t.num_rows
    out.write("\n]}\n")
    st.spans = row
    return st


class _Pass2:
    """Pass 2 over one part at a time: complete events column-wise, the rest span by span."""

    def __init__(self, out: TextIO, sources: LinkTargets[tuple[int, int, int]], t0: int,
                 st: ChromeStats) -> None:  # fmt: skip
        self.out, self.sources, self.t0, self.st = out, sources, t0, st
        self.names: dict[str, tuple[str, str]] = {}  # name -> (its JSON text, category)
        self.flow_id = 0

    def _name(self, name: str) -> tuple[str, str]:
        got = self.names.get(name)
        if got is None:
            try:
                cat = str(span_def(name).group)
            except KeyError:
                cat = "span"
            got = self.names[name] = (_dumps(name), cat)
        return got

    def part(self, t: Any, pids: Any, tids: Any, starts: Any, ends: Any) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        n = t.num_rows
        name_col = t.column("name")
        dict_names = name_col.dictionary.to_pylist()
        named = [self._name(x) for x in dict_names]
        name_idx = name_col.indices
        head_name = pa.array(
            ['{"name":' + j + ',"cat":"' + c + '","ph":"X","pid":' for j, c in named]
        )
        heads, ent = _entries(t.column("attributes"), _head, np)
        span_ids = t.column("span_id")
        sid_ok = pc.fill_null(pc.match_substring_regex(span_ids, _HEX16.pattern), False)
        slow = (
            np.array([own for _, own in heads], bool)[ent]
            | (t.column("status").to_numpy(zero_copy_only=False) == 2)
            | ~sid_ok.to_numpy(zero_copy_only=False)
        )
        head_args = pa.array([h for h, _ in heads], pa.string())
        special = np.nonzero(
            slow
            | t.column("links").is_valid().to_numpy(zero_copy_only=False)
            | t.column("events").is_valid().to_numpy(zero_copy_only=False)
        )[0].tolist()
        sid_text = pc.fill_null(span_ids, "")
        sp = 0
        for a in range(0, n, _SLICE):  # slices: the texts of a whole part would be ~100 MB
            b = min(a + _SLICE, n)
            x = pc.binary_join_element_wise(
                pc.take(head_name, name_idx.slice(a, b - a)),
                pa.array(pids[a:b]).cast(pa.string()),
                ',"tid":',
                pa.array(tids[a:b]).cast(pa.string()),
                ',"ts":',
                _us_text(starts[a:b] - self.t0, np, pa),
                ',"dur":',
                _us_text(ends[a:b] - starts[a:b], np, pa),
                ',"args":',
                head_args.take(pa.array(ent[a:b])),
                '"span_id":"',
                sid_text.slice(a, b - a),
                '"}}',
                "",
            )
            lo = 0
            while sp < len(special) and special[sp] < b:
                i = special[sp]
                self._bulk(x, lo, i - a + (0 if slow[i] else 1))
                if slow[i]:
                    self.out.write(",\n" + self._x_line(t, i, int(pids[i]), int(tids[i]),
                                                        int(starts[i]), int(ends[i])))  # fmt: skip
                self._after(t, i, int(pids[i]), int(tids[i]), int(starts[i]))
                lo = i - a + 1
                sp += 1
            self._bulk(x, lo, b - a)

    def _bulk(self, x: Any, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` of the complete-event column, each after ',\\n', in one write."""
        if hi <= lo:
            return
        import pyarrow.compute as pc

        s = pc.binary_join_element_wise(",\n", x.slice(lo, hi - lo), "")
        self.out.write(_joined(s))

    def _x_line(self, t: Any, i: int, pid: int, tid: int, start: int, end: int) -> str:
        """The complete event of row ``i``, span by span."""
        row = {c: t.column(c)[i].as_py() for c in _PASS2}
        args = attributes(loads(row["attributes"])) if row["attributes"] is not None else {}
        extra = loads(row["extra"]) if row["extra"] is not None else {}
        args["span_id"] = row["span_id"] if row["span_id"] is not None else ""
        status = extra.get("status")
        if isinstance(status, dict) and status.get("code") in (2, "STATUS_CODE_ERROR", "2"):
            args["status"] = "ERROR"
            if msg := status.get("message"):
                args["status_message"] = msg
        jname, cat = self._name(row["name"])
        return (
            f'{{"name":{jname},"cat":"{cat}","ph":"X","pid":{pid},"tid":{tid},'
            f'"ts":{_us(start - self.t0)},"dur":{_us(end - start)},"args":{_dumps(args)}}}'
        )

    def _after(self, t: Any, i: int, pid: int, tid: int, start: int) -> None:
        """The span events (instant events) and links (flows) of row ``i``."""
        out, t0, st = self.out, self.t0, self.st
        if (ev_text := t.column("events")[i].as_py()) is not None:
            for ev in loads(ev_text):
                out.write(
                    f',\n{{"name":{_dumps(str(ev.get("name", "event")))},"cat":"event","ph":"i",'
                    f'"s":"t","pid":{pid},"tid":{tid},'
                    f'"ts":{_us(int(ev["timeUnixNano"]) - t0)},'
                    f'"args":{_dumps(attributes(ev.get("attributes")))}}}'
                )
                st.instant_events += 1
        if (lk_text := t.column("links")[i].as_py()) is not None:
            for lk in loads(lk_text):
                src = self.sources.resolve(pid, _sid(lk.get("spanId")))
                if src is None:
                    st.unresolved_links += 1
                    continue
                self.flow_id += 1
                spid, stid, sstart = src
                out.write(",\n" + _dumps({"name": "link", "cat": "link", "ph": "s",
                                          "id": self.flow_id, "pid": spid, "tid": stid,
                                          "ts": _us(sstart - t0)}))  # fmt: skip
                out.write(",\n" + _dumps({"name": "link", "cat": "link", "ph": "f", "bp": "e",
                                          "id": self.flow_id, "pid": pid, "tid": tid,
                                          "ts": _us(start - t0)}))  # fmt: skip
                st.flows += 1


def _joined(s: Any) -> str:
    """The values of a string array concatenated: its data buffer between the first and last
    offsets (no Python string per value)."""
    import numpy as np

    offs = np.frombuffer(s.buffers()[1], dtype=np.int32, count=len(s) + 1, offset=s.offset * 4)
    return s.buffers()[2].to_pybytes()[int(offs[0]) : int(offs[-1])].decode()


def _us_text(ns: Any, np: Any, pa: Any) -> Any:
    """:func:`_us` of non-negative int64 nanoseconds, as text: the integer
    microseconds, '.', the remainder without trailing zeros ('0' for none), which is what
    ``repr(round(ns / 1000.0, 3))`` prints while the value has at most 15 significant digits
    (below 10^11 us, 27 hours, from the earliest span); past that, :func:`_us` itself."""
    import pyarrow.compute as pc

    whole = pa.array(ns // 1000).cast(pa.string())
    frac = pa.array(_FRAC).take(pa.array(ns % 1000))
    text = pc.binary_join_element_wise(whole, ".", frac, "")
    big = ns >= _BIG_NS
    if big.any():
        text = pc.replace_with_mask(
            text, pa.array(big), pa.array([str(_us(int(v))) for v in ns[big].tolist()], pa.string())
        )
    return text


def export_chrome(reader: StoreReader, out_path: Path) -> ChromeStats:
    """Write Chrome trace-event JSON for the store ``reader`` reads to ``out_path``, by the rule
    of :mod:`mlaunch.outputs` (checked by the caller): never a half-written trace that looks
    complete. Raises ``TraceInputError`` for a trace without spans; ``OSError`` when the output
    cannot be written."""
    with open_output(out_path) as f:
        return export_chrome_store(reader.store, f)
