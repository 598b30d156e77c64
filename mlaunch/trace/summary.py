"""``mlaunch trace summary``: per-span-name duration statistics, per-rank step skew (stragglers),
error/truncated counts and the run's resource attributes: the result types and the rules
(:func:`rank_skew`, :func:`no_spans_error`); the span store computes them
(:mod:`mlaunch.trace.store_summary`).

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

from mlaunch.model.spans import STEP_SPAN, ResourceAttr, SpanName
from mlaunch.trace.reader import (
    EXPORT_ADVICE,
    TraceInputError,
    TraceReader,
    export_advice,
)
from mlaunch.trace.stats import median

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
