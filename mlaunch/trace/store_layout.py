"""The span store's layout: its files, the schema of its rows and its manifest, which the builder
(:mod:`mlaunch.trace.store_build`) writes and the readers (:mod:`mlaunch.trace.store`) open.
A run's spans as Parquet, one row per span, next to its OTLP-JSON.

Layout (``RUN_DIR/trace-store/``)::

    manifest.json                      what the store holds (written last: no manifest, no store)
    resources.parquet                  one row per resource (rank, launcher, node, attributes)
    spans/rank=<R>/part-<NNNNN>.parquet  a rank's spans in read order, SEGMENT_ROWS rows a part

The launcher's job trace is rank ``-1 - node_rank`` (as :class:`~mlaunch.trace.reader.Resource`
has it). The ``rank=<R>`` directories are Hive partitions: DuckDB, Polars and Spark read
``trace-store/spans/**/*.parquet`` directly, and a query on one rank opens one directory.

Schema of ``spans`` (:func:`span_schema`; docs/trace.md, "The span store"):

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

Standalone like the reader: no telemetry runtime, no OTel SDK.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.trace.reader import TraceFile, TraceInputError

STORE_DIR = "trace-store"
MANIFEST = "manifest.json"
#: Bumped when the schema changes: an older store is rebuilt, never misread.
SCHEMA_VERSION = 1
#: Rows per Parquet part: large enough for good compression and few files, small enough that
#: the builder's column buffers (Python objects until the part is written) stay near 250 MB.
SEGMENT_ROWS = 262_144

#: The columns of ``spans``, in schema order (``rank`` in place).
COLUMNS = (
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


def source_stats(run_dir: Path, files: Sequence[TraceFile]) -> dict[str, list[int]]:
    out = {}
    for f in files:
        st = f.path.stat()
        out[os.path.relpath(f.path, run_dir)] = [st.st_size, st.st_mtime_ns]
    return out


def part_rank(rel: str) -> int:
    return int(rel.split("/")[1].removeprefix("rank="))


def load_manifest(run_dir: Path, root: Path | None = None) -> Manifest | None:
    """The store's manifest (the store at ``root``, by default ``run_dir``'s), or None when there
    is no (complete, current-version) store."""
    p = (root or store_dir(run_dir)) / MANIFEST
    try:
        d = json.loads(p.read_text())
        man = Manifest(**d)
    except (OSError, ValueError, TypeError):
        return None
    return man if man.version == SCHEMA_VERSION else None


def is_fresh(run_dir: Path, man: Manifest, files: Sequence[TraceFile]) -> bool:
    """Whether the store covers exactly the trace files there are now, unchanged."""
    try:
        return source_stats(run_dir, files) == man.sources
    except OSError:
        return False


def torn_parts(run_dir: Path, man: Manifest, root: Path | None = None) -> list[Path]:
    """The store's parts that are missing or not readable Parquet (a footer check: cheap)."""
    import pyarrow.parquet as pq

    bad = []
    for rel in [*man.parts, "resources.parquet"]:
        p = (root or store_dir(run_dir)) / rel
        try:
            pq.read_metadata(p)
        except (OSError, ValueError, Exception):  # pyarrow raises ArrowInvalid for a torn file
            bad.append(p)
    return bad
