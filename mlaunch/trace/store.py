"""The columnar span store, opened and read: built on a run's first read (or brought up to date
with what its OTLP-JSON gained), held under the run's lock, read back as OTLP span batches,
queried with SQL, exported. Its files and schema: :mod:`mlaunch.trace.store_layout`; writing them:
:mod:`mlaunch.trace.store_build`.

Where it is written: where the spans arrive, beside the job and never in it. The embedded
receiver appends it as its JSON grows (``mlaunch.receiver.store_append``), and the launcher brings
it up to date once the workers have exited (``mlaunch.launcher.run.finish_store``; from 64 MiB
of JSON: a smaller trace's first read builds it in under a second), both through
:func:`update_store` in a process of their own (:func:`spawn_update`); the first read builds it
for a run that has only JSON. Measured (``benchmarks/trace_read.py --writers``, 10^6 spans): a
worker writing Parquet in its file exporter would spend about 10x the CPU per span of its JSON
encoding (4.5 us against 0.47) on the training host, while the run-end build costs training
nothing (the workers have exited; 1-2x the CPU of a JSON decode at the end of the run, with the
pyarrow decoder of :mod:`mlaunch.trace.store_decode`) and the receiver's appends 2x one build in
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
import hashlib
import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orjson import dumps as _dumps
from orjson import loads as _loads

from mlaunch.model.spans import ALIASES, STEP_SPAN
from mlaunch.rundir.atomic import flock
from mlaunch.trace.reader import (
    ReadStats,
    Resource,
    TraceFile,
    TraceInputError,
    TraceReader,
    discover,
)
from mlaunch.trace.store_build import append_starts, build_store, compact_store, fragmented
from mlaunch.trace.store_layout import (
    COLUMNS,
    STORE_DIR,
    Manifest,
    StoreError,
    is_fresh,
    load_manifest,
    span_schema,
    store_dir,
    torn_parts,
)


@dataclass
class Store:
    """An opened store: the directory its sources are named from, its manifest and the parts to
    read."""

    run_dir: Path
    manifest: Manifest
    parts: list[Path]
    warnings: list[str]
    #: The run's lock, held shared while this store is open (set by :func:`open_store`).
    lock: _RunLock | None = field(default=None, repr=False, compare=False)
    #: Where the store is: ``run_dir/trace-store`` for a run directory, else :func:`store_site`.
    where: Path | None = None

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
        return self.where or store_dir(self.run_dir)

    def stats(self) -> ReadStats:
        r = self.manifest.read
        return ReadStats(
            files=r["files"], lines=r["lines"], spans=r["spans"],
            duplicate_spans=r["duplicate_spans"], metric_lines=r["metric_lines"],
            torn_lines=[(Path(p), n) for p, n in r["torn_lines"]],
            skipped_lines=[(Path(p), n, why) for p, n, why in r.get("skipped_lines", [])],
            skipped_spans=[(Path(p), n, why) for p, n, why in r.get("skipped_spans", [])],
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

    def connect(self, memory_limit: str | None = None, *, derived: bool = False) -> Any:
        """A DuckDB connection with the views ``spans`` and ``resources``: every store reader's
        (the one place DuckDB's memory and spill directory are set). ``memory_limit``: less
        than :data:`DUCKDB_MEMORY`, for a reader that holds more of its own meanwhile.

        ``derived`` (``mlaunch trace sql``): ``spans`` also has the columns derived from the
        stored ones (:data:`SPANS_COLUMNS`: ``duration_ns``, and ``iteration`` inherited from the
        enclosing step), the stored rows being ``stored_spans``. The analyses read the stored
        columns only, without the join that inheriting takes."""
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
        stored = "spans" if not derived else "stored_spans"
        if self.parts:
            files = ", ".join(_sql_str(p) for p in self.parts)
            con.execute(
                f"CREATE VIEW {stored} AS SELECT {', '.join(_QUOTED)} FROM read_parquet([{files}],"
                " hive_partitioning = true, hive_types = {'rank': INTEGER})"
            )
        else:
            cols = ", ".join(
                f'CAST(NULL AS {_duck_type(f.type)}) AS "{f.name}"' for f in span_schema()
            )
            con.execute(f"CREATE VIEW {stored} AS SELECT {cols} WHERE false")
        if derived:
            con.execute(_SPANS_VIEW)
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

_QUOTED = [f'"{c}"' for c in COLUMNS]  # the view's columns in schema order (rank in place)

#: The columns of ``mlaunch trace sql``'s ``spans`` view: the stored ones (``iteration`` filled
#: in), with ``duration_ns`` after ``end_ns``. docs/trace.md and ``trace sql --help`` say each.
SPANS_COLUMNS = tuple(x for c in COLUMNS for x in ((c, "duration_ns") if c == "end_ns" else (c,)))
_STEP_NAMES = ", ".join(
    "'" + n + "'" for n in sorted({STEP_SPAN, *(a for a, c in ALIASES.items() if c == STEP_SPAN)})
)
#: ``spans`` with the derived columns. A span without an iteration of its own takes that of the
#: step (``megatron.train.iteration``) of its rank that encloses it in time: the latest step
#: that starts at or before it (an as-of join: one sort of each side, no self-join on parent
#: ids, which are unique per rank only) if the span also ends within it. A span between steps
#: (start-up, a checkpoint save, evaluation) keeps none.
_SPANS_VIEW = f"""
CREATE VIEW spans AS
WITH steps AS (
    SELECT rank, start_ns AS step_start, end_ns AS step_end, iteration AS step_iteration
    FROM stored_spans WHERE name IN ({_STEP_NAMES}) AND iteration IS NOT NULL
)
SELECT {
    ", ".join(
        "coalesce(s.iteration, CASE WHEN s.end_ns <= st.step_end THEN st.step_iteration END)"
        " AS iteration"
        if c == "iteration"
        else "greatest(s.end_ns - s.start_ns, 0) AS duration_ns"
        if c == "duration_ns"
        else f's."{c}"'
        for c in SPANS_COLUMNS
    )
}
FROM stored_spans s ASOF LEFT JOIN steps st ON s.rank = st.rank AND s.start_ns >= st.step_start
"""


def _duck_type(t: Any) -> str:
    return {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "int8": "TINYINT",
            "bool": "BOOLEAN"}[str(t)]  # fmt: skip


def _sql_str(p: str | Path) -> str:
    """``p`` as an SQL string literal (a path or a span name)."""
    return "'" + str(p).replace("'", "''") + "'"


def _sql_in(names: list[str]) -> str:
    """A literal IN list (a constant filter DuckDB pushes into the Parquet scan; a subquery
    would be a join)."""
    return ", ".join(_sql_str(n) for n in names)


class _RunLock:
    """This process's ``flock`` of a run directory (the directory itself: no file to leave
    behind, and a read-only copy can take it too), shared by every :class:`Store` of that
    directory it has open, and released when the last of them goes (so it takes
    :func:`mlaunch.rundir.atomic.flock` on the directory descriptor, not a lock file).

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
                flock(fd, shared=True)
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
        flock(self.fd)  # the shared lock was granted: so is this one
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                flock(self.fd, shared=True)

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            for key, lock in list(self._open.items()):
                if lock is self:
                    del self._open[key]
            os.close(self.fd)  # releases the lock


