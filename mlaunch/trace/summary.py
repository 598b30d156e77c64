"""``mlaunch trace summary``: per-span-name duration statistics, per-rank step skew (stragglers),
error/truncated counts and the run's resource attributes: the result types, the rules
(:func:`rank_skew`) and :func:`summarize_store`, which computes them from a span store by
vectorised DuckDB aggregates over the Parquet parts, grouped on the stored names (memory bounded
by DuckDB's limit, not by the trace). Percentiles are those of
:func:`mlaunch.trace.stats.percentile` to the last bit: DuckDB fetches the two closest ranks of
each group (:func:`~mlaunch.trace.stats.closest_ranks`) and Python interpolates between them
(DuckDB's own ``quantile_cont`` interpolates in another form, which can differ in the last bit:
enough to print 173 ms where the exact interpolation prints 174).

Definitions (also in the command help and docs/trace.md):

* durations are ``end - start`` of each span, in milliseconds;
* p50/p95 interpolate linearly between the closest ranks (numpy's default);
* names are Megatron-LM's code names: a documented name of an older trace
  (``megatron.train_step``, ``megatron.save_checkpoint``, ...) is counted under the code name it
  stands for (``mlaunch.model.spans.ALIASES``, the one alias table every reader uses);
* *share* = a name's total time / the total time of all step spans (``megatron.train.iteration``,
  or ``megatron.train_step`` in older traces). For spans nested in steps it is their share of step
  time; for spans outside steps (checkpoint saves, evaluation) it reads as their cost relative to
  training time;
* skew: the median step duration of each rank; the run's reference is the median of those
  medians; a rank is a *straggler* when its median exceeds the reference by more than the
  threshold (default 5%). Synchronous collectives make every rank's step as long as the
  slowest rank's, so this check cannot name the rank the others wait for: ``mlaunch trace
  stragglers`` (:mod:`mlaunch.trace.stragglers`) charges each wait to the rank that arrived last;
* the launcher's job trace (``mlaunch.job``, ``mlaunch.job.attempt``) is counted in the table but
  is no rank, and has no share (it spans the whole run, not a part of the steps).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orjson import loads

from mlaunch.model.spans import ALIASES, STEP_SPAN, ResourceAttr, SpanName
from mlaunch.trace.reader import no_spans_error
from mlaunch.trace.stats import closest_ranks, interpolate, median
from mlaunch.trace.store import Store, StoreReader, _sql_in, _sql_str

_NS_PER_MS = 1e6
STEP = STEP_SPAN

#: Resource attributes shown as the run's identity, in display order.
RUN_ATTRS: tuple[str, ...] = tuple(
    str(a)
    for a in (
        ResourceAttr.RUN_ID, ResourceAttr.SERVICE_NAME, ResourceAttr.SERVICE_VERSION,
        ResourceAttr.USER_ID, ResourceAttr.WORLD_SIZE, ResourceAttr.TP_SIZE,
        ResourceAttr.PP_SIZE, ResourceAttr.DP_SIZE, ResourceAttr.BATCH_SIZE,
        ResourceAttr.SEQUENCE_LENGTH, ResourceAttr.NUM_LAYERS, ResourceAttr.HIDDEN_SIZE,
        ResourceAttr.NUM_ATTENTION_HEADS, ResourceAttr.TRAIN_ITERS,
        ResourceAttr.MICRO_BATCH_SIZE, ResourceAttr.PRECISION, ResourceAttr.CKPT_FORMAT,
        "slurm.job.id", "k8s.pod.name",
    )
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class NameStats:
    """Duration statistics of one span name across all ranks (milliseconds)."""

    name: str
    count: int
    total_ms: float
    mean_ms: float
    p50_ms: float
    p95_ms: float
    max_ms: float
    share: float | None  # of total step time; None when the trace has no steps
    errors: int
    truncated: int


@dataclass(frozen=True, slots=True)
class RankSkew:
    """Step-span (``megatron.train.iteration``) statistics of one rank."""

    rank: int
    host: str | None
    steps: int
    median_ms: float
    p95_ms: float
    ratio: float  # median / the median of all ranks' medians
    straggler: bool


@dataclass(frozen=True, slots=True)
class Skew:
    """The run-level straggler verdict."""

    reference_median_ms: float  # median of the per-rank medians
    slowest_rank: int
    slowest_median_ms: float
    slowest_ratio: float  # slowest median / reference
    threshold: float
    stragglers: list[int]


@dataclass
class Summary:
    """Everything ``mlaunch trace summary`` prints."""

    spans: list[NameStats]
    ranks: list[RankSkew]
    skew: Skew | None
    errors: int
    truncated: int
    run: dict[str, Any]
    hosts: list[str]
    rank_ids: list[int]
    read: dict[str, Any] = field(default_factory=dict)
    #: Trace roots whose (trace id, span id) more than one rank emitted (:data:`SHARED_IDS_NOTE`).
    shared_root_ids: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``--json`` output)."""
        return {
            "run": self.run,
            "hosts": self.hosts,
            "ranks_seen": self.rank_ids,
            "spans": [asdict(s) for s in self.spans],
            "step_skew": {
                "ranks": [asdict(r) for r in self.ranks],
                **({} if self.skew is None else asdict(self.skew)),
            },
            "errors": self.errors,
            "truncated": self.truncated,
            "shared_root_ids": self.shared_root_ids,
            "read": self.read,
        }


