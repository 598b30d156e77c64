"""The timeline's window of iterations: choosing it (:func:`choose_iterations`, the report's
window API), and the report's two passes over the span store, column-wise. Pass 2 keeps only
the spans that overlap the window, so a long run's report holds no more than the window in
memory.

Pass 1 (:class:`StoreScan`) is the store's own queries for the summary and goodput
(:func:`~mlaunch.trace.summary.summarize_store`, :func:`~mlaunch.trace.goodput.goodput_aggregate`)
and what a :class:`Scan` keeps to place the window: each iteration's step times (24 bytes an
iteration whatever the number of ranks), each rank's count of steps, the steps the curves need
and the capture and recorder marks. For those, Arrow filters each part down to the spans that
can be a step or a mark (a step name, or an attribute list that names a mark key), and only
those become dicts, fed to :meth:`Scan.note`. Pass 2 (:func:`collect_window`) keeps the
spans overlapping the window by a numpy mask over each part's times; only those (at most
``MAX_TIMELINE_SPANS``) become :class:`WSpan` records. Both passes read the parts in read order.
The steps of the one rank the curves are drawn from (without ``progress.jsonl``) are read again
from its parts once pass 1 has chosen it.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from orjson import loads

from mlaunch.model.spans import ALIASES, STEP_SPAN, Attr
from mlaunch.otlp.otlp_json import any_value, attributes
from mlaunch.trace.goodput import GoodputAggregator, goodput_aggregate
from mlaunch.trace.reader import TraceInputError
from mlaunch.trace.store import Store, StoreReader
from mlaunch.trace.summary import Summary, summarize_store

#: Iterations shown at each end of the run by the default timeline window.
EDGE_ITERATIONS = 3
#: A timeline window with more spans than this is refused (the browser would crawl); the error
#: says to choose a narrower ``--iterations``.
MAX_TIMELINE_SPANS = 150_000
#: Steps pass 1 keeps for the curves when there is no ``progress.jsonl``, 41 bytes each (86 MB):
#: every rank's while they fit (which rank the curves are drawn from is known only at the end),
#: then only the leader's (the most losses so far) and the rank's being read, as a rank's steps
#: come together (a part, or a file, at a time). The steps of the rank chosen are read again
#: only when they were dropped: when even two ranks' steps do not fit (runs of 10^6 iterations
#: and more), or a rank dropped had more steps later in the read.
MAX_KEPT_STEPS = 1 << 21
_STEP = STEP_SPAN  # megatron.train.iteration (older traces' megatron.train_step, via ALIASES)


def parse_iterations(text: str) -> tuple[int, int]:
    """``"A:B"`` (inclusive, ``A <= B``) or ``"A"`` (just A) as ``(A, B)``.

    Raises ``ValueError`` with a message fit for the user.
    """
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            a = b = int(parts[0])
        elif len(parts) == 2:
            a, b = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{text!r} is not an iteration range; write A:B with whole numbers, e.g. 10:20"
        ) from None
    if a < 0 or b < 0:
        raise ValueError(f"{text!r}: iterations are not negative")
    if a > b:
        raise ValueError(f"{text!r}: the first iteration is after the last; write {b}:{a}")
    return a, b


def choose_iterations(
    present: Sequence[int],
    requested: tuple[int, int] | None,
    edge: int = EDGE_ITERATIONS,
    include: Sequence[tuple[int, int]] = (),
) -> list[tuple[int, int]]:
    """The iteration ranges the timeline shows, given the sorted distinct iterations the trace
    holds: ``requested`` clipped to the trace, or the first and last ``edge`` iterations (all of
    them when the run is short) plus the ``include`` ranges (live captures and recorder dumps:
    the detail the user asked for is never hidden in the gap). Raises ``TraceInputError`` when
    ``requested`` misses the trace."""
    if requested is not None:
        a, b = requested
        inside = [i for i in present if a <= i <= b]
        if not inside:
            held = f"iterations {present[0]}-{present[-1]}" if present else "no train steps"
            raise TraceInputError(
                f"--iterations {a}:{b}: no megatron.train.iteration in that range (the trace holds "
                f"{held})",
                fix="choose a range inside the trace's iterations",
            )
        return [(inside[0], inside[-1])]
    if not present:
        return []
    if len(present) <= 2 * edge + 1:
        return [(present[0], present[-1])]
    ranges = [(present[0], present[edge - 1]), (present[-edge], present[-1])]
    for a, b in include:
        inside = [i for i in present if a <= i <= b]
        if inside:
            ranges.append((inside[0], inside[-1]))
    return _merge_ranges(ranges, present)


def _merge_ranges(ranges: list[tuple[int, int]], present: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted ranges, those that overlap or have no present iteration between them merged."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and not any(merged[-1][1] < i < a for i in present):
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


class Mark(NamedTuple):
    """A band on the timeline: a live capture's window or a flight-recorder dump."""

    kind: str  # "capture" or "recorder"
    label: str  # the capture id, or the recorder trigger
    start: int
    end: int
    ranks: tuple[int, ...]
    #: The iterations it covers (from its step spans); None when it holds none.
    iterations: tuple[int, int] | None


