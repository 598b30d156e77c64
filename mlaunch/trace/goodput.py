"""``mlaunch trace goodput``: productive training time over wall time, per rank and overall, with
the lost time split into restart cost, checkpoint saves, evaluation and unaccounted time.

Definitions (also in the command help and docs/trace.md), per rank:

* **wall** = the extent of the job span ``megatron.pretrain`` (earliest start to latest end, so
  the gap between restarted attempts counts as lost time); without it, the earliest start to the
  latest end of any span of the rank.
* **productive** = the time covered by ``megatron.train_step`` spans minus the *first-iteration
  excess*: for each first step (the step inside ``megatron.first_iteration``; without that span,
  the earliest step of the rank), ``max(0, its duration - the rank's median step)``.
* **restart** = time in ``megatron.model_init``, ``megatron.load_checkpoint``,
  ``megatron.data.setup`` and ``megatron.first_iteration`` not already inside a step, plus the
  first-iteration excess.
* **checkpoint** = time in ``megatron.save_checkpoint``; **evaluation** = time in
  ``megatron.evaluate``; **unaccounted** = wall minus all of the above.

Time is attributed by interval union with precedence step > restart > checkpoint > evaluation,
so nested or overlapping spans are never counted twice (``io_write`` inside ``save_checkpoint``
is not even read; ``first_iteration`` wrapping a step contributes only its time outside the
step). The categories therefore add up to wall exactly. **Overall** sums every rank's times
(rank-seconds); its goodput is total productive / total wall.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

from mlaunch.model.spans import ResourceAttr, SpanName
from mlaunch.trace.reader import Resource, TraceReader
from mlaunch.trace.stats import Interval, clip, median, merge, subtract, total
from mlaunch.trace.summary import no_spans_error

_NS_PER_MS = 1e6

#: Restart-cost components: span name -> the key it is reported under.
RESTART_SPANS: dict[str, str] = {
    SpanName.MODEL_INIT.value: "model_init",
    SpanName.LOAD_CHECKPOINT.value: "load_checkpoint",
    SpanName.DATA_SETUP.value: "data_setup",
    SpanName.FIRST_ITERATION.value: "first_iteration",
}
_STEP = SpanName.TRAIN_STEP.value
_PRETRAIN = SpanName.PRETRAIN.value
_FIRST = SpanName.FIRST_ITERATION.value
_SAVE = SpanName.SAVE_CHECKPOINT.value
_EVAL = SpanName.EVALUATE.value
#: Names whose intervals are kept (all others only widen the rank's extent).
_TRACKED = frozenset({_PRETRAIN, _SAVE, _EVAL, *RESTART_SPANS})


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
        default_factory=lambda: dict.fromkeys(RESTART_SPANS.values(), 0.0)
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
    wall_source: str  # "megatron.pretrain" or "span extent"
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
    job_wall_ms: float  # earliest start to latest end over all ranks

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` output."""
        return {
            "overall": {**self.overall.to_json(), "job_wall_ms": self.job_wall_ms},
            "ranks": [r.to_json() for r in self.ranks],
        }


@dataclass
class _RankState:
    """Streaming state of one rank: step intervals as compact arrays, the rest as short lists."""

    host: str | None
    lo: int = 2**63 - 1
    hi: int = -(2**63)
    step_starts: array[int] = field(default_factory=lambda: array("q"))
    step_ends: array[int] = field(default_factory=lambda: array("q"))
    spans: dict[str, list[Interval]] = field(default_factory=dict)


class GoodputAggregator:
    """Streaming goodput: keeps step intervals (16 bytes a step) and the rare phase spans."""

    def __init__(self) -> None:
        self.ranks: dict[int, _RankState] = {}

    def add(
        self, res: Resource, spans: list[dict[str, Any]], maybe_truncated: bool = False
    ) -> None:
        """Fold one batch in."""
        st = self.ranks.get(res.rank)
        if st is None:
            host = res.attrs.get(ResourceAttr.HOST_NAME)
            st = self.ranks[res.rank] = _RankState(None if host is None else str(host))
        lo, hi = st.lo, st.hi
        for s in spans:
            start = int(s["startTimeUnixNano"])
            end = int(s["endTimeUnixNano"])
            if start < lo:
                lo = start
            if end > hi:
                hi = end
            name = s["name"]
            if name == _STEP:
                st.step_starts.append(start)
                st.step_ends.append(end)
            elif name in _TRACKED:
                st.spans.setdefault(name, []).append((start, end))
        st.lo, st.hi = lo, hi

    def finish(self) -> GoodputReport:
        """Attribute every rank's wall time."""
        overall = Breakdown()
        ranks: list[RankGoodput] = []
        for r in sorted(self.ranks):
            rg = _rank_goodput(r, self.ranks[r])
            ranks.append(rg)
            overall.add(rg.breakdown)
        lo = min((s.lo for s in self.ranks.values()), default=0)
        hi = max((s.hi for s in self.ranks.values()), default=0)
        return GoodputReport(ranks, overall, max(0, hi - lo) / _NS_PER_MS)


def _rank_goodput(rank: int, st: _RankState) -> RankGoodput:
    pretrain = st.spans.get(_PRETRAIN, [])
    if pretrain:
        lo, hi = min(s for s, _ in pretrain), max(e for _, e in pretrain)
        source = _PRETRAIN
    else:
        lo, hi, source = st.lo, st.hi, "span extent"
    wall = max(0, hi - lo)

    steps = list(zip(st.step_starts, st.step_ends, strict=True))
    step_u = clip(merge(steps), lo, hi)
    med = median([e - s for s, e in steps]) if steps else 0.0
    excess = sum(max(0.0, (e - s) - med) for s, e in _first_steps(steps, st.spans, lo))

    covered = step_u
    split: dict[str, float] = {}
    for name, key in RESTART_SPANS.items():
        own = subtract(clip(merge(st.spans.get(name, [])), lo, hi), covered)
        split[key] = total(own) / _NS_PER_MS
        covered = merge(covered + own)
    split["first_iteration"] += excess / _NS_PER_MS
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
    """The first step of each attempt: the earliest step inside each ``first_iteration`` span;
    without those, the earliest step after each ``pretrain`` start (or the rank's earliest)."""
    if not steps:
        return []
    firsts = spans.get(_FIRST)
    if firsts:
        out = []
        for fs, fe in firsts:
            inside = [(s, e) for s, e in steps if s >= fs and e <= fe]
            if inside:
                out.append(min(inside))
        return out
    starts = sorted(s for s, _ in spans.get(_PRETRAIN, [])) or [lo]
    out = []
    for i, ps in enumerate(starts):
        pe = starts[i + 1] if i + 1 < len(starts) else 2**63
        inside = [(s, e) for s, e in steps if ps <= s < pe]
        if inside:
            out.append(min(inside))
    return out


def goodput(reader: TraceReader) -> GoodputReport:
    """Read every batch of ``reader`` once and compute goodput. Raises ``TraceInputError`` for a
    malformed span (naming its file and line) or a trace without spans."""
    agg = GoodputAggregator()
    for res, spans, _ in reader:
        try:
            agg.add(res, spans)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise reader.error_here(f"malformed span ({type(e).__name__}: {e})") from None
    if not agg.ranks:
        raise no_spans_error(reader)
    return agg.finish()
