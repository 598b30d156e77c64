"""``mlaunch trace summary`` on the span store: the same :class:`~mlaunch.trace.summary.Summary`
as the streaming reader, computed by vectorised DuckDB aggregates over the Parquet parts, grouped
on the stored names (memory bounded by DuckDB's limit, not by the trace). Percentiles are
DuckDB's ``quantile_cont``, the same linear interpolation between closest ranks as
:func:`mlaunch.trace.stats.percentile`.
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

#: A span's duration (an end before its start counts as instant).
_D = "greatest(end_ns - start_ns, 0)"


#: Durations an exact-percentile pass may hold (8 bytes each: ~200 MB, under DuckDB's limit).
#: DuckDB's quantile keeps every value of a group; past this, the names are taken in buckets
#: of at most this many spans, one scan each, so memory stays bounded at any trace size.
QUANTILE_BUCKET = 25_000_000

_COUNTS = (
    f"count(*), sum({_D}), max({_D}), count(*) FILTER (WHERE status = 2),"
    " count(*) FILTER (WHERE truncated)"
)


def _canon_sql(names: list[str]) -> str:
    """The canonical name of a row as SQL, for rows whose raw name is one of ``names``: the raw
    name itself unless one of them is an older trace's documented name (then a CASE, no join:
    every query filters and groups on the stored ``name`` column, which the Parquet scan can
    push the filter into)."""
    legacy = [n for n in names if n in ALIASES]
    if not legacy:
        return "name"
    cases = " ".join(f"WHEN {_lit(n)} THEN {_lit(ALIASES[n])}" for n in legacy)
    return f"CASE name {cases} ELSE name END"


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _in(names: list[str]) -> str:
    """A literal IN list (a constant filter DuckDB pushes into the Parquet scan; a subquery
    would be a join)."""
    return ", ".join(_lit(n) for n in names)


def _by_name(con: Any, spans: int) -> list[tuple[Any, ...]]:
    """Per canonical name: (name, count, total, p50, p95, max, errors, truncated). Up to
    QUANTILE_BUCKET spans, one scan; past it, one for the counts and one per bucket of names."""
    one_scan = spans <= QUANTILE_BUCKET
    quantiles = f"quantile_cont({_D}, [0.5, 0.95]), " if one_scan else ""
    raw = con.execute(f"SELECT name, {quantiles}{_COUNTS} FROM spans GROUP BY name").fetchall()
    merged: dict[str, list[Any]] = {}
    members: dict[str, list[str]] = {}
    q: dict[str, list[float]] = {}
    for name, *row in raw:
        c = ALIASES.get(name, name)
        if one_scan:  # by the canonical name (a name written both ways: its union, below)
            q[c] = row.pop(0)
        members.setdefault(c, []).append(name)
        m = merged.get(c)
        if m is None:
            merged[c] = row
        else:
            m[0] += row[0]
            m[1] += row[1]
            m[2] = max(m[2], row[2])
            m[3] += row[3]
            m[4] += row[4]
    if one_scan:  # a name written both ways (old and new traces in one run) needs its union
        buckets = [[c for c, ms in members.items() if len(ms) > 1]]
    else:
        buckets = [[]]
        held = 0
        for c, m in sorted(merged.items(), key=lambda kv: kv[1][0]):
            if held + m[0] > QUANTILE_BUCKET and buckets[-1]:
                buckets.append([])
                held = 0
            buckets[-1].append(c)
            held += m[0]
    for canon in buckets:
        names = [n for c in canon for n in members[c]]
        if names:
            q.update(
                con.execute(
                    f"SELECT {_canon_sql(names)}, quantile_cont({_D}, [0.5, 0.95]) FROM spans"
                    f" WHERE name IN ({_in(names)}) GROUP BY 1"
                ).fetchall()
            )
    return [(c, m[0], m[1], q[c][0], q[c][1], m[2], m[3], m[4]) for c, m in merged.items()]


def summarize_store(store: Store, *, straggler_threshold: float = 0.05) -> Summary:
    """The summary of the store's spans. Raises ``TraceInputError`` for a store without spans."""
    from mlaunch.trace.store import StoreReader
    from mlaunch.trace.summary import no_spans_error

    con = store.connect()
    try:
        by_name = _by_name(con, store.manifest.spans)
        if not by_name:
            raise no_spans_error(StoreReader(store))  # type: ignore[arg-type]
        step_names = [STEP_SPAN, *(legacy for legacy, c in ALIASES.items() if c == STEP_SPAN)]
        steps = [
            (r, n, q[0], q[1])
            for r, n, q in con.execute(
                f"SELECT rank, count(*), quantile_cont({_D}, [0.5, 0.95]) FROM spans"
                " WHERE name IN (SELECT unnest(?::VARCHAR[])) GROUP BY rank ORDER BY rank",
                [step_names],
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
