"""``mlaunch trace export --format chrome`` on the span store: the same bytes as
:class:`~mlaunch.trace.chrome.ChromeExporter` over the JSON, built column-wise.

Pass 1 reads six columns of every part (times, ids, resource, attributes as a dictionary) into
numpy arrays: span ids are decoded from hex in one ``bytes.fromhex`` per part, the thread of a
span comes from its attribute list, decoded once per dictionary entry of the part (the parts
store them dictionary-encoded; nothing is cached across parts, so memory does not grow with the
number of distinct lists), and lanes are assigned per thread by the JSON path's own
:func:`~mlaunch.trace.chrome.assign_lanes_columns`. Pass 2 writes each part's complete events as
one Arrow string array (``binary_join_element_wise`` of per-span columns: name and args texts
taken from per-entry tables, times formatted from integer nanoseconds) and writes its bytes in
one call. Only the few spans the columns cannot say exactly are written by the JSON path's code,
span by span: spans with an ERROR status (their message is in ``extra``), attribute lists with a
key the exporter itself sets (``span_id``, ``status``, ``status_message``), ids that are not 16 hex
digits; and the span events and links that follow a span.

Memory: 5 int64s and 2 int32s per span for the layout (the JSON path's pass 1 keeps 4 int64s),
plus one part at a time.
"""

from __future__ import annotations

import re
from typing import Any, TextIO

from orjson import loads

from mlaunch.model.spans import ResourceAttr, span_def
from mlaunch.telemetry.otlp_json import attributes
from mlaunch.trace.chrome import (
    LAUNCHER_PID,
    THREAD_ID_ATTR,
    THREAD_NAME_ATTR,
    ChromeStats,
    _dumps,
    _sid,
    _us,
    assign_lanes_columns,
)
from mlaunch.trace.reader import Resource
from mlaunch.trace.store import Store, StoreReader

#: Keys the exporter adds to ``args`` after the span's attributes: a list that already has one
#: would have it overwritten in place (dict order), so such spans take the span-by-span path.
_OWN_KEYS = frozenset({"span_id", "status", "status_message"})
_HEX16 = re.compile(r"^[0-9a-fA-F]{16}$")
_PASS1 = ["span_id", "parent_id", "start_ns", "end_ns", "resource_id", "attributes", "links"]
#: Rows whose event texts are built at once (about 8 MB of text).
_SLICE = 32_768
_PASS2 = ["name", "span_id", "status", "attributes", "links", "events", "extra"]
#: ``_us`` of the 1000 sub-microsecond remainders, as text after the point.
#: From here on (10^11 us) the text of an exact 3-decimal value may not be what repr prints.
_BIG_NS = 10**14
_FRAC = ["0"] + [f"{i:03d}".rstrip("0") for i in range(1, 1000)]


def _pid(res: Resource) -> int:
    return LAUNCHER_PID + (-1 - res.rank) if res.launcher else res.rank


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
    """(thread key, thread name) of an attribute list, as the JSON path's ``_thread_key``."""
    a = _args(text)
    return a.get(THREAD_ID_ATTR), a.get(THREAD_NAME_ATTR)


def _head(text: str | None) -> tuple[str, bool]:
    """The ``args`` text of an attribute list up to where the exporter's own keys go ('{' or
    '{...,'), and whether it has one of those keys (then its spans go span by span)."""
    a = _args(text)
    body = _dumps(a)
    return ("{" if body == "{}" else body[:-1] + ","), not _OWN_KEYS.isdisjoint(a)


