"""``mlaunch trace goodput``: productive training time over wall time, per rank and overall, with
the lost time split into start-up cost, checkpoint saves, evaluation and unaccounted time.

Spans are recognised by Megatron-LM's code names, and older traces' documented names through the
one alias table (``mlaunch.model.spans.ALIASES``): a real Megatron-LM trace, a current mlaunch
trace and an older mlaunch trace with the same timings give the same figures.

Definitions (also in the command help and docs/trace.md), per rank:

* **wall** = the extent of the launcher's job span ``mlaunch.job`` when the run has one (the
  launcher's ``telemetry/traces-launcher-node*.jsonl``; earliest start to latest end, so the time
  before the workers start, between restarted attempts and after they stop counts as lost);
  else, for older traces, the extent of the rank's ``megatron.pretrain``; else the earliest start
  to the latest end of any span of the rank.
* **productive** = the time covered by step spans (``megatron.train.iteration``, alias
  ``megatron.train_step``) minus the *first-iteration excess*: for each first step (the step
  inside ``megatron.train.first_iteration``; without that span, the earliest step after each
  ``megatron.startup``), ``max(0, its duration - the rank's median step)``.
* **startup** (``restart_ms`` in JSON, its first name) = what every start costs, the first
  launch's and each restart's: time in the launch (**launch**: Megatron-LM's backdated
  ``pre_startup``, ``megatron.startup.launch_script`` and ``megatron.startup.container_load``,
  from SLURM's job start or the launch stamps mlaunch hands the workers to the worker's first
  line), ``megatron.startup.model_init``, ``megatron.checkpoint.load``,
  ``megatron.startup.dataloader``, ``megatron.train.first_iteration`` and the rest of
  ``megatron.startup``, not already inside a step, plus the first-iteration excess, plus
  **requeue**: the time between incarnations (a SLURM requeue, a torchrun restart) when no worker
  of the run was up: the gaps between the launcher's ``mlaunch.job`` spans (the queue wait of a
  requeued job), and in every later incarnation (each ``mlaunch.job`` after the first, each
  ``mlaunch.job.attempt`` after attempt 0) the time from its start to the rank's first span in it
  (the launcher and torchrun starting again). Without a launcher trace (a collector's view of a
  Megatron-LM run), incarnations are told apart by the workers' ``nemo.lens.run_uuid`` (else
  ``slurm.restart_count``) and the gaps between them count.
* **checkpoint** = time in ``megatron.checkpoint.save``; **evaluation** = time in
  ``megatron.evaluate``; **unaccounted** = wall minus all of the above.

These are the spans Megatron-LM marks ``is_goodput_span`` (evaluation is the one category it
leaves unmarked), keyed by name so that a trace whose marks were dropped still reads the same.
Time is attributed by interval union with precedence step > restart > checkpoint > evaluation,
so nested or overlapping spans are never counted twice (``io_write`` inside ``checkpoint.save``
is not even read; ``first_iteration`` wrapping a step contributes only its time outside the
step). The categories therefore add up to wall exactly. **Overall** sums every rank's times
(rank-seconds); its goodput is total productive / total wall.

On the span store (:func:`goodput_store`), the aggregator's state (:class:`GoodputAggregator`) is
filled by a few DuckDB queries, then :meth:`GoodputAggregator.finish` attributes the time. What
goodput reads of a span is its name and times: the extents come from one aggregate per resource,
and only the spans goodput keeps (steps: 16 bytes each, the rare phase spans, the launcher's job
spans) leave DuckDB, as arrays. Every use of those lists in ``finish`` is independent of their
order, and they are fetched in read order anyway.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from typing import Any

from orjson import loads

from mlaunch.model.identity import RUN_UUID
from mlaunch.model.spans import ALIASES, STEP_SPAN, Attr, LegacyName, ResourceAttr, SpanName
from mlaunch.otlp.otlp_json import attributes
from mlaunch.trace.reader import Resource, no_spans_error
from mlaunch.trace.stats import Interval, clip, median, merge, subtract, total
from mlaunch.trace.store import Store, StoreReader, _sql_in

_NS_PER_MS = 1e6

#: Restart-cost components: span name -> the key it is reported under, in precedence order
#: (``startup`` last: what the start-up span holds beyond its named children).
RESTART_SPANS: dict[str, str] = {
    # The launch before the worker's Python ran (Megatron-LM backdates them from the launch
    # stamps mlaunch hands its workers, and from SLURM's job start): one key for the three.
    SpanName.PRE_STARTUP.value: "launch",
    SpanName.STARTUP_LAUNCH_SCRIPT.value: "launch",
    SpanName.STARTUP_CONTAINER_LOAD.value: "launch",
    SpanName.MODEL_INIT.value: "model_init",
    SpanName.CHECKPOINT_LOAD.value: "load_checkpoint",
    SpanName.DATALOADER.value: "data_setup",
    SpanName.FIRST_ITERATION.value: "first_iteration",
    SpanName.STARTUP.value: "startup",
}
#: The restart-cost component with no span of its own: time between incarnations (see the docs).
REQUEUE = "requeue"
#: What tells a worker's incarnations apart without a launcher trace.
_INCARNATION_KEYS = (RUN_UUID, "slurm.restart_count")
_STEP = STEP_SPAN
_PRETRAIN = LegacyName.PRETRAIN.value
_STARTUP = SpanName.STARTUP.value
_FIRST = SpanName.FIRST_ITERATION.value
_SAVE = SpanName.CHECKPOINT_SAVE.value
_EVAL = SpanName.EVALUATE.value
_JOB = SpanName.JOB.value
_ATTEMPT = SpanName.JOB_ATTEMPT.value
#: The launcher's span names (wherever they appear, they are the launcher's, not a rank's).
LAUNCHER_SPANS = frozenset({SpanName.JOB.value, SpanName.JOB_ATTEMPT.value})
#: Names whose intervals are kept besides the steps (all others only widen the rank's extent).
TRACKED = frozenset({_PRETRAIN, _SAVE, _EVAL, *RESTART_SPANS})


@dataclass
class Breakdown:
    """Where a rank's (or the run's) wall time went, in milliseconds."""

    wall_ms: float = 0.0
    productive_ms: float = 0.0
    restart_ms: float = 0.0
    checkpoint_ms: float = 0.0
    evaluation_ms: float = 0.0
    unaccounted_ms: float = 0.0
    restart_split_ms: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys([*RESTART_SPANS.values(), REQUEUE], 0.0)
    )

    @property
    def goodput(self) -> float:
        """productive / wall (0 for an empty wall)."""
        return self.productive_ms / self.wall_ms if self.wall_ms else 0.0

    def add(self, other: Breakdown) -> None:
        """Accumulate another breakdown (for the overall total)."""
        for k in ("wall_ms", "productive_ms", "restart_ms", "checkpoint_ms", "evaluation_ms",
                  "unaccounted_ms"):  # fmt: skip
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.restart_split_ms.items():
            self.restart_split_ms[k] = self.restart_split_ms.get(k, 0.0) + v

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, with the goodput ratio included."""
        return {**asdict(self), "goodput": self.goodput}