class _MarkAcc:
    """What one capture (or one rank's recorder dump) has shown so far in pass 1."""

    __slots__ = ("lo", "hi", "step_lo", "step_hi", "it_lo", "it_hi", "ranks")

    def __init__(self) -> None:
        self.lo = self.step_lo = self.it_lo = 1 << 62
        self.hi = self.step_hi = self.it_hi = -1
        self.ranks: set[int] = set()

    def span(self) -> tuple[int, int]:
        """Its time range: over its step spans when it has them."""
        return (self.step_lo, self.step_hi) if self.step_hi >= 0 else (self.lo, self.hi)

    def iterations(self) -> tuple[int, int] | None:
        return (self.it_lo, self.it_hi) if self.it_hi >= 0 else None


_CAPTURE_KEY = Attr.CAPTURE_ID.value
_TRIGGER_KEY = Attr.RECORDER_TRIGGER.value
_OPEN_KEY = Attr.RECORDER_OPEN.value
_DUMP_KEY = Attr.RECORDER_DUMP.value
_MARK_KEYS = frozenset({_CAPTURE_KEY, _TRIGGER_KEY, _DUMP_KEY, _OPEN_KEY})


def _mark_value(raw: Any) -> tuple[str | None, str | None, Any, bool]:
    """The capture id, recorder trigger and dump number of a span's raw OTLP attributes, and
    whether the recorder wrote it open; a plain loop over the few attributes, no decoding."""
    if isinstance(raw, dict):  # already decoded
        return (
            raw.get(_CAPTURE_KEY), raw.get(_TRIGGER_KEY), raw.get(_DUMP_KEY),
            bool(raw.get(_OPEN_KEY)),
        )  # fmt: skip
    capture = trigger = dump = None
    still_open = False
    for kv in raw if isinstance(raw, list) else ():
        if not isinstance(kv, dict):
            continue  # a malformed attribute: the readers tolerate it, so does this
        key = kv.get("key")
        if key not in _MARK_KEYS:
            continue
        value = kv.get("value")
        value = value if isinstance(value, dict) else {}
        if key == _CAPTURE_KEY:
            capture = value.get("stringValue")
        elif key == _TRIGGER_KEY:
            trigger = value.get("stringValue")
        elif key == _DUMP_KEY:
            dump = value.get("intValue")
        else:
            still_open = True
    return capture, trigger, dump, still_open


def _recorder_marks(trigger: str, dumps: list[_MarkAcc]) -> list[Mark]:
    """One mark per dump event of ``trigger``: the ranks' dumps that hold the same iterations
    (every rank writes the same ones on a slow trigger; without step spans: that overlap in
    time) are one band; one rank's dumps never share an iteration (each holds those after the
    last), so two dumps stay two bands even when their iterations follow each other."""
    out: list[Mark] = []
    for acc in sorted(dumps, key=lambda a: a.span()):
        lo, hi = acc.span()
        its = acc.iterations()
        last = out[-1] if out else None
        if last is not None and last.iterations is not None and its is not None:
            same = its[0] <= last.iterations[1] and last.iterations[0] <= its[1]
        else:
            same = last is not None and lo < last.end
        if last is not None and same:
            merged = last.iterations
            if its is not None:
                merged = its if merged is None else (min(merged[0], its[0]), max(merged[1], its[1]))
            out[-1] = last._replace(
                end=max(last.end, hi), ranks=tuple(sorted({*last.ranks, *acc.ranks})),
                iterations=merged,
            )  # fmt: skip
        else:
            out.append(Mark("recorder", trigger, lo, hi, tuple(sorted(acc.ranks)), its))
    return out


