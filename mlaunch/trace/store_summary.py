"""``mlaunch trace summary``: the :class:`~mlaunch.trace.summary.Summary` of a span store,
computed by vectorised DuckDB aggregates over the Parquet parts, grouped
on the stored names (memory bounded by DuckDB's limit, not by the trace). Percentiles are those
of :func:`mlaunch.trace.stats.percentile` to the last bit: DuckDB fetches the two closest ranks
of each group (:func:`~mlaunch.trace.stats.closest_ranks`) and Python interpolates between them
(DuckDB's own ``quantile_cont`` interpolates in another form, which can differ in the last bit:
enough to print 173 ms where the exact interpolation prints 174).
"""

from __future__ import annotations

from typing import Any

from orjson import loads

from mlaunch.model.spans import ALIASES, STEP_SPAN, ResourceAttr
from mlaunch.trace.stats import closest_ranks, interpolate
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
#: Sorting a group's values keeps all of them; past this, the names are taken in buckets
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


#: The percentiles the summary shows: p50, p95.
_QS = (50.0, 95.0)
#: Distinct group sizes one percentile query serves (4 positions each, all computed for every
#: group of the query: more would multiply the work on the large groups).
_SIZES_PER_QUERY = 8


def _nearest_rank(con: Any) -> bool:
    """Whether this DuckDB's ``quantile_disc(x, q)`` is the value at index ``ceil(n*q) - 1``
    (recent DuckDB), else at ``floor((n-1)*q)``: which position picks a given index."""
    return con.execute("SELECT quantile_disc(x, 0.55) FROM range(10) t(x)").fetchone()[0] == 5


def _position(n: int, i: int, nearest_rank: bool) -> float:
    """The ``quantile_disc`` position that picks index ``i`` of ``n`` sorted values: half a rank
    from either edge, so rounding cannot move it to a neighbour."""
    if nearest_rank:
        return (i + 0.5) / n
    return 1.0 if i >= n - 1 else (i + 0.5) / (n - 1)


def _percentiles(con: Any, key_sql: str, where_of: Any,
                 counts: dict[Any, int]) -> dict[Any, list[float]]:  # fmt: skip
    """Per group (``key_sql``; ``counts``: each group's rows; ``where_of(keys)``: the filter
    that selects those groups' rows) its p50 and p95 durations, as
    :func:`~mlaunch.trace.stats.percentile` gives them: DuckDB's ``quantile_disc`` picks the two
    closest ranks of each (exact values, no interpolation), interpolated here."""
    if not counts:
        return {}
    nearest = _nearest_rank(con)
    ranks = {k: [closest_ranks(n, q) for q in _QS] for k, n in counts.items()}
    by_size: dict[int, list[Any]] = {}
    for k, n in counts.items():
        by_size.setdefault(n, []).append(k)
    sizes = list(by_size)
    out: dict[Any, list[float]] = {}
    for a in range(0, len(sizes), _SIZES_PER_QUERY):
        chunk = sizes[a : a + _SIZES_PER_QUERY]
        pos = {(n, i): _position(n, i, nearest) for n in chunk
               for lo, hi, _ in ranks[by_size[n][0]] for i in (lo, hi)}  # fmt: skip
        qs = sorted(set(pos.values()))
        col = {q: j for j, q in enumerate(qs)}
        rows = con.execute(
            f"SELECT {key_sql} AS k, quantile_disc({_D}, ?::DOUBLE[]) FROM spans"
            f" {where_of([k for n in chunk for k in by_size[n]])} GROUP BY 1",
            [qs],
        ).fetchall()
        for k, v in rows:
            n = counts[k]
            out[k] = [
                interpolate(v[col[pos[(n, lo)]]], v[col[pos[(n, hi)]]], frac)
                for lo, hi, frac in ranks[k]
            ]
    return out


def _by_name(con: Any, spans: int) -> list[tuple[Any, ...]]:
    """Per canonical name: (name, count, total, p50, p95, max, errors, truncated). One scan for
    the counts, then up to QUANTILE_BUCKET spans one scan for the percentiles; past it, one
    per bucket of names."""
    raw = con.execute(f"SELECT name, {_COUNTS} FROM spans GROUP BY name").fetchall()
    merged: dict[str, list[Any]] = {}
    members: dict[str, list[str]] = {}
    for name, *row in raw:
        c = ALIASES.get(name, name)
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
    buckets: list[list[str]] = [[]]
    held = 0
    for c, m in sorted(merged.items(), key=lambda kv: kv[1][0]):
        if held + m[0] > QUANTILE_BUCKET and buckets[-1]:
            buckets.append([])
            held = 0
        buckets[-1].append(c)
        held += m[0]
    q: dict[str, list[float]] = {}
    for canon in buckets:
        names = [n for c in canon for n in members[c]]
        if names:
            q.update(_percentiles(
                con, _canon_sql(names),
                lambda cs: f"WHERE name IN ({_in([n for c in cs for n in members[c]])})",
                {c: merged[c][0] for c in canon},
            ))  # fmt: skip
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
        where = f"WHERE name IN ({_in(step_names)})"
        step_counts = dict(
            con.execute(
                f"SELECT rank, count(*) FROM spans {where} GROUP BY rank ORDER BY rank"
            ).fetchall()
        )
        sq = _percentiles(
            con, "rank", lambda rs: f"{where} AND rank IN ({', '.join(map(str, rs))})", step_counts
        )
        steps = [(r, n, sq[r][0], sq[r][1]) for r, n in step_counts.items()]
        # The first (in read order) non-launcher resource of each rank.
        res = con.execute(
            "SELECT rank, attributes FROM resources WHERE NOT launcher"
            " QUALIFY row_number() OVER (PARTITION BY rank ORDER BY resource_id) = 1"
            " ORDER BY rank"
        ).fetchall()
        # The summary's SHARED_IDS_NOTE: trace roots of the
        # workers (not the launcher) whose ids more than one rank emitted.
        (shared,) = con.execute(
            "SELECT count(*) FROM (SELECT 1 FROM spans WHERE rank >= 0 AND parent_id IS NULL"
            " GROUP BY trace_id, span_id HAVING count(DISTINCT rank) > 1)"
        ).fetchone()
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
        rank_ids=sorted(resources), read=read_info, shared_root_ids=shared,
    )  # fmt: skip