@dataclass
class RankGoodput:
    """One rank's goodput."""

    rank: int
    host: str | None
    steps: int
    median_step_ms: float
    first_iteration_excess_ms: float
    wall_source: str  # "mlaunch.job", "megatron.pretrain" or "span extent"
    breakdown: Breakdown

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        d = {k: v for k, v in asdict(self).items() if k != "breakdown"}
        return {**d, **self.breakdown.to_json()}


@dataclass
class GoodputReport:
    """Per-rank and overall goodput."""

    ranks: list[RankGoodput]
    overall: Breakdown
    job_wall_ms: float  # the mlaunch.job extent, else earliest start to latest end over all ranks

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` output."""
        return {
            "overall": {**self.overall.to_json(), "job_wall_ms": self.job_wall_ms},
            "ranks": [r.to_json() for r in self.ranks],
        }


@dataclass
class _RankState:
    """The state of one rank: step intervals as compact arrays, the rest as short lists."""

    host: str | None
    lo: int = 2**63 - 1
    hi: int = -(2**63)
    step_starts: array[int] = field(default_factory=lambda: array("q"))
    step_ends: array[int] = field(default_factory=lambda: array("q"))
    spans: dict[str, list[Interval]] = field(default_factory=dict)
    #: Extent of each incarnation (by run uuid / SLURM restart count) seen in this rank's spans.
    incarnations: dict[str, list[int]] = field(default_factory=dict)


class GoodputAggregator:
    """Goodput's state: step intervals (16 bytes a step), the rare phase spans and the launcher's
    job spans, filled from the store by :func:`goodput_aggregate`."""

    def __init__(self) -> None:
        self.ranks: dict[int, _RankState] = {}
        self.job: list[Interval] = []
        #: Where a later incarnation starts: each mlaunch.job after the first, each attempt > 0.
        self.restarts: list[Interval] = []

    def launcher_span(self, s: dict[str, Any], start: int, end: int) -> None:
        """Fold in one of the launcher's spans (``s``: its name, and attributes for an attempt)."""
        if s["name"] == _JOB:
            self.job.append((start, end))
        elif s["name"] == _ATTEMPT and _attempt_number(s) > 0:
            self.restarts.append((start, end))

    def state(self, res: Resource) -> _RankState:
        """The state of ``res``'s rank, made by the first resource of the rank (its host)."""
        st = self.ranks.get(res.rank)
        if st is None:
            host = res.attrs.get(ResourceAttr.HOST_NAME)
            st = self.ranks[res.rank] = _RankState(None if host is None else str(host))
        return st

    def widen(self, st: _RankState, res: Resource, lo: int, hi: int) -> None:
        """Widen a rank's extent, and its incarnation's, by spans of ``res`` from lo to hi."""
        key = next((str(res.attrs[k]) for k in _INCARNATION_KEYS if k in res.attrs), "")
        ext = st.incarnations.get(key)
        if ext is None:
            st.incarnations[key] = [lo, hi]
        else:
            ext[0], ext[1] = min(ext[0], lo), max(ext[1], hi)
        st.lo, st.hi = min(st.lo, lo), max(st.hi, hi)

    def finish(self) -> GoodputReport:
        """Attribute every rank's wall time."""
        overall = Breakdown()
        ranks: list[RankGoodput] = []
        job = (min(s for s, _ in self.job), max(e for _, e in self.job)) if self.job else None
        # Later incarnations of the launcher: every job span but the earliest, every attempt > 0.
        restarts = sorted(self.job)[1:] + self.restarts
        live = {r: st for r, st in self.ranks.items() if st.hi >= st.lo}
        for r in sorted(live):
            rg = _rank_goodput(r, live[r], job, _gaps(self.job), restarts)
            ranks.append(rg)
            overall.add(rg.breakdown)
        if job is not None:
            lo, hi = job
        else:
            lo = min((s.lo for s in live.values()), default=0)
            hi = max((s.hi for s in live.values()), default=0)
        wall_ms = max(0, hi - lo) / _NS_PER_MS
        if not live:
            # Only the launcher's job trace (workers that export nothing: a script without
            # telemetry): the job's wall time, none of it shown productive by any span.
            overall.wall_ms = overall.unaccounted_ms = wall_ms
        return GoodputReport(ranks, overall, wall_ms)


def _attempt_number(span: dict[str, Any]) -> int:
    """``mlaunch.attempt`` of a launcher attempt span (0 when missing or not a number)."""
    value = attributes(span.get("attributes")).get(Attr.ATTEMPT.value, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _gaps(intervals: list[Interval]) -> list[Interval]:
    """The holes between the merged ``intervals`` (from the first start to the last end)."""
    merged = merge(intervals)
    return [(a_end, b_start) for (_, a_end), (b_start, _) in zip(merged, merged[1:], strict=False)]


def _requeue(
    st: _RankState, gaps: list[Interval], restarts: list[Interval], launcher: bool
) -> list[Interval]:
    """Time between incarnations for this rank (see the module docs: **requeue**)."""
    if not launcher:  # a worker-only trace: the gaps between its incarnations' extents
        return _gaps([(lo, hi) for lo, hi in st.incarnations.values()])
    starts = sorted(
        [*st.step_starts, *(s for spans in st.spans.values() for s, _ in spans)]
    )  # fmt: skip
    out = list(gaps)
    for lo, hi in restarts:
        i = bisect_left(starts, lo)
        first = starts[i] if i < len(starts) else hi
        out.append((lo, min(first, hi)))
    return out


def _rank_goodput(
    rank: int,
    st: _RankState,
    job: tuple[int, int] | None,
    gaps: list[Interval],
    restarts: list[Interval],
) -> RankGoodput:
    pretrain = st.spans.get(_PRETRAIN, [])
    if job is not None:
        (lo, hi), source = job, _JOB
    elif pretrain:
        lo, hi = min(s for s, _ in pretrain), max(e for _, e in pretrain)
        source = _PRETRAIN
    else:
        lo, hi, source = st.lo, st.hi, "span extent"
    wall = max(0, hi - lo)

    steps = list(zip(st.step_starts, st.step_ends, strict=True))
    step_u = clip(merge(steps), lo, hi)
    med = median([e - s for s, e in steps]) if steps else 0.0
    excess = sum(max(0.0, (e - s) - med) for s, e in _first_steps(steps, st.spans, st.lo))

    covered = step_u
    split = dict.fromkeys(RESTART_SPANS.values(), 0.0)
    for name, key in RESTART_SPANS.items():
        own = subtract(clip(merge(st.spans.get(name, [])), lo, hi), covered)
        split[key] += total(own) / _NS_PER_MS
        covered = merge(covered + own)
    split["first_iteration"] += excess / _NS_PER_MS
    own = subtract(clip(merge(_requeue(st, gaps, restarts, job is not None)), lo, hi), covered)
    split[REQUEUE] = total(own) / _NS_PER_MS
    covered = merge(covered + own)
    parts: dict[str, float] = {}
    for key, name in (("checkpoint", _SAVE), ("evaluation", _EVAL)):
        own = subtract(clip(merge(st.spans.get(name, [])), lo, hi), covered)
        parts[key] = total(own) / _NS_PER_MS
        covered = merge(covered + own)

    productive = (total(step_u) - excess) / _NS_PER_MS
    wall_ms = wall / _NS_PER_MS
    restart = sum(split.values())
    bd = Breakdown(
        wall_ms=wall_ms, productive_ms=productive, restart_ms=restart,
        checkpoint_ms=parts["checkpoint"], evaluation_ms=parts["evaluation"],
        unaccounted_ms=max(0.0, wall_ms - productive - restart - parts["checkpoint"]
                           - parts["evaluation"]),
        restart_split_ms=split,
    )  # fmt: skip
    return RankGoodput(rank, st.host, len(steps), med / _NS_PER_MS, excess / _NS_PER_MS, source, bd)


def _first_steps(
    steps: list[Interval], spans: dict[str, list[Interval]], lo: int
) -> list[Interval]:
    """The first step of each incarnation: the earliest step inside each ``first_iteration``
    span; without those, the earliest step after each ``megatron.startup`` (older traces:
    ``megatron.pretrain``) start, or the rank's earliest."""
    if not steps:
        return []
    # Sorted once, each window is a bisection (a run of many restarts has many windows; a scan
    # of every step per window was quadratic). The smallest step of a window is the first one
    # in this order that it holds.
    ordered = sorted(steps)
    firsts = spans.get(_FIRST)
    if firsts:
        out = []
        for fs, fe in firsts:
            for i in range(bisect_left(ordered, (fs, -(2**63))), len(ordered)):
                s, e = ordered[i]
                if s > fe:
                    break
                if e <= fe:
                    out.append((s, e))
                    break
        return out
    starts = sorted(s for s, _ in spans.get(_STARTUP) or spans.get(_PRETRAIN) or []) or [lo]
    out = []
    for i, ps in enumerate(starts):
        pe = starts[i + 1] if i + 1 < len(starts) else 2**63
        j = bisect_left(ordered, (ps, -(2**63)))
        if j < len(ordered) and ordered[j][0] < pe:
            out.append(ordered[j])
    return out


def _names(canon: frozenset[str] | set[str]) -> list[str]:
    """The stored names the stream reads as one of ``canon`` (its rule: the alias table's name,
    else the name as written): the code names and older traces' documented ones."""
    return sorted(n for n in {*canon, *ALIASES} if ALIASES.get(n, n) in canon)


def goodput_store(store: Store) -> GoodputReport:
    """The goodput of the store's spans. Raises ``TraceInputError`` for a store without spans."""
    return goodput_aggregate(store).finish()


def goodput_aggregate(store: Store) -> GoodputAggregator:
    """The streaming aggregator's state after every span of the store, filled by the queries
    (``mlaunch trace report`` reads the ranks' extents from it). Raises ``TraceInputError`` for
    a store without spans."""
    launcher_names = _sql_in(sorted(LAUNCHER_SPANS))
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
            f"SELECT rank, start_ns, end_ns FROM spans WHERE {keep} ({_sql_in(_names({STEP_SPAN}))})"
        ).fetchnumpy()
        tracked = con.execute(
            f"SELECT rank, name, start_ns, end_ns FROM spans WHERE {keep} ({_sql_in(_names(TRACKED))})"
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