class Step(NamedTuple):
    """One ``megatron.train.iteration`` span of one rank: when, and what it reported."""

    iteration: int
    start: int
    end: int
    loss: float | None
    grad_norm: float | None


_I64 = (-(1 << 63), (1 << 63) - 1)


class RankSteps:
    """One rank's steps, column-wise: arrays of machine numbers (41 bytes a step, against
    about 220 as tuples of Python numbers; a 10^8-span trace holds 10^6 steps or more)."""

    __slots__ = ("iteration", "start", "end", "loss", "grad_norm", "_has")

    def __init__(self) -> None:
        self.iteration, self.start, self.end = array("q"), array("q"), array("q")
        self.loss, self.grad_norm = array("d"), array("d")
        self._has = array("b")  # bit 0: a loss; bit 1: a grad norm (a NaN loss is a value)

    def append(self, it: int, start: int, end: int, loss: float | None, gn: float | None) -> None:
        """Add a step (``it``, ``start`` and ``end`` within 64 bits)."""
        self.iteration.append(it)
        self.start.append(start)
        self.end.append(end)
        self.loss.append(0.0 if loss is None else loss)
        self.grad_norm.append(0.0 if gn is None else gn)
        self._has.append((loss is not None) | (gn is not None) << 1)

    def __len__(self) -> int:
        return len(self.iteration)

    def __getitem__(self, i: int) -> Step:
        has = self._has[i]
        return Step(self.iteration[i], self.start[i], self.end[i],
                    self.loss[i] if has & 1 else None, self.grad_norm[i] if has & 2 else None)  # fmt: skip

    def __iter__(self) -> Iterator[Step]:
        return (self[i] for i in range(len(self)))

    def losses(self) -> int:
        """How many of the steps report a loss."""
        return sum(h & 1 for h in self._has)


class IterationTimes:
    """Each iteration's earliest step start and latest step end on any rank, as three sorted
    int64 arrays (24 bytes an iteration, against about 190 as a dict of lists: 10^6 iterations
    are 24 MB). Steps arrive in a buffer, folded in once it holds as many as the arrays (so
    each step is sorted a bounded number of times)."""

    __slots__ = ("_buf", "_its", "_lo", "_hi")
    _MIN_FOLD = 1 << 16

    def __init__(self) -> None:
        self._buf = array("q")  # iteration, start, end of each step not yet folded in
        self._its: Any = None
        self._lo: Any = None
        self._hi: Any = None

    def add(self, it: int, start: int, end: int) -> None:
        """A step of iteration ``it`` from ``start`` to ``end`` (each within 64 bits)."""
        buf = self._buf
        buf.extend((it, start, end))
        if len(buf) >= 3 * max(self._MIN_FOLD, 0 if self._its is None else len(self._its)):
            self._fold()

    def _fold(self) -> None:
        import numpy as np

        new = np.array(self._buf, dtype=np.int64).reshape(-1, 3)
        self._buf = array("q")
        its, lo, hi = new[:, 0], new[:, 1], new[:, 2]
        if self._its is not None:
            its = np.concatenate([self._its, its])
            lo = np.concatenate([self._lo, lo])
            hi = np.concatenate([self._hi, hi])
        if not len(its):  # no step yet
            self._its, self._lo, self._hi = its, lo, hi
            return
        order = np.argsort(its, kind="stable")
        its, lo, hi = its[order], lo[order], hi[order]
        first = np.flatnonzero(np.concatenate([[True], its[1:] != its[:-1]]))
        self._its = its[first]
        self._lo = np.minimum.reduceat(lo, first)
        self._hi = np.maximum.reduceat(hi, first)

    def _arrays(self) -> tuple[Any, Any, Any]:
        if self._buf or self._its is None:
            self._fold()
        return self._its, self._lo, self._hi

    def iterations(self) -> list[int]:
        """The distinct iterations, sorted."""
        return self._arrays()[0].tolist()

    def first_start(self, iteration: int) -> int:
        """The earliest start of ``iteration``'s steps (``KeyError`` when it has none)."""
        its, lo, _ = self._arrays()
        i = int(its.searchsorted(iteration))
        if i == len(its) or its[i] != iteration:
            raise KeyError(iteration)
        return int(lo[i])

    def steps_between(self, a: int, b: int) -> tuple[int, int]:
        """The earliest start and latest end of the steps of iterations ``a``-``b``
        (inclusive; at least one is present)."""
        its, lo, hi = self._arrays()
        i, j = int(its.searchsorted(a, "left")), int(its.searchsorted(b, "right"))
        if i == j:
            raise ValueError(f"no step in iterations {a}-{b}")
        return int(lo[i:j].min()), int(hi[i:j].max())