def store_site(path: Path, *, cache: bool = False, skip_invalid: bool = False) -> Path:
    """Where the store of ``path`` goes: a run directory's (or any directory's) in it
    (``trace-store``), a bare file's beside it (``.<name>.trace-store``); with ``cache`` (the
    place beside it cannot be written: an archive, someone else's run) under
    ``$XDG_CACHE_HOME/mlaunch/stores/<hash of the path>/``. A ``--skip-invalid`` read keeps its
    store in the cache only, apart from the strict one: a store holds what its read accepted,
    so a lenient store never hides a malformed line from a later strict read."""
    if not cache and not skip_invalid:
        return store_dir(path) if path.is_dir() else path.with_name(f".{path.name}.{STORE_DIR}")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:20]
    return Path(
        base, "mlaunch", "stores", key + ("-skip-invalid" if skip_invalid else ""), STORE_DIR
    )


def open_store(
    path: Path, *, build: bool = True, cache: bool = False, skip_invalid: bool = False
) -> Store | None:
    """The store of ``path`` (a run directory, any directory of trace files, or one OTLP-JSON
    file; placed by :func:`store_site`), built (or rebuilt) from its OTLP-JSON when it is
    missing, stale or torn. None when ``path`` is neither a file nor a directory, when the place
    of the store cannot be written (the caller tries ``cache=True``) or when building was refused
    (``build=False``). A malformed trace raises the reader's ``TraceInputError`` (as reading the
    JSON would; ``skip_invalid``: the bad lines and spans are dropped and counted in the store's
    read stats). The store returned holds the lock of the directory that holds it, shared
    (:class:`_RunLock`), until it is closed or collected; building holds it exclusive."""
    if not (path.is_dir() or path.is_file()):
        return None
    root = store_site(path, cache=cache, skip_invalid=skip_invalid)
    if cache or skip_invalid:
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
    lock = _RunLock.take(root.parent)
    try:
        store = _open_store(path, root, build=False, skip_invalid=skip_invalid)
        if store is None and build:
            with lock.exclusive() if lock else contextlib.nullcontext():
                # Whoever held the lock before may have just brought the store up to date.
                store = _open_store(path, root, build=True, skip_invalid=skip_invalid)
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


