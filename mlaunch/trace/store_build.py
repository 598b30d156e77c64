"""Writing the span store (its layout: :mod:`mlaunch.trace.store_layout`): a whole build from a
reader over the run's OTLP-JSON, an append of what the JSON gained, and the compaction of the
small parts appends leave. Each writes beside what readers see and swaps it in, manifest last, so
an interruption or a full disk leaves the store as it was. The caller holds the run's lock
exclusive (:func:`mlaunch.trace.store.open_store`).

Why pyarrow writes it and DuckDB reads it: pyarrow turns the reader's Python columns into a
Parquet file in one call with no database process or connection to manage (each part is written
to a temporary name and renamed, so a crash or a full disk never leaves a half part under a
final name); DuckDB runs the SQL (``mlaunch trace sql``) and the vectorised readers, streaming
over the parts with its own bounded memory and spilling, so memory does not grow with the trace.

Standalone like the reader: no telemetry runtime, no OTel SDK.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orjson import OPT_SORT_KEYS as _SORT
from orjson import dumps as _dumps
from orjson import loads as _loads

from mlaunch.model.spans import ResourceAttr
from mlaunch.rundir.atomic import atomic_path, write_atomic
from mlaunch.trace.reader import (
    ReadStats,
    Resource,
    TraceFile,
    TraceReader,
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
from mlaunch.trace.store_layout import (
    COLUMNS,
    MANIFEST,
    SCHEMA_VERSION,
    SEGMENT_ROWS,
    Manifest,
    file_schema,
    part_rank,
    source_stats,
    store_dir,
)

#: Keys of an OTLP span that have their own column; everything else goes to ``extra``.
_COLUMN_KEYS = frozenset(
    {"traceId", "spanId", "parentSpanId", "name", "startTimeUnixNano", "endTimeUnixNano",
     "attributes", "links", "events"}
)  # fmt: skip


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
        self.cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}

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

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=_DICTIONARY)


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
            r = part_rank(rel)
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
    root: Path | None = None,
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
    replaced (each atomically, the manifest last): until then the store is the old one.

    ``root``: where the store goes (default ``run_dir/trace-store``; a bare file's store beside
    it, or in the cache directory: :func:`mlaunch.trace.store.store_site`); source paths in the
    manifest stay relative to ``run_dir``."""
    import pyarrow.parquet as pq

    final = root or store_dir(run_dir)
    tmp = final if base is not None else _beside(final, "new")
    if base is None:
        shutil.rmtree(tmp, ignore_errors=True)
    sources = source_stats(run_dir, reader.files)
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
            order = {r: i for i, r in enumerate(dict.fromkeys(part_rank(p) for p in parts_list))}
            parts_list.sort(key=lambda p: (order[part_rank(p)], p))  # the order of a full read
        man = Manifest(
            version=SCHEMA_VERSION, sources=sources,
            files=[{"path": os.path.relpath(f.path, run_dir), "rank": f.rank, "spool": f.spool,
                    "launcher": f.launcher} for f in reader.files],
            parts=parts_list, spans=total, read=read, complete=complete,
        )  # fmt: skip
        if base is not None:
            write_atomic(final / MANIFEST, json.dumps(asdict(man)))
            return man
        (tmp / MANIFEST).write_text(json.dumps(asdict(man)))
        # A directory swap, not rundir.atomic's file rename: rename(2) cannot replace a folder
        # that has files, so the old store moves aside first (readers hold the run's lock).
        old = _beside(final, "old")
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


def _beside(final: Path, what: str) -> Path:
    """The temporary directory a new store is written to (``new``) or the old one moved to
    (``old``), beside ``final``: a rename away, on the same file system."""
    return final.with_name(f".{final.name}.{what}")


def fragmented(run_dir: Path, man: Manifest, root: Path | None = None) -> bool:
    """Whether appends left some rank with many more parts than its rows need."""
    import pyarrow.parquet as pq

    per_rank: dict[int, list[str]] = {}
    for rel in man.parts:
        per_rank.setdefault(part_rank(rel), []).append(rel)
    if all(len(v) <= MAX_EXTRA_PARTS + 1 for v in per_rank.values()):
        return False  # cheap: no part's footer read
    for v in per_rank.values():
        rows = sum(pq.read_metadata((root or store_dir(run_dir)) / rel).num_rows for rel in v)
        if len(v) > -(-rows // SEGMENT_ROWS) + MAX_EXTRA_PARTS:
            return True
    return False


def compact_store(
    run_dir: Path, man: Manifest, *, segment_rows: int = SEGMENT_ROWS, root: Path | None = None
) -> Manifest:
    """Rewrite the store's parts, in read order, ``segment_rows`` rows a part (a live run's
    appends leave many small ones). Built beside the store and swapped in whole, manifest last,
    as a full build is: an interruption or a full disk leaves the store as it was. Memory: one
    part's rows."""
    import pyarrow.parquet as pq

    final = root or store_dir(run_dir)
    tmp = _beside(final, "new")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        parts = _Parts(tmp, [], segment_rows)
        for rel in man.parts:
            parts.add_table(part_rank(rel), pq.ParquetFile(final / rel).read())
        parts.flush()
        shutil.copyfile(final / "resources.parquet", tmp / "resources.parquet")
        out = Manifest(**{**asdict(man), "parts": parts.parts})
        (tmp / MANIFEST).write_text(json.dumps(asdict(out)))
        old = _beside(final, "old")  # a directory swap, as in build_store
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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
        "skipped_lines": old.get("skipped_lines", []) + tail["skipped_lines"],
        "skipped_spans": old.get("skipped_spans", []) + tail["skipped_spans"],
    }  # fmt: skip


def append_starts(
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
        # What a --skip-invalid build dropped: warned of on every read of that store.
        "skipped_lines": [[str(p), n, why] for p, n, why in stats.skipped_lines],
        "skipped_spans": [[str(p), n, why] for p, n, why in stats.skipped_spans],
    }  # fmt: skip