class Scan:
    """Pass 1: the goodput aggregate (filled by :class:`StoreScan`), each
    iteration's step times (to place the window), each rank's count of steps and, with ``keep_steps`` (the curves need them when
    ``progress.jsonl`` is missing), every rank's steps (41 bytes a step) up to ``max_kept``."""

    def __init__(self, keep_steps: bool = True, max_kept: int | None = None) -> None:
        self.goodput = GoodputAggregator()
        #: Each iteration's earliest step start and latest step end on any rank: what places the
        #: window (24 bytes an iteration, whatever the number of ranks).
        self.by_iteration = IterationTimes()
        #: Every rank's steps, kept only when the curves are drawn from them (no progress file):
        #: they grow with ranks x iterations (10^8 steps for 1,024 ranks x 100,000 iterations).
        self.keep_steps = keep_steps
        self.steps: dict[int, RankSteps] = {}
        #: Past this many steps in all, the steps of every rank but two are dropped: the one
        #: with the most losses so far and the one being read (a rank dropped that gets no more
        #: steps cannot be the curves' rank: the leader only gains); past it with those two,
        #: every rank's. A rank the curves need whose steps were dropped is read again.
        self.max_kept = max_kept
        self.dropped_steps = False
        self._pruned: set[int] = set()
        self._kept = 0
        #: Each rank's [steps, steps with a loss]: which rank the curves are drawn from.
        self.step_counts: dict[int, list[int]] = {}
        self._captures: dict[str, _MarkAcc] = {}
        self._dumps: dict[tuple[str, int, Any], _MarkAcc] = {}  # (trigger, rank, dump)

    def note(self, rank: int, spans: list[dict[str, Any]]) -> None:
        """Fold in the steps and marks of one worker batch (the span store hands only the
        spans that can be either)."""
        if rank not in self.steps:
            self.steps[rank] = RankSteps()
        keep, by_it, counts = self.keep_steps, self.by_iteration, self.step_counts
        canon = ALIASES
        for s in spans:
            name = s["name"]
            is_step = canon.get(name, name) == _STEP
            capture, trigger, dump, still_open = _mark_value(s.get("attributes"))
            if capture is not None or (trigger is not None and not still_open):
                self._note_mark(rank, s, capture, trigger, dump, is_step)
            if not is_step:
                continue
            step = step_of(s)
            if step is None:
                continue
            it, start, end = step.iteration, step.start, step.end
            count = counts.get(rank)
            if count is None:
                count = counts[rank] = [0, 0]
            count[0] += 1
            count[1] += step.loss is not None
            if keep:
                self.steps[rank].append(*step)
                self._kept += 1
                if self.max_kept is not None and self._kept > self.max_kept:
                    self._prune(rank)
                    keep = self.keep_steps
            by_it.add(it, start, end)

    def _prune(self, rank: int) -> None:
        counts = self.step_counts
        lead = max(counts, key=lambda r: (counts[r][1], r))
        for r, steps in self.steps.items():
            if r not in (lead, rank) and len(steps):
                self.steps[r] = RankSteps()
                self._pruned.add(r)
        self._kept = sum(len(s) for s in self.steps.values())
        if self._kept > (self.max_kept or 0):  # two ranks' steps are too many: drop them all
            self.steps = {r: RankSteps() for r in self.steps}
            self.keep_steps, self.dropped_steps = False, True

    def kept_whole(self, rank: int) -> bool:
        """Whether pass 1 holds every step of ``rank`` (else :meth:`rank_steps` reads them
        again)."""
        return not self.dropped_steps and rank not in self._pruned

    def curve_rank(self) -> int | None:
        """The rank the curves are drawn from when there is no progress file: the one whose
        steps report the most losses (the last pipeline stage; the highest rank of a tie), or
        None when no rank has a step."""
        owner = max(self.steps, key=lambda r: (self.step_counts.get(r, (0, 0))[1], r),
                    default=None)  # fmt: skip
        return owner if owner is not None and owner in self.step_counts else None

    def rank_steps(self, rank: int) -> Iterator[Step]:
        """``rank``'s steps in read order: kept by pass 1, or read again when it dropped them."""
        if self.kept_whole(rank):
            return iter(self.steps[rank])
        return self._steps_again(rank)

    def _steps_again(self, rank: int) -> Iterator[Step]:
        """``rank``'s steps read again from the trace (the store's scan reads its parts)."""
        raise NotImplementedError

    def _note_mark(
        self,
        rank: int,
        s: dict[str, Any],
        capture: str | None,
        trigger: str | None,
        dump: Any,
        step: bool,
    ) -> None:
        start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
        it: int | None = None
        if step:
            try:
                it = int(attributes(s.get("attributes")).get(Attr.ITERATION))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                it = None
        accs: list[_MarkAcc] = []
        if capture is not None:
            accs.append(self._captures.setdefault(capture, _MarkAcc()))
        if trigger is not None:
            accs.append(self._dumps.setdefault((trigger, rank, dump), _MarkAcc()))
        for acc in accs:
            acc.ranks.add(rank)
            acc.lo, acc.hi = min(acc.lo, start), max(acc.hi, end)
            if step:
                acc.step_lo, acc.step_hi = min(acc.step_lo, start), max(acc.step_hi, end)
                if it is not None:
                    acc.it_lo, acc.it_hi = min(acc.it_lo, it), max(acc.it_hi, it)

    def marks(self) -> list[Mark]:
        """The live captures (one band each, over their step spans when they have them) and
        the recorder dumps (one band per dump event), in time order."""
        out: list[Mark] = []
        for cid, acc in self._captures.items():
            lo, hi = acc.span()
            out.append(Mark("capture", cid, lo, hi, tuple(sorted(acc.ranks)), acc.iterations()))
        by_trigger: dict[str, list[_MarkAcc]] = {}
        for (trigger, _, _), acc in self._dumps.items():
            by_trigger.setdefault(trigger, []).append(acc)
        for trigger, dumps in by_trigger.items():
            out.extend(_recorder_marks(trigger, dumps))
        return sorted(out, key=lambda m: (m.start, m.kind, m.label))

    def extent(self, rank: int) -> tuple[int, int]:
        """Earliest start and latest end of any span of ``rank``."""
        st = self.goodput.ranks[rank]
        return st.lo, st.hi

    def run_extent(self) -> tuple[int, int]:
        """The earliest start and latest end of any span of any rank; with no rank's spans (only
        the launcher's job trace: the workers exported nothing), the job's."""
        ranks = self.goodput.ranks
        if ranks:
            return min(self.extent(r)[0] for r in ranks), max(self.extent(r)[1] for r in ranks)
        job = self.goodput.job
        return min(lo for lo, _ in job), max(hi for _, hi in job)

    def run_start(self) -> int:
        """The earliest start of the run's spans (time zero of the hover labels)."""
        return self.run_extent()[0]

    def iterations(self) -> list[int]:
        """The distinct iterations of the step spans, sorted."""
        return self.by_iteration.iterations()

    def first_start(self, iteration: int) -> int:
        """The earliest start of ``iteration``'s step on any rank."""
        return self.by_iteration.first_start(iteration)

    def steps_between(self, a: int, b: int) -> tuple[int, int]:
        """The earliest start and latest end of the steps of iterations ``a``-``b`` (inclusive)
        on any rank (at least one is present)."""
        return self.by_iteration.steps_between(a, b)