def _open_store(path: Path, root: Path, *, build: bool, skip_invalid: bool) -> Store | None:
    warnings: list[str] = []
    run_dir = path if path.is_dir() else path.parent  # what the manifest names sources from
    man = load_manifest(run_dir, root)
    files: list[TraceFile] | None
    try:
        files = discover(path)
    except TraceInputError:
        files = None  # the JSON is gone (moved away after compaction): the store alone
    if man is not None:
        bad = torn_parts(run_dir, man, root)
        for p in bad:
            warnings.append(f"{p}: not a readable Parquet file (torn or truncated)")
        if not bad and (files is None or is_fresh(run_dir, man, files)):
            parts = [root / rel for rel in man.parts]
            return Store(run_dir, man, parts, warnings, where=root)
        if files is None:
            if any(p.name == "resources.parquet" for p in bad):
                raise StoreError(
                    "the span store's resources.parquet is torn and there is no OTLP-JSON to "
                    "rebuild it from", path=root,
                    fix="restore the run's telemetry/traces-rank*.jsonl or the store from a copy",
                )  # fmt: skip
            warnings = [w + "; skipped" for w in warnings]
            parts = [root / rel for rel in man.parts]
            return Store(run_dir, man, [p for p in parts if p not in bad], warnings, where=root)
        warnings = [w + "; rebuilt from the OTLP-JSON" for w in warnings]
    if files is None or not build:
        if files is None:
            discover(path)  # raises the reader's "no trace files found"
        return None
    if not os.access(root.parent, os.W_OK):
        return None  # read-only (an archive, someone else's run): the caller tries the cache
    # A live run (its files grew since the store was written): read only what was appended.
    starts = append_starts(run_dir, man, files) if man is not None and not warnings else None
    reader = TraceReader(files, starts=starts, skip_invalid=skip_invalid)
    try:
        man = build_store(run_dir, reader, base=man if starts is not None else None, root=root)
        if starts is not None and fragmented(run_dir, man, root):
            man = compact_store(run_dir, man, root=root)
    except OSError as e:
        # A read-only directory or a full disk: nothing was lost (the JSON stays and the
        # half-built store was removed); the caller tries the cache directory. A directory the
        # user may not write (an archive, someone else's run) is no news: only the rest is
        # warned of.
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            warnings.append(f"{root}: cannot write the span store ({e.strerror or e})")
        _pending_warnings.extend(warnings)
        return None
    return Store(run_dir, man, [root / rel for rel in man.parts], warnings, where=root)


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


