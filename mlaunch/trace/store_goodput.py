"""``mlaunch trace goodput`` on the span store: the streaming aggregator's state
(:class:`~mlaunch.trace.goodput.GoodputAggregator`) filled by a few DuckDB queries instead of a
loop over every span, then the same :meth:`~mlaunch.trace.goodput.GoodputAggregator.finish`.

What goodput reads of a span is its name and times: the extents come from one aggregate per
resource, and only the spans goodput keeps (steps: 16 bytes each, the rare phase spans, the
launcher's job spans) leave DuckDB, as arrays. Every use of those lists in ``finish`` is
independent of their order, and they are fetched in read order anyway.
"""

from __future__ import annotations

from array import array

from orjson import loads

from mlaunch.model.spans import ALIASES, STEP_SPAN
from mlaunch.trace.goodput import LAUNCHER_SPANS, TRACKED, GoodputAggregator, GoodputReport
from mlaunch.trace.reader import Resource
from mlaunch.trace.store import Store


def _names(canon: frozenset[str] | set[str]) -> list[str]:
    """The stored names the stream reads as one of ``canon`` (its rule: the alias table's name,
    else the name as written): the code names and older traces' documented ones."""
    return sorted(n for n in {*canon, *ALIASES} if ALIASES.get(n, n) in canon)


def _in(names: list[str]) -> str:
    return ", ".join("'" + n.replace("'", "''") + "'" for n in names)


def goodput_store(store: Store) -> GoodputReport:
    """The goodput of the store's spans. Raises ``TraceInputError`` for a store without spans."""
    return goodput_aggregate(store).finish()


def goodput_aggregate(store: Store) -> GoodputAggregator:
    """The streaming aggregator's state after every span of the store, filled by the queries
    (``mlaunch trace report`` reads the ranks' extents from it). Raises ``TraceInputError`` for
    a store without spans."""
    from mlaunch.trace.reader import no_spans_error
    from mlaunch.trace.store import StoreReader

    launcher_names = _in(sorted(LAUNCHER_SPANS))
    con = store.connect()
    try:
        res = con.execute(
            "SELECT resource_id, rank, launcher, attributes FROM resources ORDER BY resource_id"
        ).fetchall()
        # Literal lists, not subqueries: constant filters DuckDB pushes into the Parquet scan.
        extents = con.execute(
            "SELECT resource_id, min(start_ns), max(end_ns) FROM spans"
            f" WHERE name NOT IN ({launcher_names}) GROUP BY resource_id"
        ).fetchall()
        job_spans = con.execute(
            f"SELECT name, start_ns, end_ns, attributes FROM spans WHERE name IN ({launcher_names})"
        ).fetchall()
        # Every span of a worker resource that goodput keeps (the launcher's own ones: above).
        workers = ", ".join(str(rid) for rid, _, launcher, _ in res if not launcher) or "NULL"
        keep = f"resource_id IN ({workers}) AND name IN"
        steps = con.execute(
            f"SELECT rank, start_ns, end_ns FROM spans WHERE {keep} ({_in(_names({STEP_SPAN}))})"
        ).fetchnumpy()
        tracked = con.execute(
            f"SELECT rank, name, start_ns, end_ns FROM spans WHERE {keep} ({_in(_names(TRACKED))})"
        ).fetchall()
    finally:
        con.close()

    agg = GoodputAggregator()
    for name, start, end, attrs in job_spans:
        s = {"name": name} if attrs is None else {"name": name, "attributes": loads(attrs)}
        agg.launcher_span(s, start, end)
    extent = {rid: (lo, hi) for rid, lo, hi in extents}
    for rid, rank, launcher, attrs in res:  # in read order, as the stream meets them
        if launcher:
            continue
        r = Resource(loads(attrs), rank)
        st = agg.state(r)
        if rid in extent:
            agg.widen(st, r, *extent[rid])
    ranks, starts, ends = steps["rank"], steps["start_ns"], steps["end_ns"]
    for r in sorted(set(ranks.tolist())):
        mine = ranks == r
        st = agg.ranks[int(r)]
        st.step_starts = array("q", starts[mine].tolist())
        st.step_ends = array("q", ends[mine].tolist())
    for rank, name, start, end in tracked:
        agg.ranks[rank].spans.setdefault(ALIASES.get(name, name), []).append((start, end))
    if not agg.job and not any(st.hi >= st.lo for st in agg.ranks.values()):
        raise no_spans_error(StoreReader(store))  # type: ignore[arg-type]
    return agg