#: What it means when ranks emit the same ids, and which nemo-lens fixes it: said by ``mlaunch
#: trace summary`` whenever a trace root's ids appear on more than one rank (a span exists on one
#: rank only, so that is never one span seen twice).
SHARED_IDS_NOTE = (
    "{n} trace root(s) have the same trace and span ids on more than one rank: nemo-lens 0.1.0"
    " draws ids from Python's random, which data-parallel ranks seed alike (Lens #28); every"
    " `mlaunch trace` reader keys spans by rank and id, so nothing is merged. nemo-lens 0.2.0"
    " (what Megatron-LM pins) gives unique ids"
)


#: The launcher's job-trace spans: in the table, without a share of step time.
_LAUNCHER = frozenset({SpanName.JOB.value, SpanName.JOB_ATTEMPT.value})


def rank_skew(
    per_rank: list[tuple[int, int, float, float]],
    resources: dict[int, dict[str, Any]],
    threshold: float,
) -> tuple[list[RankSkew], Skew | None]:
    """Each rank's step-time skew against the median of the ranks' medians, from ``(rank, steps,
    median_ns, p95_ns)`` rows in rank order."""
    if not per_rank:
        return [], None
    ref = median([float(p50) for _, _, p50, _ in per_rank])
    ranks: list[RankSkew] = []
    for r, n, p50, p95 in per_rank:
        ratio = float(p50) / ref if ref else 1.0
        host = resources.get(r, {}).get(ResourceAttr.HOST_NAME)
        ranks.append(
            RankSkew(
                rank=r, host=None if host is None else str(host), steps=n,
                median_ms=float(p50) / _NS_PER_MS, p95_ms=float(p95) / _NS_PER_MS,
                ratio=ratio, straggler=ratio > 1.0 + threshold,
            )
        )  # fmt: skip
    slowest = max(ranks, key=lambda x: (x.median_ms, -x.rank))
    return ranks, Skew(
        reference_median_ms=ref / _NS_PER_MS, slowest_rank=slowest.rank,
        slowest_median_ms=slowest.median_ms, slowest_ratio=slowest.ratio,
        threshold=threshold, stragglers=[x.rank for x in ranks if x.straggler],
    )  # fmt: skip


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
    cases = " ".join(f"WHEN {_sql_str(n)} THEN {_sql_str(ALIASES[n])}" for n in legacy)
    return f"CASE name {cases} ELSE name END"


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
                lambda cs: f"WHERE name IN ({_sql_in([n for c in cs for n in members[c]])})",
                {c: merged[c][0] for c in canon},
            ))  # fmt: skip
    return [(c, m[0], m[1], q[c][0], q[c][1], m[2], m[3], m[4]) for c, m in merged.items()]


def summarize_store(store: Store, *, straggler_threshold: float = 0.05) -> Summary:
    """The summary of the store's spans. Raises ``TraceInputError`` for a store without spans."""
    con = store.connect()
    try:
        by_name = _by_name(con, store.manifest.spans)
        if not by_name:
            raise no_spans_error(StoreReader(store))  # type: ignore[arg-type]
        step_names = [STEP_SPAN, *(legacy for legacy, c in ALIASES.items() if c == STEP_SPAN)]
        where = f"WHERE name IN ({_sql_in(step_names)})"
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