def open_reader(path: Path, *, skip_invalid: bool = False) -> StoreReader:
    """The reader of ``path`` (a run directory, a directory of trace files or one OTLP-JSON
    file): always its span store (:func:`open_store`), built on the first read and brought up to
    date with what the JSON gained since, beside the input or, where that cannot be written, in
    the cache directory (:func:`store_site`). Building costs about one JSON decode (the
    column-wise decoder, benchmarks/trace_read.py), so a one-off summary of a JSON-only input
    pays little more than a read of the JSON, and every later command reads Parquet.

    ``--skip-invalid`` reads the strict store when it is current (it holds every line: nothing
    to skip), else builds a lenient one of its own in the cache. A path that cannot be stored
    anywhere raises ``TraceInputError``."""
    if skip_invalid:
        store = open_store(path, build=False) or open_store(path, skip_invalid=True)
    else:
        store = open_store(path) or open_store(path, cache=True)
    if store is None:
        discover(path)  # a path that is no trace input: the reader's message
        raise TraceInputError(
            f"cannot write the span store beside the input nor in {store_site(path, cache=True)}",
            path=path, fix="set XDG_CACHE_HOME to a writable directory",
        )  # fmt: skip
    _pending_warnings.extend(store.warnings)
    return StoreReader(store)


class StoreReader:
    """The reader every ``mlaunch trace`` command gets (:func:`open_reader`): the store, its
    files and read stats, and its spans read back as OTLP span dicts in
    ``(resource, spans, maybe_truncated)`` batches of one resource, a record batch at a time
    (memory bounded by the batch), for what needs whole spans (the OTLP-JSON export, the
    report's step and mark scan, the live tail's aggregator in tests). The analyses read the
    store's columns (:attr:`store`) directly."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.files = store.trace_files()
        self.skip_invalid = False
        self.stats = store.stats()
        self.path: Path | None = None
        self.line_no = 0
        self._resources: dict[int, Resource] | None = None

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
        for part in self.store.parts:
            self.path = part
            for batch in pq.ParquetFile(part).iter_batches(batch_size=65_536):
                yield from _batches(batch, resources)
        self.path = None


def _runs(rids: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(resource id, first row, end row)`` of each run of consecutive rows from one resource:
    the OTLP batches hand out one resource's spans at a time, so the store's reader does too."""
    n = len(rids)
    i = 0
    while i < n:
        rid = rids[i]
        j = i + 1
        while j < n and rids[j] == rid:
            j += 1
        yield rid, i, j
        i = j


def _batches(
    batch: Any, resources: dict[int, Resource]
) -> Iterator[tuple[Resource, list[dict[str, Any]], bool]]:
    """Spans as OTLP span dicts, grouped into runs of one resource. An attribute
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

    con = store.connect(derived=True)
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
            fix="the views are `spans` and `resources`; columns: " + ", ".join(SPANS_COLUMNS),
        ) from None
    finally:
        con.close()


def export_otlp_json(reader: StoreReader, out_path: Path) -> int:
    """Write every span ``reader`` reads as OTLP-JSON lines (one ``ExportTraceServiceRequest``
    per batch: the interchange format every OTLP tool reads) to ``out_path``, by the rule of
    :mod:`mlaunch.outputs`; the number of spans written. The launcher's job trace keeps its
    resource (``dl.node_rank``), so reading the output back gives the same ranks."""
    from mlaunch.otlp.otlp_json import encode_attributes
    from mlaunch.outputs import open_output
    from mlaunch.trace.reader import no_spans_error

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
