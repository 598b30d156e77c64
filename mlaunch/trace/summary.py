"""``mlaunch trace summary``: per-span-name duration statistics, per-rank step skew (stragglers),
error/truncated counts and the run's resource attributes, computed in one streaming pass.

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

from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

from mlaunch.model.spans import ALIASES, STEP_SPAN, ResourceAttr, SpanName
from mlaunch.trace.reader import (
    EXPORT_ADVICE,
    ReadStats,
    Resource,
    TraceInputError,
    TraceReader,
    export_advice,
    is_error,
    is_truncated,
)
from mlaunch.trace.stats import median, percentile

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


class SummaryAggregator:
    """Streaming per-name aggregates: durations in compact ``array('q')`` (8 bytes a span), never
    the span dicts themselves."""

    def __init__(self) -> None:
        self.durations: dict[str, array[int]] = {}
        self.errors: dict[str, int] = {}
        self.truncated: dict[str, int] = {}
        self.step_by_rank: dict[int, array[int]] = {}
        self.resources: dict[int, dict[str, Any]] = {}
        #: The first rank of each trace root's (trace id, span id), and the roots seen on a second
        #: rank. Roots only: a rank has few (its start-up, one per train block), so this stays
        #: small, and ranks that draw the same ids draw them for their roots too.
        self.root_rank: dict[tuple[Any, Any], int] = {}
        self.shared_roots: set[tuple[Any, Any]] = set()

    def add(self, res: Resource, spans: list[dict[str, Any]], maybe_truncated: bool) -> None:
        """Fold one batch in. The loop is the hot path: plain dict lookups, no per-span objects."""
        rank = res.rank
        if rank not in self.resources and not res.launcher:
            self.resources[rank] = res.attrs
        durations = self.durations
        steps = self.step_by_rank.get(rank)
        canon = ALIASES
        roots = None if res.launcher else self.root_rank
        for s in spans:
            if roots is not None and not s.get("parentSpanId"):
                key = (s.get("traceId"), s.get("spanId"))
                if roots.setdefault(key, rank) != rank:
                    self.shared_roots.add(key)
            name = s["name"]
            name = canon.get(name, name)
            d = int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"])
            if d < 0:  # a wall-clock step back between start and end: count it as instant
                d = 0
            a = durations.get(name)
            if a is None:
                a = durations[name] = array("q")
            a.append(d)
            if name == STEP:
                if steps is None:
                    steps = self.step_by_rank[rank] = array("q")
                steps.append(d)
            if is_error(s):
                self.errors[name] = self.errors.get(name, 0) + 1
            if maybe_truncated and is_truncated(s):
                self.truncated[name] = self.truncated.get(name, 0) + 1

    def finish(
        self, read: ReadStats | None = None, *, straggler_threshold: float = 0.05
    ) -> Summary:
        """The summary of everything added so far."""
        step_total = sum(self.durations.get(STEP, ()))
        stats: list[NameStats] = []
        for name, arr in self.durations.items():
            vals = sorted(arr)
            tot = sum(vals)
            stats.append(
                NameStats(
                    name=name, count=len(vals), total_ms=tot / _NS_PER_MS,
                    mean_ms=tot / len(vals) / _NS_PER_MS,
                    p50_ms=percentile(vals, 50) / _NS_PER_MS,
                    p95_ms=percentile(vals, 95) / _NS_PER_MS,
                    max_ms=vals[-1] / _NS_PER_MS,
                    share=(tot / step_total) if step_total and name not in _LAUNCHER else None,
                    errors=self.errors.get(name, 0), truncated=self.truncated.get(name, 0),
                )
            )  # fmt: skip
        stats.sort(key=lambda s: (-s.total_ms, s.name))

        ranks, skew = self._skew(straggler_threshold)
        hosts = sorted(
            {str(h) for r in self.resources.values() if (h := r.get(ResourceAttr.HOST_NAME))}
        )
        first = self.resources[min(self.resources)] if self.resources else {}
        run = {k: first[k] for k in RUN_ATTRS if k in first}
        read_info: dict[str, Any] = {}
        if read is not None:
            read_info = {
                "files": read.files, "lines": read.lines, "spans": read.spans,
                "duplicate_spans_dropped": read.duplicate_spans,
                "skipped_lines": [f"{p}:{n}: {why}" for p, n, why in read.skipped_lines],
                "skipped_spans": [f"{p}:{n}: {why}" for p, n, why in read.skipped_spans],
                "torn_lines": [f"{p}:{n}" for p, n in read.torn_lines],
            }  # fmt: skip
        return Summary(
            spans=stats, ranks=ranks, skew=skew,
            errors=sum(self.errors.values()), truncated=sum(self.truncated.values()),
            run=run, hosts=hosts, rank_ids=sorted(self.resources), read=read_info,
            shared_root_ids=len(self.shared_roots),
        )  # fmt: skip

    def _skew(self, threshold: float) -> tuple[list[RankSkew], Skew | None]:
        medians = {r: median(a) for r, a in self.step_by_rank.items() if len(a)}
        per_rank = []
        for r in sorted(medians):
            vals = sorted(self.step_by_rank[r])
            per_rank.append((r, len(vals), medians[r], percentile(vals, 95)))
        return rank_skew(per_rank, self.resources, threshold)


def rank_skew(
    per_rank: list[tuple[int, int, float, float]],
    resources: dict[int, dict[str, Any]],
    threshold: float,
) -> tuple[list[RankSkew], Skew | None]:
    """Each rank's step-time skew against the median of the ranks' medians, from ``(rank, steps,
    median_ns, p95_ns)`` rows in rank order: the one rule for the JSON and the store readers."""
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


def summarize(reader: TraceReader, *, straggler_threshold: float = 0.05) -> Summary:
    """Read every batch of ``reader`` once and summarize it. Raises ``TraceInputError`` for a
    malformed span (naming its file and line) or a trace without spans."""
    agg = SummaryAggregator()
    reader.feed(agg.add)
    if not agg.durations:
        raise no_spans_error(reader)
    return agg.finish(reader.stats, straggler_threshold=straggler_threshold)


def no_spans_error(reader: TraceReader) -> TraceInputError:
    """The error for input that parsed but held no spans (empty files, a metrics file), or, for
    a command that needs the workers' spans, only the launcher's job trace (which is a trace:
    summary, goodput and report read it)."""
    files = list(reader.files)
    if reader.stats.spans and files and all(getattr(f, "launcher", False) for f in files):
        return TraceInputError(
            f"only the launcher's job trace ({reader.stats.spans:,} spans: mlaunch.job and its"
            " attempts) and no worker spans: the workers exported none",
            fix="`mlaunch trace summary`, `goodput` and `report` read the job trace; for the"
            " workers' spans, turn their telemetry on (mlaunch's trainer, a script using"
            " mlaunch.telemetry, or Megatron-LM with --otel-enabled)",
        )
    names = ", ".join(str(f.path) for f in files[:3])
    extra = " (it holds metrics only)" if reader.stats.metric_lines else ""
    return TraceInputError(
        f"no spans in {names}{extra}",
        fix="point at the traces file (traces-rank<R>.jsonl) or the run directory; "
        + (export_advice(reader.files[0].path) if reader.files else EXPORT_ADVICE),
    )