def export_chrome_store(store: Store, out: TextIO) -> ChromeStats:
    """Write the store's spans as Chrome trace-event JSON to ``out`` (what
    :meth:`ChromeExporter.write` writes for the same spans read from the JSON). Raises
    ``TraceInputError`` for a store without spans."""
    import numpy as np
    import pyarrow.parquet as pq

    from mlaunch.trace.summary import no_spans_error

    reader = StoreReader(store)
    resources = reader.resources()
    pid_of = {rid: _pid(r) for rid, r in resources.items()}
    tkeys: dict[Any, int] = {}  # the distinct thread keys (few), numbered
    hosts: dict[int, str | None] = {}
    run_id: Any = None
    threads: dict[tuple[int, Any], int] = {}  # (pid, thread key) -> index, first seen first
    labels: list[str] = []
    tix_parts, st_parts, en_parts, id_parts, par_parts, pid_parts = [], [], [], [], [], []
    link_targets: set[int] = set()
    for part in store.parts:
        t = pq.read_table(part, columns=_PASS1, read_dictionary=["attributes"])
        if not t.num_rows:
            continue
        rids = t.column("resource_id").to_numpy().astype(np.int64)
        first = np.unique(rids, return_index=True)
        for rid in first[0][np.argsort(first[1], kind="stable")].tolist():
            pid = pid_of[rid]
            if pid not in hosts:
                res = resources[rid]
                host = res.attrs.get(ResourceAttr.HOST_NAME)
                hosts[pid] = None if host is None else str(host)
                run_id = run_id or res.attrs.get(ResourceAttr.RUN_ID)
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
        tix_parts.append(tmap[inv.reshape(-1)])
        starts = t.column("start_ns").to_numpy().astype(np.int64)
        st_parts.append(starts)
        en_parts.append(np.maximum(starts, t.column("end_ns").to_numpy().astype(np.int64)))
        id_parts.append(_hex_ids(t.column("span_id"), np))
        par_parts.append(_hex_ids(t.column("parent_id"), np))
        pid_parts.append(pids)
        for lk in t.column("links").drop_null().to_pylist():
            for x in loads(lk):
                link_targets.add(_sid(x.get("spanId")))
    if not st_parts:
        raise no_spans_error(reader)  # type: ignore[arg-type]
    tix = np.concatenate(tix_parts)
    starts = np.concatenate(st_parts)
    ends = np.concatenate(en_parts)
    ids = np.concatenate(id_parts)
    parents = np.concatenate(par_parts)
    pids = np.concatenate(pid_parts)
    del tix_parts, st_parts, en_parts, id_parts, par_parts, pid_parts
    t0 = int(starts.min())

    # Layout: lanes per thread (in (pid, str(key)) order), tids per process.
    st = ChromeStats(processes=len(hosts), threads=len(threads))
    order = np.argsort(tix, kind="stable")  # each thread's spans, in read order
    bounds = np.searchsorted(tix[order], np.arange(len(labels) + 1))
    lane = np.zeros(len(tix), np.int32)
    base = np.zeros(len(labels), np.int64)
    n_lanes = np.zeros(len(labels), np.int64)
    next_tid: dict[int, int] = {}
    for (pid, _), ti in sorted(threads.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        rows = order[bounds[ti] : bounds[ti + 1]]
        lanes = assign_lanes_columns(
            *(np.ascontiguousarray(a[rows]) for a in (starts, ends, ids, parents))
        )
        la = np.frombuffer(lanes, dtype=np.uint16) if len(lanes) else np.zeros(0, np.uint16)
        lane[rows] = la
        base[ti] = next_tid.get(pid, 0)
        n_lanes[ti] = 1 + (int(la.max()) if len(la) else 0)
        next_tid[pid] = int(base[ti] + n_lanes[ti])
        st.lanes += int(n_lanes[ti])
    tids = base[tix] + lane
    del order, lane

    sources: dict[int, tuple[int, int, int]] = {}
    if link_targets:
        hit = np.nonzero(np.isin(ids, np.array(sorted(link_targets), np.int64)))[0]
        for i in hit[np.lexsort((hit, tix[hit]))].tolist():  # the JSON path's dict order
            sources[int(ids[i])] = (int(pids[i]), int(tids[i]), int(starts[i]))

    out.write('{"displayTimeUnit":"ms","otherData":')
    out.write(_dumps({"generator": "mlaunch trace export", "run_id": run_id,
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
    for (pid, _), ti in sorted(threads.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
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
        if t.num_rows:
            for b in t.to_batches():  # one dictionary per batch
                sl = slice(row, row + b.num_rows)
                writer.part(b, pids[sl], tids[sl], starts[sl], ends[sl])
                row += b.num_rows
    out.write("\n]}\n")
    st.spans = row
    return st


class _Pass2:
    """Pass 2 over one part at a time: complete events column-wise, the rest span by span."""

    def __init__(self, out: TextIO, sources: dict[int, tuple[int, int, int]], t0: int,
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
        """The JSON path's complete event of row ``i``, span by span."""
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
                src = self.sources.get(_sid(lk.get("spanId")))
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
    """:func:`~mlaunch.trace.chrome._us` of non-negative int64 nanoseconds, as text: the integer
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
