"""The columnar span store: a run's spans as Parquet, one row per span, next to its OTLP-JSON.

Layout (``RUN_DIR/trace-store/``)::

    manifest.json                      what the store holds (written last: no manifest, no store)
    resources.parquet                  one row per resource (rank, launcher, node, attributes)
    spans/rank=<R>/part-<NNNNN>.parquet  a rank's spans in read order, SEGMENT_ROWS rows a part

The launcher's job trace is rank ``-1 - node_rank`` (as :class:`~mlaunch.trace.reader.Resource`
has it). The ``rank=<R>`` directories are Hive partitions: DuckDB, Polars and Spark read
``trace-store/spans/**/*.parquet`` directly, and a query on one rank opens one directory.

Schema of ``spans`` (:data:`SPAN_SCHEMA`; docs/trace.md, "The span store"):

=============  ==========  ===============================================================
column         type        meaning
=============  ==========  ===============================================================
trace_id       string      OTLP ``traceId`` (hex)
span_id        string      OTLP ``spanId``
parent_id      string      OTLP ``parentSpanId``; null for a root
name           string      the span name as written (readers canonicalise legacy names)
group          string      the span's group in the catalogue (``mlaunch.model.spans``); null
                           for a name outside it
rank           int32       the rank: the partition key, in the path (``rank=<R>``), not in the
                           file (the launcher's job trace is ``-1 - node_rank``)
node           string      the resource's ``host.name``
iteration      int64       ``megatron.iteration`` (``megatron.eval_iteration`` for eval steps)
microbatch     int64       ``megatron.microbatch_id`` (or ``dl.microbatch_id``)
start_ns       int64       ``startTimeUnixNano``
end_ns         int64       ``endTimeUnixNano`` (an end before the start is the start)
status         int8        status code: 0 unset, 1 ok, 2 error
truncated      bool        open at shutdown (``nemo.span.truncated`` / ``mlaunch.span.truncated``)
attributes     string      the OTLP attribute list, as JSON (lossless; ``json_extract`` reads it)
links          string      the OTLP links list as JSON; null when none
events         string      the OTLP events list as JSON; null when none
extra          string      every other key of the span (kind, status, traceState...) as JSON
resource_id    int32       the row of ``resources`` the span came from
=============  ==========  ===============================================================

Why pyarrow writes it and DuckDB reads it: pyarrow turns the reader's Python columns into a
Parquet file in one call with no database process or connection to manage (each part is written
to a temporary name and renamed, so a crash or a full disk never leaves a half part under a
final name); DuckDB runs the SQL (``mlaunch trace sql``) and the vectorised readers, streaming
over the parts with its own bounded memory and spilling, so memory does not grow with the trace.

Where it is written: where the spans arrive, beside the job and never in it. The embedded
receiver appends it as its JSON grows (``mlaunch.receiver.store_append``), and the launcher brings
it up to date once the workers have exited (``mlaunch.launcher.run.finish_store``; from 64 MiB
of JSON: a smaller trace's first read builds it in under a second), both through
:func:`update_store` in a process of their own (:func:`spawn_update`); the first read builds it
for a run that has only JSON. Measured (``benchmarks/trace_read.py --writers``, 10^6 spans): a
worker writing Parquet in its file exporter would spend about 10x the CPU per span of its JSON
encoding (4.5 us against 0.47) on the training host, while the run-end build costs training
nothing (the workers have exited; 2.3 CPU-s at the end of the run, 0.5x a JSON decode, with
the C scanner of :mod:`mlaunch.trace.store_decode`) and the receiver's appends 2x one build in
all, in a niced process off the path that receives spans. One writer at a time, and none
under a reader (:class:`_RunLock`).

Freshness: the manifest records every source file's size and mtime. A store whose sources are
unchanged is used; otherwise (a live run that wrote more, a run that was restarted) it is built
again from the JSON, which stays in place: OTLP-JSON remains the interchange format. A part that
is torn (a copy cut short, a disk error) is refused with a message naming it; the store is then
rebuilt from the JSON, or, when the JSON is gone, the part is skipped.

Standalone like the reader: no telemetry runtime, no OTel SDK.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orjson import OPT_SORT_KEYS as _SORT
from orjson import dumps as _dumps
from orjson import loads as _loads

from mlaunch.model.spans import ResourceAttr
from mlaunch.trace.reader import (
    ReadStats,
    Resource,
    TraceFile,
    TraceInputError,
    TraceReader,
    discover,
    is_error,
    is_truncated,
)
from mlaunch.trace.store_decode import (
    CHUNK_BYTES,
    GROUPS,
    ITER_KEYS,
    LINE_START,
    MB_KEYS,
    parse,
    span_table,
)

STORE_DIR = "trace-store"
MANIFEST = "manifest.json"
#: Bumped when the schema changes: an older store is rebuilt, never misread.
SCHEMA_VERSION = 1
#: Rows per Parquet part: large enough for good compression and few files, small enough that
#: the builder's column buffers (Python objects until the part is written) stay near 250 MB.
SEGMENT_ROWS = 262_144

#: Keys of an OTLP span that have their own column; everything else goes to ``extra``.
_COLUMN_KEYS = frozenset(
    {"traceId", "spanId", "parentSpanId", "name", "startTimeUnixNano", "endTimeUnixNano",
     "attributes", "links", "events"}
)  # fmt: skip

_COLUMNS = (
    "trace_id", "span_id", "parent_id", "name", "group", "rank", "node", "iteration",
    "microbatch", "start_ns", "end_ns", "status", "truncated", "attributes", "links", "events",
    "extra", "resource_id",
)  # fmt: skip


def span_schema() -> Any:
    """The pyarrow schema of the ``spans`` files (imported lazily: pyarrow is only needed here)."""
    import pyarrow as pa

    s, i64 = pa.string(), pa.int64()
    return pa.schema([
        ("trace_id", s), ("span_id", s), ("parent_id", s), ("name", s), ("group", s),
        ("rank", pa.int32()), ("node", s), ("iteration", i64), ("microbatch", i64),
        ("start_ns", i64), ("end_ns", i64), ("status", pa.int8()), ("truncated", pa.bool_()),
        ("attributes", s), ("links", s), ("events", s), ("extra", s),
        ("resource_id", pa.int32()),
    ])  # fmt: skip


def file_schema() -> Any:
    """The schema of a part file: :func:`span_schema` less ``rank``, the partition key (in the
    path; Spark and Polars refuse a column that is in both the file and the partition path)."""
    schema = span_schema()
    return schema.remove(schema.get_field_index("rank"))


class StoreError(TraceInputError):
    """A store that cannot be used (a torn part and no JSON to rebuild it from)."""


@dataclass
class Manifest:
    """What ``manifest.json`` holds."""

    version: int
    sources: dict[str, list[int]]  # file name (relative to the run dir) -> [size, mtime_ns]
    files: list[dict[str, Any]]  # the TraceFiles, in read order
    parts: list[str]  # relative paths of the span parts, in read order
    spans: int
    read: dict[str, Any]  # the ReadStats of the build (files, lines, torn lines, duplicates)
    #: Per source: [bytes, lines] of its complete lines in the store (where an append resumes).
    complete: dict[str, list[int]] = field(default_factory=dict)


def store_dir(run_dir: Path) -> Path:
    return run_dir / STORE_DIR


def _sources(run_dir: Path, files: Sequence[TraceFile]) -> dict[str, list[int]]:
    out = {}
    for f in files:
        st = f.path.stat()
        out[os.path.relpath(f.path, run_dir)] = [st.st_size, st.st_mtime_ns]
    return out


def _int_attr(attrs: list[Any], keys: tuple[str, ...]) -> int | None:
    for kv in attrs:
        if type(kv) is dict and kv.get("key") in keys:
            v = kv.get("value")
            if type(v) is dict:
                x = v.get("intValue", v.get("doubleValue"))
                try:
                    return None if x is None else int(x)
                except (TypeError, ValueError, OverflowError):
                    return None
    return None


class _Columns:
    """Column buffers of one part being built."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {c: [] for c in _COLUMNS}

    def __len__(self) -> int:
        return len(self.cols["span_id"])

    def add(self, rid: int, node: str | None, spans: list[dict[str, Any]], flagged: bool) -> None:
        c = self.cols
        groups = GROUPS
        n = len(spans)
        c["node"] += [node] * n
        c["resource_id"] += [rid] * n
        tid, sid, pid, nm, gr = c["trace_id"], c["span_id"], c["parent_id"], c["name"], c["group"]
        it, mb, st, en, stat = (
            c["iteration"],
            c["microbatch"],
            c["start_ns"],
            c["end_ns"],
            c["status"],
        )
        tr, at, lk, ev, ex = c["truncated"], c["attributes"], c["links"], c["events"], c["extra"]
        for s in spans:
            tid.append(s.get("traceId"))
            sid.append(s.get("spanId"))
            pid.append(s.get("parentSpanId") or None)
            name = s["name"]
            nm.append(name)
            gr.append(groups.get(name))
            attrs = s.get("attributes") or ()
            it.append(_int_attr(attrs, ITER_KEYS) if attrs else None)
            mb.append(_int_attr(attrs, MB_KEYS) if attrs else None)
            st.append(s["startTimeUnixNano"])
            en.append(s["endTimeUnixNano"])
            stat.append(2 if is_error(s) else _status_code(s))
            tr.append(flagged and is_truncated(s))
            at.append(_dumps(attrs).decode() if attrs else None)
            links, events = s.get("links"), s.get("events")
            lk.append(_dumps(links).decode() if links else None)
            ev.append(_dumps(events).decode() if events else None)
            rest = {k: v for k, v in s.items() if k not in _COLUMN_KEYS}
            ex.append(_dumps(rest).decode() if rest else None)

    def table(self) -> Any:
        import pyarrow as pa

        return pa.Table.from_pydict(
            {k: v for k, v in self.cols.items() if k != "rank"}, file_schema()
        )