_STEP_KEYS = (Attr.ITERATION.value, Attr.LOSS.value, Attr.GRAD_NORM.value)


def _step_values(raw: Any) -> tuple[Any, Any, Any]:
    """The iteration, loss and grad norm of a span's raw OTLP attributes, each as
    ``attributes(raw).get(key)`` has it (the last entry of a key counts), without decoding the
    other attributes: pass 1 reads every step span, a tenth of a large trace's spans."""
    it = loss = gn = None
    if not isinstance(raw, list | tuple):
        return it, loss, gn
    k_it, k_loss, k_gn = _STEP_KEYS
    for kv in raw:
        if not isinstance(kv, dict):
            continue
        key = kv.get("key")
        if key == k_it:
            it = any_value(kv.get("value"))
        elif key == k_loss:
            loss = any_value(kv.get("value"))
        elif key == k_gn:
            gn = any_value(kv.get("value"))
    return it, loss, gn


def step_of(s: dict[str, Any]) -> Step | None:
    """A ``megatron.train.iteration`` span as a step, or None when it has no iteration that is
    a number, or a number past 64 bits (no step of the window, nor storable as one)."""
    it, loss, gn = _step_values(s.get("attributes"))
    if it is None:
        return None
    try:
        it = int(it)
    except (TypeError, ValueError):
        return None
    start, end = s["startTimeUnixNano"], s["endTimeUnixNano"]
    if not (_I64[0] <= it <= _I64[1] and _I64[0] <= start <= _I64[1] and _I64[0] <= end <= _I64[1]):
        return None
    return Step(it, start, end, _float(loss), _float(gn))


