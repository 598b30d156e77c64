"""``mlaunch trace summary`` on the span store: the same :class:`~mlaunch.trace.summary.Summary`
as the streaming reader, computed by two vectorised DuckDB aggregates over the Parquet parts
(memory bounded by DuckDB's limit, not by the trace). Percentiles are DuckDB's ``quantile_cont``,
the same linear interpolation between closest ranks as :func:`mlaunch.trace.stats.percentile`.
"""

from __future__ import annotations

from typing import Any

from orjson import loads

from mlaunch.model.spans import ALIASES, STEP_SPAN, ResourceAttr
from mlaunch.trace.store import Store
from mlaunch.trace.summary import (
    _LAUNCHER,
    _NS_PER_MS,
    RUN_ATTRS,
    NameStats,
    Summary,
    rank_skew,
)

#: Spans with their canonical name and duration (an end before its start counts as instant).
_CANON = """
CREATE TEMP VIEW canon AS
SELECT coalesce(a.canon, s.name) AS cname, s.rank, greatest(s.end_ns - s.start_ns, 0) AS d,
       s.status, s.truncated
FROM spans s LEFT JOIN aliases a ON a.name = s.name
"""


#: Durations an exact-percentile pass may hold (8 bytes each: ~200 MB, under DuckDB's limit).
#: DuckDB's quantile keeps every value of a group; past this, the names are taken in buckets
#: of at most this many spans, one scan each, so memory stays bounded at any trace size.
QUANTILE_BUCKET = 25_000_000

_COUNTS = (
    "count(*), sum(d), max(d), count(*) FILTER (WHERE status = 2),"
    " count(*) FILTER (WHERE truncated)"
)


def _by_name(con: Any, spans: int) -> list[tuple[Any, ...]]:
    """Per canonical name: (name, count, total, p50, p95, max, errors, truncated)."""
    if spans <= QUANTILE_BUCKET:  # one scan
        rows = con.execute(
            f"SELECT cname, quantile_cont(d, [0.5, 0.95]), {_COUNTS} FROM canon GROUP BY cname"
        ).fetchall()
        return [(r[0], r[2], r[3], r[1][0], r[1][1], r[4], r[5], r[6]) for r in rows]
    counts = con.execute(f"SELECT cname, {_COUNTS} FROM canon GROUP BY cname").fetchall()
    buckets: list[list[str]] = [[]]
    held = 0
    for name, n, *_ in sorted(counts, key=lambda r: r[1]):
        if held + n > QUANTILE_BUCKET and buckets[-1]:
            buckets.append([])
            held = 0
        buckets[-1].append(name)
        held += n
    q: dict[str, list[float]] = {}
    for names in buckets:
        q.update(
            con.execute(
                "SELECT cname, quantile_cont(d, [0.5, 0.95]) FROM canon"
                " WHERE cname IN (SELECT unnest(?::VARCHAR[])) GROUP BY cname",
                [names],
            ).fetchall()
        )
    return [(r[0], r[1], r[2], q[r[0]][0], q[r[0]][1], r[3], r[4], r[5]) for r in counts]


def summarize_store(store: Store, *, straggler_threshold: float = 0.05) -> Summary:
    """The summary of the store's spans. Raises ``TraceInputError`` for a store without spans."""
    from mlaunch.trace.store import StoreReader
    from mlaunch.trace.summary import no_spans_error

    con = store.connect()
    try:
        rows = [[k, v] for k, v in ALIASES.items()]
        con.execute("CREATE TEMP TABLE aliases (name VARCHAR, canon VARCHAR)")
        if rows:
            con.executemany("INSERT INTO aliases VALUES (?, ?)", rows)
        con.execute(_CANON)
        by_name = _by_name(con, store.manifest.spans)
        if not by_name:
            raise no_spans_error(StoreReader(store))  # type: ignore[arg-type]
        steps = [
            (r, n, q[0], q[1])
            for r, n, q in con.execute(
                "SELECT rank, count(*), quantile_cont(d, [0.5, 0.95]) FROM canon"
                " WHERE cname = ? GROUP BY rank ORDER BY rank",
                [STEP_SPAN],
            ).fetchall()
        ]
        # The first (in read order) non-launcher resource of each rank, as the streaming reader.
        res = con.execute(
            "SELECT rank, attributes FROM resources WHERE NOT launcher"
            " QUALIFY row_number() OVER (PARTITION BY rank ORDER BY resource_id) = 1"
            " ORDER BY rank"
        ).fetchall()
    finally:
        con.close()
    resources: dict[int, dict[str, Any]] = {r: loads(a) for r, a in res}
    step_total = next((int(r[2]) for r in by_name if r[0] == STEP_SPAN), 0)
    stats: list[NameStats] = []
    for name, n, tot, p50, p95, mx, err, trunc in by_name:
        tot = int(tot)
        stats.append(
            NameStats(
                name=name, count=n, total_ms=tot / _NS_PER_MS, mean_ms=tot / n / _NS_PER_MS,
                p50_ms=float(p50) / _NS_PER_MS, p95_ms=float(p95) / _NS_PER_MS,
                max_ms=mx / _NS_PER_MS,
                share=(tot / step_total) if step_total and name not in _LAUNCHER else None,
                errors=err, truncated=trunc,
            )
        )  # fmt: skip
    stats.sort(key=lambda s: (-s.total_ms, s.name))
    ranks, skew = rank_skew(steps, resources, straggler_threshold)
    hosts = sorted({str(h) for r in resources.values() if (h := r.get(ResourceAttr.HOST_NAME))})
    first = resources[min(resources)] if resources else {}
    read = store.stats()
    read_info = {
        "files": read.files, "lines": read.lines, "spans": read.spans,
        "duplicate_spans_dropped": read.duplicate_spans, "skipped_lines": [],
        "skipped_spans": [], "torn_lines": [f"{p}:{n}" for p, n in read.torn_lines],
    }  # fmt: skip
    return Summary(
        spans=stats, ranks=ranks, skew=skew,
        errors=sum(s.errors for s in stats), truncated=sum(s.truncated for s in stats),
        run={k: first[k] for k in RUN_ATTRS if k in first}, hosts=hosts,
        rank_ids=sorted(resources), read=read_info,
    )  # fmt: skip