def _status_code(s: dict[str, Any]) -> int:
    st = s.get("status")
    if isinstance(st, dict):
        code = st.get("code")
        if code in (1, "STATUS_CODE_OK", "1"):
            return 1
    return 0


#: Columns written dictionary-encoded: the repetitive ones. Span ids are unique and parent ids
#: nearly so: a dictionary there costs about 3x the whole part's write time and saves nothing.
_DICTIONARY = ["trace_id", "name", "group", "node", "attributes", "links", "events", "extra"]


def _write_atomic(table: Any, path: Path) -> None:
    """Write a Parquet file under a temporary name, then rename: a crash or a full disk leaves
    no file under the final name (the temporary one is removed on failure)."""
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=_DICTIONARY)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Resources:
    """The rows of ``resources.parquet``: one per distinct resource (the reader makes one
    :class:`Resource` per line), keyed by content, numbered in order of first span."""

    def __init__(self, rows: dict[str, list[Any]] | None = None) -> None:
        self.rows: dict[str, list[Any]] = rows or {
            "resource_id": [], "rank": [], "launcher": [], "node": [], "attributes": []
        }  # fmt: skip
        self.ids: dict[tuple[int, bool, bytes], int] = {}
        for rid, (rank, launcher, a) in enumerate(
            zip(self.rows["rank"], self.rows["launcher"], self.rows["attributes"], strict=True)
        ):
            self.ids[(rank, launcher, _dumps(_loads(a), default=str, option=_SORT))] = rid

    def id_of(self, res: Resource) -> int:
        key = (res.rank, res.launcher, _dumps(res.attrs, default=str, option=_SORT))
        rid = self.ids.get(key, -1)
        if rid < 0:
            rows = self.rows
            rid = self.ids[key] = len(rows["resource_id"])
            host = res.attrs.get(ResourceAttr.HOST_NAME)
            rows["resource_id"].append(rid)
            rows["rank"].append(res.rank)
            rows["launcher"].append(res.launcher)
            rows["node"].append(None if host is None else str(host))
            rows["attributes"].append(_dumps(res.attrs, default=str).decode())
        return rid

    def table(self) -> Any:
        import pyarrow as pa

        return pa.Table.from_pydict(self.rows, schema=pa.schema([
            ("resource_id", pa.int32()), ("rank", pa.int32()), ("launcher", pa.bool_()),
            ("node", pa.string()), ("attributes", pa.string()),
        ]))  # fmt: skip