class WSpan(NamedTuple):
    """A span of the timeline window (field names as :func:`assign_lanes` expects)."""

    start: int
    end: int
    name: str
    key: tuple[str, str]  # (traceId, spanId)
    parent: str
    attrs: dict[str, Any]
    links: list[tuple[str, str]]
    error: bool


def _float(v: Any) -> float | None:
    """An attribute as a float, ``None`` when missing or not a number."""
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def segments(
    scan: Scan, ranges: list[tuple[int, int]], present: Sequence[int]
) -> list[tuple[int, int]]:
    """The time ranges (ns) of the window: for each iteration range, the earliest start to the
    latest end of its steps on any rank, stretched to the run's start (end) when the range holds
    the first (last) iteration, so set-up and tail are shown. No steps: the whole trace."""
    run_lo, run_hi = scan.run_extent()
    if not ranges:
        return [(run_lo, run_hi)]
    segs: list[tuple[int, int]] = []
    for a, b in ranges:
        lo, hi = scan.steps_between(a, b)
        lo = run_lo if a == present[0] else lo
        hi = run_hi if b == present[-1] else hi
        segs.append((lo, hi))
    segs.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in segs:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def in_window(start: int, end: int, segs: Sequence[tuple[int, int]]) -> bool:
    """Whether a span [start, end] is drawn: it overlaps a segment (a zero-length span: lies in
    one)."""
    if start == end:
        return any(lo <= start <= hi for lo, hi in segs)
    return any(start < hi and end > lo for lo, hi in segs)


_STEP_NAMES = sorted({_STEP, *(n for n, c in ALIASES.items() if c == _STEP)})
#: An attribute list that names a mark key (a key as OTLP-JSON writes it: quoted).
_MARK_PATTERN = "|".join(re.escape(f'"{k}"') for k in sorted(_MARK_KEYS))


class StoreScan(Scan):
    """A :class:`Scan` of the store: ``goodput`` is the filled aggregator, ``summary`` is not
    used (the finished :class:`Summary` is :attr:`result`)."""

    def __init__(self, store: Store, keep_steps: bool = True) -> None:
        super().__init__(keep_steps, max_kept=MAX_KEPT_STEPS)
        self.result: Summary = summarize_store(store)  # raises for a store without spans
        self.goodput = goodput_aggregate(store)
        reader = StoreReader(store)
        res = reader.resources()
        self._store, self._res = store, res
        self._resources: dict[int, dict[str, Any]] = {}
        for rid in sorted(res):  # the first worker resource of each rank, as the stream meets it
            r = res[rid]
            if not r.launcher and r.rank not in self._resources:
                self._resources[r.rank] = r.attrs
        _scan_parts(store, res, self)

    @property
    def resources(self) -> dict[int, dict[str, Any]]:
        return self._resources

    def _steps_again(self, rank: int) -> Iterator[Step]:
        """``rank``'s steps, in read order, read again from its parts (``rank=<R>``) when pass 1
        dropped them (:meth:`Scan.rank_steps` decides)."""
        parts = [p for p in self._store.parts if p.parent.name == f"rank={rank}"]
        for r, spans in _step_runs(parts, self._res, marks=False):
            if r != rank:
                continue
            for s in spans:
                step = step_of(s)
                if step is not None:
                    yield step


def _worker_rows(t: Any, res: dict[int, Any], np: Any) -> tuple[Any, Any]:
    """Each row's rank and whether its resource is a worker's (not the launcher's)."""
    rids = t.column("resource_id").to_numpy().astype(np.int64)
    n = int(rids.max()) + 1
    rank = np.array([res[r].rank if r in res else 0 for r in range(n)], np.int64)[rids]
    worker = np.array([r in res and not res[r].launcher for r in range(n)], bool)[rids]
    return rank, worker