class _Parts:
    """Span rows of one rank at a time, written ``segment_rows`` a part (the reader's spans:
    or up to one batch more)."""

    def __init__(self, root: Path, parts: list[str], segment_rows: int) -> None:
        self.root, self.parts, self.segment_rows = root, parts, segment_rows
        self.per_rank: dict[int, int] = {}
        for rel in parts:
            r = _part_rank(rel)
            self.per_rank[r] = self.per_rank.get(r, 0) + 1
        self.rank: int | None = None
        self.cols: _Columns | None = None  # the rows decoded by the reader, span by span
        self.tables: list[Any] = []  # rows decoded column-wise, and the reader's before them
        self.rows = 0

    def _to(self, rank: int) -> None:
        if rank != self.rank:
            self.flush()
            self.rank = rank

    def add_spans(self, rank: int, rid: int, node: str | None, spans: list[dict[str, Any]],
                  flagged: bool) -> None:  # fmt: skip
        self._to(rank)
        if self.cols is None:
            self.cols = _Columns()
        self.cols.add(rid, node, spans, flagged)
        self.rows += len(spans)
        if self.rows >= self.segment_rows:
            self.flush()

    def add_table(self, rank: int, table: Any) -> None:
        self._to(rank)
        if self.cols is not None:
            self.tables.append(self.cols.table())
            self.cols = None
        while table.num_rows:
            room = self.segment_rows - self.rows
            self.tables.append(table.slice(0, room))
            self.rows += min(room, table.num_rows)
            table = table.slice(room)
            if self.rows >= self.segment_rows:
                self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if self.cols is not None:
            self.tables.append(self.cols.table())
            self.cols = None
        if not self.rows:
            self.tables = []
            return
        assert self.rank is not None
        n = self.per_rank.get(self.rank, 0)
        self.per_rank[self.rank] = n + 1
        rel = f"spans/rank={self.rank}/part-{n:05d}.parquet"
        table = self.tables[0] if len(self.tables) == 1 else pa.concat_tables(self.tables)
        _write_atomic(table, self.root / rel)
        self.parts.append(rel)
        self.tables, self.rows = [], 0


class _ColumnLines:
    """The lines the column-wise decoder (:mod:`mlaunch.trace.store_decode`) takes from the
    reader (its ``take_raw``), decoded a chunk at a time into ``parts``. A chunk it refuses is
    decoded by the reader line by line, as if never taken. The files of a rank that has a spool
    stay with the reader: their spans are deduplicated against the spool's there."""

    def __init__(self, reader: TraceReader, resources: _Resources, parts: _Parts) -> None:
        self.reader, self.resources, self.parts = reader, resources, parts
        self.spooled = {f.rank for f in reader.files if f.spool}
        self.schema = file_schema()
        self.tf: TraceFile | None = None
        self.lines: list[bytes] = []
        self.line_nos: list[int] = []
        self.nbytes = 0

    def take(self, tf: TraceFile, raw: bytes) -> bool:
        if tf.spool or (not tf.launcher and tf.rank in self.spooled):
            return False
        if not raw.startswith(LINE_START):
            return False  # a metric line, a torn head glued to a request...: the reader's
        if tf is not self.tf:
            self.flush()
            self.tf = tf
        self.lines.append(raw)
        self.line_nos.append(self.reader.line_no)
        self.nbytes += len(raw)
        if self.nbytes >= CHUNK_BYTES:
            self.flush()
        return True

    def add(self, res: Resource, spans: list[dict[str, Any]], flagged: bool) -> None:
        """One batch the reader decoded."""
        rid = self.resources.id_of(res)
        self.parts.add_spans(res.rank, rid, self.resources.rows["node"][rid], spans, flagged)

    def flush(self) -> None:
        import numpy as np

        if not self.lines:
            return
        tf, lines, nos = self.tf, self.lines, self.line_nos
        assert tf is not None
        self.lines, self.line_nos, self.nbytes = [], [], 0
        reader = self.reader
        chunk = parse(b"".join(lines), len(lines))
        table = None
        if chunk is not None:
            # The reader's rank rule for each resource, in order of appearance (the numbering
            # of ranks by process depends on it); its id only where it has spans.
            seen: dict[str | None, Resource] = {}
            res = []
            try:
                for text in chunk.resources:
                    r = seen.get(text)
                    if r is None:
                        r = seen[text] = reader.resource(None if text is None else _loads(text),
                                                         tf)  # fmt: skip
                    res.append(r)
            except (AttributeError, TypeError, KeyError, ValueError):
                chunk = None  # a rank that is no integer...: the reader names the line
        if chunk is not None:
            rids = [self.resources.id_of(r) if n else -1 for r, n in zip(res, chunk.span_counts,
                                                                        strict=True)]  # fmt: skip
            nodes = [self.resources.rows["node"][i] if i >= 0 else None for i in rids]
            table = span_table(chunk, rids, nodes, self.schema)
        if table is None:
            path, line_no = reader.path, reader.line_no
            reader.path = tf.path
            for no, raw in zip(nos, lines, strict=True):
                reader.line_no = no
                for r, spans, flagged in reader.decode_line(tf, raw):
                    reader.stats.spans += len(spans)
                    self.add(r, spans, flagged)
            reader.path, reader.line_no = path, line_no
            return
        assert chunk is not None
        reader.stats.spans += table.num_rows
        ranks = np.asarray([r.rank for r in res])[chunk.span_entry]
        cuts = [0, *(np.flatnonzero(ranks[1:] != ranks[:-1]) + 1).tolist(), len(ranks)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            self.parts.add_table(int(ranks[a]), table.slice(a, b - a))


def build_store(
    run_dir: Path,
    reader: TraceReader,
    *,
    segment_rows: int = SEGMENT_ROWS,
    base: Manifest | None = None,
    columnar: bool = True,
) -> Manifest:
    """Read every span of ``reader`` (a reader over ``run_dir``'s files) once and write the store.

    The lines the column-wise decoder takes exactly never become Python dicts (see
    :mod:`mlaunch.trace.store_decode`); the reader decodes the rest, in the same order
    (``columnar=False``: all of them, the reference the tests compare with).

    The new store is built beside the old one (``trace-store.new``) and swapped in only when
    complete, manifest last: an interrupted build or a full disk (``OSError``) leaves the JSON and
    any previous store as they were, and removes what it wrote.

    With ``base`` (the current store's manifest; ``reader`` starts where it ended), the spans
    read are appended as new parts instead, then ``resources.parquet`` and the manifest are
    replaced (each atomically, the manifest last): until then the store is the old one."""
    import pyarrow.parquet as pq

    final = store_dir(run_dir)
    tmp = final if base is not None else run_dir / f".{STORE_DIR}.new"
    if base is None:
        shutil.rmtree(tmp, ignore_errors=True)
    sources = _sources(run_dir, reader.files)
    resources = _Resources(
        pq.read_table(final / "resources.parquet").to_pydict() if base is not None else None
    )
    parts = _Parts(tmp, list(base.parts) if base is not None else [], segment_rows)
    lines = _ColumnLines(reader, resources, parts)
    reader.take_raw = lines.take if columnar else None
    try:
        for res, spans, flagged in reader:
            lines.flush()  # the lines taken before this batch come before it
            lines.add(res, spans, flagged)
        lines.flush()
        parts.flush()
        _write_atomic(resources.table(), tmp / "resources.parquet")
        total = (base.spans if base is not None else 0) + reader.stats.spans
        parts_list = parts.parts
        complete = {os.path.relpath(p, run_dir): list(v) for p, v in reader.complete.items()}
        read = _read_json(reader.stats, run_dir)
        if base is not None:
            read = _merge_read(base, read, run_dir)
            order = {r: i for i, r in enumerate(dict.fromkeys(_part_rank(p) for p in parts_list))}
            parts_list.sort(key=lambda p: (order[_part_rank(p)], p))  # the order of a full read
        man = Manifest(
            version=SCHEMA_VERSION, sources=sources,
            files=[{"path": os.path.relpath(f.path, run_dir), "rank": f.rank, "spool": f.spool,
                    "launcher": f.launcher} for f in reader.files],
            parts=parts_list, spans=total, read=read, complete=complete,
        )  # fmt: skip
        if base is not None:
            mtmp = final / f".{MANIFEST}.tmp"
            mtmp.write_text(json.dumps(asdict(man)))
            os.replace(mtmp, final / MANIFEST)
            return man
        (tmp / MANIFEST).write_text(json.dumps(asdict(man)))
        old = run_dir / f".{STORE_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if base is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.take_raw = None
    return man


#: Parts a rank may have beyond the fewest its rows need before the store is compacted: each
#: append of a live run adds a small part per rank, and a reader opens every part.
MAX_EXTRA_PARTS = 8


def _fragmented(run_dir: Path, man: Manifest) -> bool:
    """Whether appends left some rank with many more parts than its rows need."""
    import pyarrow.parquet as pq

    per_rank: dict[int, list[str]] = {}
    for rel in man.parts:
        per_rank.setdefault(_part_rank(rel), []).append(rel)
    if all(len(v) <= MAX_EXTRA_PARTS + 1 for v in per_rank.values()):
        return False  # cheap: no part's footer read
    for v in per_rank.values():
        rows = sum(pq.read_metadata(store_dir(run_dir) / rel).num_rows for rel in v)
        if len(v) > -(-rows // SEGMENT_ROWS) + MAX_EXTRA_PARTS:
            return True
    return False


def compact_store(run_dir: Path, man: Manifest, *, segment_rows: int = SEGMENT_ROWS) -> Manifest:
    """Rewrite the store's parts, in read order, ``segment_rows`` rows a part (a live run's
    appends leave many small ones). Built beside the store and swapped in whole, manifest last,
    as a full build is: an interruption or a full disk leaves the store as it was. Memory: one
    part's rows."""
    import pyarrow.parquet as pq

    final = store_dir(run_dir)
    tmp = run_dir / f".{STORE_DIR}.new"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        parts = _Parts(tmp, [], segment_rows)
        for rel in man.parts:
            parts.add_table(_part_rank(rel), pq.ParquetFile(final / rel).read())
        parts.flush()
        shutil.copyfile(final / "resources.parquet", tmp / "resources.parquet")
        out = Manifest(**{**asdict(man), "parts": parts.parts})
        (tmp / MANIFEST).write_text(json.dumps(asdict(out)))
        old = run_dir / f".{STORE_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _part_rank(rel: str) -> int:
    return int(rel.split("/")[1].removeprefix("rank="))


def _merge_read(base: Manifest, tail: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The read stats of store + appended tail, as one full read would count them: the lines of
    the complete part, then the tail's (which re-reads a line that was torn); torn lines kept
    only where the store's read ended on a complete line (a torn head glued mid-file)."""
    old = base.read
    done = {str(run_dir / rel): v[1] for rel, v in base.complete.items()}
    torn = [[p, n] for p, n in old["torn_lines"] if n <= done.get(p, 0)] + tail["torn_lines"]
    return {
        "files": tail["files"], "lines": sum(done.values()) + tail["lines"],
        "spans": old["spans"] + tail["spans"],
        "duplicate_spans": old["duplicate_spans"] + tail["duplicate_spans"],
        "metric_lines": old["metric_lines"] + tail["metric_lines"], "torn_lines": torn,
    }  # fmt: skip


def _append_starts(
    run_dir: Path, man: Manifest, files: Sequence[TraceFile]
) -> dict[Path, tuple[int, int]] | None:
    """Where to resume reading each file to bring the store up to date by appending, or None
    when only a full rebuild is right: a spool (its spans deduplicate the traces file's, so
    the whole read depends on it), a source gone or shorter than what the store holds."""
    if not man.complete or any(f.spool for f in files):
        return None
    now = {os.path.relpath(f.path, run_dir): f for f in files}
    if not set(man.complete) <= set(now):
        return None
    starts = {}
    for rel, (nbytes, lines) in man.complete.items():
        try:
            if now[rel].path.stat().st_size < nbytes:
                return None
        except OSError:
            return None
        starts[now[rel].path] = (nbytes, lines)
    return starts


def _read_json(stats: ReadStats, run_dir: Path) -> dict[str, Any]:
    return {
        "files": stats.files, "lines": stats.lines, "spans": stats.spans,
        "duplicate_spans": stats.duplicate_spans, "metric_lines": stats.metric_lines,
        "torn_lines": [[str(p), n] for p, n in stats.torn_lines],
    }  # fmt: skip


def load_manifest(run_dir: Path) -> Manifest | None:
    """The store's manifest, or None when there is no (complete, current-version) store."""
    p = store_dir(run_dir) / MANIFEST
    try:
        d = json.loads(p.read_text())
        man = Manifest(**d)
    except (OSError, ValueError, TypeError):
        return None
    return man if man.version == SCHEMA_VERSION else None


def is_fresh(run_dir: Path, man: Manifest, files: Sequence[TraceFile]) -> bool:
    """Whether the store covers exactly the trace files there are now, unchanged."""
    try:
        return _sources(run_dir, files) == man.sources
    except OSError:
        return False


def torn_parts(run_dir: Path, man: Manifest) -> list[Path]:
    """The store's parts that are missing or not readable Parquet (a footer check: cheap)."""
    import pyarrow.parquet as pq

    bad = []
    for rel in [*man.parts, "resources.parquet"]:
        p = store_dir(run_dir) / rel
        try:
            pq.read_metadata(p)
        except (OSError, ValueError, Exception):  # pyarrow raises ArrowInvalid for a torn file
            bad.append(p)
    return bad


@dataclass
class Store:
    """An opened store: its directory, manifest and the parts to read."""

    run_dir: Path
    manifest: Manifest
    parts: list[Path]
    warnings: list[str]
    #: The run's lock, held shared while this store is open (set by :func:`open_store`).
    lock: _RunLock | None = field(default=None, repr=False, compare=False)

    def close(self) -> None:
        """Let writers (the receiver's appends, a compaction) replace the parts read here."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the fd goes anyway
            self.close()

    @property
    def root(self) -> Path:
        return store_dir(self.run_dir)

    def stats(self) -> ReadStats:
        r = self.manifest.read
        return ReadStats(
            files=r["files"], lines=r["lines"], spans=r["spans"],
            duplicate_spans=r["duplicate_spans"], metric_lines=r["metric_lines"],
            torn_lines=[(Path(p), n) for p, n in r["torn_lines"]],
        )  # fmt: skip

    def trace_files(self) -> list[TraceFile]:
        return [
            TraceFile(self.run_dir / f["path"], f["rank"], f["spool"], f["launcher"])
            for f in self.manifest.files
        ]

    def scratch_dir(self) -> Path:
        """Where a reader may write temporary files (DuckDB's spill, the export's sort input):
        the store's directory, on the disk that holds the run; the system's temporary directory
        when the store cannot be written (a read-only copy)."""
        return self.root if os.access(self.root, os.W_OK) else Path(tempfile.gettempdir())

    def connect(self, memory_limit: str | None = None) -> Any:
        """A DuckDB connection with the views ``spans`` and ``resources``: every store reader's
        (the one place DuckDB's memory and spill directory are set). ``memory_limit``: less
        than :data:`DUCKDB_MEMORY`, for a reader that holds more of its own meanwhile."""
        import duckdb

        con = duckdb.connect()
        # Bounded memory whatever the trace size: DuckDB spills beyond this (docs/trace.md), to
        # a directory of its own (it removes it on close; its default is ./.tmp, wherever the
        # user happens to be).
        con.execute(f"SET memory_limit='{memory_limit or DUCKDB_MEMORY}'")
        if DUCKDB_THREADS is not None:
            con.execute(f"SET threads={int(DUCKDB_THREADS)}")
        spill = self.scratch_dir() / f".duckdb-spill-{os.getpid()}-{next(_SPILLS)}"
        con.execute(f"SET temp_directory={_sql_str(spill)}")
        con.execute("SET preserve_insertion_order=true")
        con.execute("SET enable_progress_bar=false")
        if self.parts:
            files = ", ".join(_sql_str(p) for p in self.parts)
            con.execute(
                f"CREATE VIEW spans AS SELECT {', '.join(_QUOTED)} FROM read_parquet([{files}],"
                " hive_partitioning = true, hive_types = {'rank': INTEGER})"
            )
        else:
            cols = ", ".join(
                f'CAST(NULL AS {_duck_type(f.type)}) AS "{f.name}"' for f in span_schema()
            )
            con.execute(f"CREATE VIEW spans AS SELECT {cols} WHERE false")
        res = _sql_str(self.root / "resources.parquet")
        con.execute(f"CREATE VIEW resources AS SELECT * FROM read_parquet({res})")
        return con


#: DuckDB's memory for a store reader's queries; past it DuckDB spills to disk. With the Python
#: side (the interpreter, pyarrow, one part's rows) a reader's whole process stays under 1 GiB
#: at any trace size (``benchmarks/trace_read.py --store-only`` measures each reader).
DUCKDB_MEMORY = "768MB"
#: DuckDB's threads (None: one per CPU, its default).
DUCKDB_THREADS: int | None = None
_SPILLS = itertools.count()

_QUOTED = [f'"{c}"' for c in _COLUMNS]  # the view's columns in schema order (rank in place)


def _duck_type(t: Any) -> str:
    return {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "int8": "TINYINT",
            "bool": "BOOLEAN"}[str(t)]  # fmt: skip


def _sql_str(p: Path) -> str:
    return "'" + str(p).replace("'", "''") + "'"


class _RunLock:
    """This process's ``flock`` of a run directory (the directory itself: no file to leave
    behind, and a read-only copy can take it too), shared by every :class:`Store` of that
    directory it has open, and released when the last of them goes.

    Readers hold it shared for as long as they read; whoever builds, appends or compacts holds it
    exclusive. So a compaction never deletes the parts a reader of a live run is reading (its
    manifest names them), and the receiver's appends, the launcher's run-end build and a reader
    catching up never number their new parts alike. One descriptor per process: ``flock``
    converts a lock held on the same descriptor, where a second descriptor would wait for this
    process's own shared lock."""

    _open: dict[str, _RunLock] = {}

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0

    @classmethod
    def take(cls, run_dir: Path) -> _RunLock | None:
        """The run's lock, held shared; None where the directory cannot be opened."""
        key = os.path.realpath(run_dir)
        lock = cls._open.get(key)
        if lock is None:
            try:
                fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError:  # a file system without flock (some NFS): read unlocked, as before
                os.close(fd)
                return None
            lock = cls._open[key] = cls(fd)
        lock.users += 1
        return lock

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held exclusive inside, shared again after (a conversion: not atomic, so the caller
        looks at the store again once it has the lock)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # the shared lock was granted: so is this one
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            for key, lock in list(self._open.items()):
                if lock is self:
                    del self._open[key]
            os.close(self.fd)  # releases the lock


def open_store(path: Path, *, build: bool = True) -> Store | None:
    """The store of the run directory ``path``, built (or rebuilt) from its OTLP-JSON when it is
    missing, stale or torn. None when ``path`` is not a run directory, when the run directory
    cannot be written (a read-only copy: the caller reads the JSON) or when building was refused
    (``build=False``). A malformed trace raises the reader's ``TraceInputError`` as reading the
    JSON would. The store returned holds the run's lock shared (:class:`_RunLock`) until it is
    closed or collected; building holds it exclusive."""
    if not path.is_dir():
        return None
    lock = _RunLock.take(path)
    try:
        store = _open_store(path, build=False)
        if store is None and build:
            with lock.exclusive() if lock else contextlib.nullcontext():
                # Whoever held the lock before may have just brought the store up to date.
                store = _open_store(path, build=True)
    except BaseException:
        if lock:
            lock.release()
        raise
    if store is None:
        if lock:
            lock.release()
        return None
    store.lock = lock
    return store


def _open_store(path: Path, *, build: bool) -> Store | None:
    warnings: list[str] = []
    man = load_manifest(path)
    files: list[TraceFile] | None
    try:
        files = discover(path)
    except TraceInputError:
        files = None  # the JSON is gone (moved away after compaction): the store alone
    if man is not None:
        bad = torn_parts(path, man)
        for p in bad:
            warnings.append(f"{p}: not a readable Parquet file (torn or truncated)")
        if not bad and (files is None or is_fresh(path, man, files)):
            parts = [store_dir(path) / rel for rel in man.parts]
            return Store(path, man, parts, warnings)
        if files is None:
            if any(p.name == "resources.parquet" for p in bad):
                raise StoreError(
                    "the span store's resources.parquet is torn and there is no OTLP-JSON to "
                    "rebuild it from", path=store_dir(path),
                    fix="restore the run's telemetry/traces-rank*.jsonl or the store from a copy",
                )  # fmt: skip
            warnings = [w + "; skipped" for w in warnings]
            parts = [store_dir(path) / rel for rel in man.parts]
            return Store(path, man, [p for p in parts if p not in bad], warnings)
        warnings = [w + "; rebuilt from the OTLP-JSON" for w in warnings]
    if files is None or not build:
        if files is None:
            discover(path)  # raises the reader's "no trace files found"
        return None
    # A live run (its files grew since the store was written): read only what was appended.
    starts = _append_starts(path, man, files) if man is not None and not warnings else None
    reader = TraceReader(files, starts=starts)
    try:
        man = build_store(path, reader, base=man if starts is not None else None)
        if starts is not None and _fragmented(path, man):
            man = compact_store(path, man)
    except OSError as e:
        # A read-only run directory or a full disk: nothing was lost (the JSON stays and the
        # half-built store was removed); the caller reads the JSON instead. A directory the user
        # may not write (an archive, someone else's run) is no news: only the rest is warned of.
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            warnings.append(f"{store_dir(path)}: cannot write the span store "
                            f"({e.strerror or e}); read the OTLP-JSON instead")  # fmt: skip
        _pending_warnings.extend(warnings)
        return None
    return Store(path, man, [store_dir(path) / rel for rel in man.parts], warnings)


#: Warnings of a store that could not be opened (the caller prints them).
_pending_warnings: list[str] = []


def take_warnings() -> list[str]:
    """The warnings :func:`open_store` and :func:`open_reader` left, once."""
    out = list(_pending_warnings)
    _pending_warnings.clear()
    return out


def update_store(run_dir: Path) -> str | None:
    """Bring the store of ``run_dir`` up to date with its OTLP-JSON now (build it, append what
    the JSON gained, compact), as the first read would: what the receiver runs as spans arrive
    and the launcher as a run ends. None when done (or when there is no trace to store), else
    the problem in one line; the JSON is left as it was either way."""
    try:
        discover(run_dir)
    except TraceInputError:
        return None  # telemetry off, or nothing exported yet
    take_warnings()
    try:
        store = open_store(run_dir)
    except TraceInputError as e:
        return str(e).splitlines()[0]
    problems = take_warnings()
    if store is None:
        return problems[0] if problems else f"{run_dir} cannot be written"
    return None


#: Niceness of the store writer's process: on a training node it yields to the job's processes.
WRITER_NICE = 10


def spawn_update(run_dir: Path) -> subprocess.Popen[str]:
    """Start :func:`update_store` of ``run_dir`` in a process of its own (``python -m
    mlaunch.trace.store RUN_DIR``): its decoding and compression never hold the launcher's (or
    the receiver's) interpreter, its memory goes when it ends, and a caller that stops waiting
    leaves it to finish (in a session of its own, a Ctrl-C to the launch does not cut it).
    Its stderr (a pipe) holds the problem, if any, in one line; exit status 1 then."""
    return subprocess.Popen(
        [sys.executable, "-m", "mlaunch.trace.store", str(run_dir)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """``python -m mlaunch.trace.store RUN_DIR``: :func:`update_store`, at low priority."""
    with contextlib.suppress(OSError):
        os.nice(WRITER_NICE)
    problem = update_store(Path(argv[0]))
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


def open_reader(path: Path, *, skip_invalid: bool = False) -> TraceReader | StoreReader:
    """The reader for ``path``: a run directory's store, built on its first read and brought up
    to date with what the JSON gained since; else (a single file, a directory that cannot be
    written) the JSON reader. Building costs about one JSON decode (the column-wise decoder,
    benchmarks/trace_read.py), so even a one-off summary of a JSON-only run pays little more
    than a read of the JSON, and every later command reads Parquet. ``--skip-invalid`` reads the
    JSON: a store holds only what a strict read accepts, so it never hides a malformed line
    from a later strict read."""
    if not skip_invalid and path.is_dir():
        store = open_store(path)
        if store is not None:
            _pending_warnings.extend(store.warnings)
            return StoreReader(store)
    return TraceReader.open(path, skip_invalid=skip_invalid)


class StoreReader:
    """A :class:`~mlaunch.trace.reader.TraceReader` look-alike over the store: the same
    ``(resource, spans, maybe_truncated)`` batches, rebuilt from the Parquet rows a record batch
    at a time (memory bounded by the batch), so every consumer of the JSON reader (goodput,
    export, report) reads the store unchanged."""

    def __init__(self, store: Store, *, timing_only: bool = False) -> None:
        self.store = store
        #: Spans with only their name and times (and the attributes of the launcher's job
        #: spans): what goodput reads. Reads 3 of the columns and builds small dicts: several
        #: times faster than whole spans.
        self.timing_only = timing_only
        self.files = store.trace_files()
        self.skip_invalid = False
        self.stats = store.stats()
        self.path: Path | None = None
        self.line_no = 0
        self.limits: dict[Path, int] = {}
        self._resources: dict[int, Resource] | None = None

    def reread(self) -> StoreReader:
        return StoreReader(self.store, timing_only=self.timing_only)

    def error_here(self, message: str, fix: str = "") -> TraceInputError:
        return TraceInputError(message, path=self.path, fix=fix or "rebuild the store: delete "
                               f"{self.store.root} and read the run again")  # fmt: skip

    def feed(self, add: Any) -> None:
        for res, spans, flagged in self:
            try:
                add(res, spans, flagged)
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                raise self.error_here(f"malformed span ({type(e).__name__}: {e})") from None

    def resources(self) -> dict[int, Resource]:
        if self._resources is None:
            import pyarrow.parquet as pq

            t = pq.read_table(self.store.root / "resources.parquet").to_pydict()
            self._resources = {
                rid: Resource(_loads(a), rank, launcher)
                for rid, rank, launcher, a in zip(
                    t["resource_id"], t["rank"], t["launcher"], t["attributes"], strict=True
                )
            }
        return self._resources

    def __iter__(self) -> Iterator[tuple[Resource, list[dict[str, Any]], bool]]:
        import pyarrow.parquet as pq

        resources = self.resources()
        cols = _TIMING_COLUMNS if self.timing_only else None
        convert = _timing_batches if self.timing_only else _batches
        for part in self.store.parts:
            self.path = part
            for batch in pq.ParquetFile(part).iter_batches(batch_size=65_536, columns=cols):
                yield from convert(batch, resources)
        self.path = None


_TIMING_COLUMNS = ["name", "start_ns", "end_ns", "resource_id", "attributes"]
#: Spans whose attributes goodput reads (the attempt number of a launcher attempt).
_NEEDS_ATTRS = frozenset({"mlaunch.job", "mlaunch.job.attempt"})


def _runs(rids: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(resource id, first row, end row)`` of each run of consecutive rows from one resource:
    the JSON reader hands out one resource's spans at a time, so the store's readers do too."""
    n = len(rids)
    i = 0
    while i < n:
        rid = rids[i]
        j = i + 1
        while j < n and rids[j] == rid:
            j += 1
        yield rid, i, j
        i = j


def _timing_batches(
    batch: Any, resources: dict[int, Resource]
) -> Iterator[tuple[Resource, list[dict[str, Any]], bool]]:
    names = batch.column(0).to_pylist()
    starts = batch.column(1).to_pylist()
    ends = batch.column(2).to_pylist()
    attrs = batch.column(4)
    needs = _NEEDS_ATTRS
    for rid, i, j in _runs(batch.column(3).to_pylist()):
        spans: list[dict[str, Any]] = []
        for k in range(i, j):
            name = names[k]
            s = {"name": name, "startTimeUnixNano": starts[k], "endTimeUnixNano": ends[k]}
            if name in needs and (a := attrs[k].as_py()) is not None:
                s["attributes"] = _loads(a)
            spans.append(s)
        yield resources[rid], spans, False


def _batches(
    batch: Any, resources: dict[int, Resource]
) -> Iterator[tuple[Resource, list[dict[str, Any]], bool]]:
    """Spans as the JSON reader hands them out, grouped into runs of one resource. An attribute
    list or ``extra`` text repeated in the batch (most are: the part stores them dictionary-
    encoded) is decoded once: each span gets its own list of the same entries, to read."""
    c = batch.to_pydict()
    loads = _loads
    tid, sid, pid, names = c["trace_id"], c["span_id"], c["parent_id"], c["name"]
    starts, ends, trunc = c["start_ns"], c["end_ns"], c["truncated"]
    attrs, events, links, extra = c["attributes"], c["events"], c["links"], c["extra"]
    decoded: dict[str, Any] = {}
    for rid, i, j in _runs(c["resource_id"]):
        spans: list[dict[str, Any]] = []
        flagged = False
        for k in range(i, j):
            s: dict[str, Any] = {}
            if (v := tid[k]) is not None:
                s["traceId"] = v
            if (v := sid[k]) is not None:
                s["spanId"] = v
            if (v := pid[k]) is not None:
                s["parentSpanId"] = v
            s["name"] = names[k]
            s["startTimeUnixNano"] = starts[k]
            s["endTimeUnixNano"] = ends[k]
            if (v := attrs[k]) is not None:
                a = decoded.get(v)
                if a is None:
                    a = decoded[v] = loads(v)
                s["attributes"] = list(a)
            if (v := events[k]) is not None:
                s["events"] = loads(v)
            if (v := links[k]) is not None:
                s["links"] = loads(v)
            if (v := extra[k]) is not None:
                x = decoded.get(v)
                if x is None:
                    x = decoded[v] = loads(v)
                s.update(x)
            flagged = flagged or trunc[k]
            spans.append(s)
        yield resources[rid], spans, flagged


@dataclass
class SqlResult:
    """A query's column names and rows."""

    columns: list[str]
    rows: list[tuple[Any, ...]]


def run_sql(store: Store, query: str) -> SqlResult:
    """Run one user query over the views ``spans`` and ``resources``. A bad query (a syntax
    error, an unknown table or column) raises ``TraceInputError`` with DuckDB's first line."""
    import duckdb

    con = store.connect()
    try:
        cur = con.execute(query)
        if cur.description is None:
            return SqlResult([], [])
        return SqlResult([d[0] for d in cur.description], cur.fetchall())
    except duckdb.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        bad = (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException)
        raise TraceInputError(
            f"{'bad SQL' if isinstance(e, bad) else 'query failed'}: {first}",
            fix="the views are `spans` and `resources`; columns: " + ", ".join(_COLUMNS),
        ) from None
    finally:
        con.close()


def export_otlp_json(reader: TraceReader | StoreReader, out_path: Path) -> int:
    """Write every span ``reader`` reads as OTLP-JSON lines (one ``ExportTraceServiceRequest``
    per batch: the interchange format every OTLP tool reads) to ``out_path``, by the rule of
    :mod:`mlaunch.outputs`; the number of spans written. The launcher's job trace keeps its
    resource (``dl.node_rank``), so reading the output back gives the same ranks."""
    from mlaunch.otlp.otlp_json import encode_attributes
    from mlaunch.outputs import open_output
    from mlaunch.trace.summary import no_spans_error

    n = 0
    # Each resource's encoding, by identity; the resource is kept with it, so that its id() is
    # not reused by another resource the reader makes later (the cause of spans exported under
    # the wrong rank's resource, now and then, when the cache kept only the encoding).
    cache: dict[int, tuple[Any, list[dict[str, Any]]]] = {}
    with open_output(out_path) as f:
        for res, spans, _ in reader:
            kept = cache.get(id(res))
            if kept is None or kept[0] is not res:
                kept = cache[id(res)] = (res, encode_attributes(res.attrs))
            enc = kept[1]
            line = {"resourceSpans": [{"resource": {"attributes": enc},
                                       "scopeSpans": [{"scope": {"name": "mlaunch"},
                                                       "spans": spans}]}]}  # fmt: skip
            f.write(_dumps(line).decode())
            f.write("\n")
            n += len(spans)
        if not n:
            raise no_spans_error(reader)  # type: ignore[arg-type]
    return n


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