def _ranks_in_order(rank: Any, worker: Any, np: Any) -> list[int]:
    """The worker ranks of a part, in order of their first row."""
    r = rank[worker]
    u, first = np.unique(r, return_index=True)
    return u[np.argsort(first, kind="stable")].tolist()


def _scan_parts(store: Store, res: dict[int, Any], scan: Scan) -> None:
    for rank, spans in _step_runs(store.parts, res, marks=True, scan=scan):
        scan.note(rank, spans)


def _step_runs(
    parts: list[Path], res: dict[int, Any], *, marks: bool, scan: Scan | None = None
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """The worker spans of ``parts`` that can be a step (or, with ``marks``, a mark) as span
    dicts, in runs of one rank; ``scan``: every worker
    rank a part holds gets its (empty) steps first, in order of its first row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    cols = ["name", "start_ns", "end_ns", "resource_id", "attributes"]
    for part in parts:
        t = pq.read_table(part, columns=cols)
        if not t.num_rows:
            continue
        rank, worker = _worker_rows(t, res, np)
        if scan is not None:
            for r in _ranks_in_order(rank, worker, np):
                if r not in scan.steps:
                    scan.steps[r] = RankSteps()
        attrs = t.column("attributes")
        maybe = pc.is_in(t.column("name"), value_set=pa.array(_STEP_NAMES))
        if marks:
            marked = pc.match_substring_regex(attrs, _MARK_PATTERN)  # one pass: 5x four substrings
            maybe = pc.or_(maybe, pc.fill_null(marked, False))
        keep = np.nonzero(maybe.to_numpy(zero_copy_only=False) & worker)[0]
        if not len(keep):
            continue
        sub = t.take(pa.array(keep)).to_pydict()
        ranks = rank[keep].tolist()
        i = 0
        while i < len(keep):
            j = i
            while j < len(keep) and ranks[j] == ranks[i]:
                j += 1
            spans = []
            for k in range(i, j):
                s: dict[str, Any] = {
                    "name": sub["name"][k],
                    "startTimeUnixNano": sub["start_ns"][k],
                    "endTimeUnixNano": sub["end_ns"][k],
                }
                if (a := sub["attributes"][k]) is not None:
                    s["attributes"] = loads(a)
                spans.append(s)
            yield ranks[i], spans
            i = j


def collect_window(store: Store, segs: list[tuple[int, int]]) -> dict[int, list[WSpan]]:
    """Pass 2: each worker rank's spans that overlap the window's segments, in read order.
    Raises ``TraceInputError`` past :data:`MAX_TIMELINE_SPANS` (a module global read at call
    time: the tests lower it)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    res = StoreReader(store).resources()
    out: dict[int, list[WSpan]] = {}
    kept, limit = 0, MAX_TIMELINE_SPANS
    for part in store.parts:
        t = pq.read_table(part, columns=["start_ns", "end_ns", "resource_id"])
        if not t.num_rows:
            continue
        rank, worker = _worker_rows(t, res, np)
        for r in _ranks_in_order(rank, worker, np):
            out.setdefault(r, [])
        st = t.column("start_ns").to_numpy()
        en = t.column("end_ns").to_numpy()
        hit = np.zeros(len(st), bool)
        for lo, hi in segs:  # in_window: overlap, or a zero-length span inside
            hit |= np.where(st == en, (lo <= st) & (st <= hi), (st < hi) & (en > lo))
        keep = np.nonzero(hit & worker)[0]
        if not len(keep):
            continue
        if kept + len(keep) > limit:
            raise TraceInputError(
                f"the timeline window holds more than {limit:,} spans",
                fix="choose fewer iterations with --iterations A:B",
            )
        kept += len(keep)
        cols = ["trace_id", "span_id", "parent_id", "name", "attributes", "links", "status"]
        sub = pq.read_table(part, columns=cols).take(pa.array(keep)).to_pydict()
        ranks = rank[keep].tolist()
        for k in range(len(keep)):
            lk = sub["links"][k]
            links = [(x.get("traceId", ""), x.get("spanId", "")) for x in loads(lk)] if lk else []
            a = sub["attributes"][k]
            out[ranks[k]].append(
                WSpan(int(st[keep[k]]), int(en[keep[k]]), sub["name"][k],
                      (sub["trace_id"][k] or "", sub["span_id"][k] or ""),
                      sub["parent_id"][k] or "", attributes(loads(a)) if a else {}, links,
                      sub["status"][k] == 2)
            )  # fmt: skip
    return out
