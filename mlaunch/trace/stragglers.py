"""``mlaunch trace stragglers``: who makes everyone wait, from the waits each rank causes.

Synchronous collectives make every rank's step time equal, so step times (the summary's skew
check) cannot name a slow rank. The spans can: at every synchronising point the ranks that
arrived first wait, the one that arrived last does not, and the wait is charged to it.

Synchronising points and how a wait is measured:

* **Collectives** (``megatron.grad_sync.finish``: the data-parallel gradient all-reduce),
  grouped by (restart, iteration, pipeline stage): the all-reduce completes for everyone when the
  last rank joins, so each rank's wait span lasts its own wait plus the transfer. The shortest one
  is the last arrival's; every other rank waited its span minus that one. Durations only: no
  clock is compared across ranks, so clock offsets between nodes do not matter.
* **Pipeline P2P pairs**: a receiver's ``megatron.p2p.recv_forward`` joined to the sender's
  ``megatron.p2p.send_forward`` by the link of ``megatron.pp.recv_forward.linked`` (by order when
  a trace has no links), and ``recv_backward`` to the next stage's ``send_backward`` by order
  within the iteration. The receiver waited from the start of its receive until the sender
  started sending (at most its receive's length), charged to the sender as far as the wait is
  longer than the receiver's shortest at that exchange in any iteration (the pipeline's fill
  and drain bubbles are the schedule's) and the sender was later into its step than its
  earliest there.
  This compares start times across ranks: on different nodes their clocks must agree
  (NTP/PTP); the error is their offset.

The phase a charge goes to is where the late rank lost its time: its time per phase since its
previous collective ended (else since its step began) until its arrival, against the same
window of its peers (the other members of the collective; for P2P, its data-parallel replicas
at the same exchange), and the phase with the largest excess wins. Phases come from the
deepest span covering each instant (:data:`PHASE_OF`): with the microbatch group off, forward
and backward are one phase, ``forward_backward``. When that phase is ``communication`` (the late rank was
itself waiting on a pipeline neighbour), the charge passes on to whoever those waits were
charged to, so a stage that is late only because its upstream stage was slow does not take the
blame.

Where it runs: ``mlaunch trace stragglers`` reads the span store a window of iterations at a
time (:func:`stragglers_store`: memory bounded by the window, whatever the trace's size); the live
view's tails (``status --watch``: :class:`StragglerAggregator`) keep their few spans in memory and
run :func:`analyse` on them. Both run the same rules; a window hands each rank only its part of
the trace (:attr:`_Rank.loaded`, :attr:`_Rank.complete`), and whatever the rules look up outside
it raises :class:`~mlaunch.trace.store_steps.Widen` rather than answer differently (the windowed
answer equals the rules' on the whole trace at once, which tests/trace/test_trace_stragglers.py
checks).

What the analysis needs of the whole trace is read first, by DuckDB: each rank's resource, steps
and collective ends, which ranks' receives carry links, and which linked sends are in no rank's
spans. The steps and ends are sorted a rank at a time (:mod:`mlaunch.trace.store_steps`) into a
blob (in memory for a small trace; past :data:`STEPS_IN_MEMORY` steps, files in the store's
scratch directory, removed at the end), and what stays in memory is only the first key of every
:data:`~mlaunch.trace.store_steps.BLOCK`-th row (and the block's largest step end) and each
iteration's earliest and latest start across the ranks: a window reads back by offset the run of
each rank's steps and ends it needs. The rest is read a window at a time: the iterations are cut
into windows of about :data:`WINDOW_SPANS` phase spans, and for each rank a window holds every
span that overlaps the time from the end of its collective before the window's first step to the
start of its step after the last (Arrow filters the rank's parts on the part's time range, then
on each row's), plus a halo of iterations either side. The synchronising points of the window's
own iterations (and the receives in the time they own) are charged there, with the same
functions as the whole trace; whatever they look up that the window does not hold whole (a time
before its start, an iteration of the halo's edge, a linked send elsewhere, a step or collective
end past the runs it read) raises :class:`~mlaunch.trace.store_steps.Widen`, and the window is
done again with a halo four times wider (the last resort, the whole trace: the answer never
depends on the window).

Two passes: the P2P floors (a receiver's shortest wait at each exchange in any iteration, the
sender's earliest start into its step there) are global, so a first pass over the windows
reads only the P2P spans for them; the second charges the waits.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from orjson import loads

from mlaunch.model.spans import ALIASES, Attr, ResourceAttr, SpanName
from mlaunch.otlp.otlp_json import attributes
from mlaunch.trace.goodput import _names
from mlaunch.trace.links import LinkTargets
from mlaunch.trace.reader import Resource, TraceInputError, no_spans_error
from mlaunch.trace.store import Store, StoreReader, _sql_in
from mlaunch.trace.store_steps import (
    IterationStarts,
    SortedEnds,
    SortedSteps,
    Spill,
    Spool,
    Widen,
    WindowEnds,
    WindowSteps,
)

S = SpanName

#: The phases a wait is charged to, in display order.
PHASES: tuple[str, ...] = (
    "forward", "backward", "data_loading", "optimizer", "checkpoint", "evaluation",
    "forward_backward", "communication", "other",
)  # fmt: skip

#: Span name -> (phase, depth): where several spans cover an instant, the deepest phase owns it
#: (a P2P wait inside forward-backward is communication, not forward-backward). ``other`` is the
#: step's time outside every phase span, and any time outside the step.
PHASE_OF: dict[str, tuple[str, int]] = {
    S.MICROBATCH_FORWARD: ("forward", 3),
    S.LAYER_FORWARD: ("forward", 3),
    S.LAYER_SELF_ATTENTION: ("forward", 3),
    S.LAYER_MLP: ("forward", 3),
    S.MICROBATCH_BACKWARD: ("backward", 3),
    S.P2P_RECV_FORWARD: ("communication", 4),
    S.P2P_SEND_FORWARD: ("communication", 4),
    S.P2P_RECV_BACKWARD: ("communication", 4),
    S.P2P_SEND_BACKWARD: ("communication", 4),
    S.PP_RECV_FORWARD_LINKED: ("communication", 4),
    S.GRAD_SYNC_START: ("communication", 4),
    S.GRAD_SYNC_FINISH: ("communication", 4),
    S.GET_BATCH: ("data_loading", 2),
    S.DATALOADER: ("data_loading", 2),
    S.OPTIMIZER: ("optimizer", 2),
    S.CHECKPOINT_SAVE: ("checkpoint", 2),
    S.CHECKPOINT_SAVE_STATE_DICT: ("checkpoint", 2),
    S.CHECKPOINT_SAVE_IO_WRITE: ("checkpoint", 2),
    S.CHECKPOINT_LOAD: ("checkpoint", 2),
    S.CHECKPOINT_LOAD_IO_READ: ("checkpoint", 2),
    S.EVALUATE: ("evaluation", 2),
    S.EVALUATE_STEP: ("evaluation", 2),
    S.FORWARD_BACKWARD: ("forward_backward", 1),
    S.ITERATION: ("other", 0),
}  # fmt: skip

#: What the share of a row's wait its listed iterations cover (the rest: scattered noise).
ITERATIONS_COVER = 0.9
_NS = 1e9


@dataclass(frozen=True, slots=True)
class Culprit:
    """One row: the waits ``rank`` caused others by being late in ``phase``."""

    rank: int
    phase: str
    caused_wait_s: float
    iterations: list[int]
    """The iterations that make up most of it (:data:`ITERATIONS_COVER`), ascending."""
    waits: int
    """How many waits of other ranks it caused."""
    host: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "caused_wait_s": round(self.caused_wait_s, 6),
            "phase": self.phase, "iterations": self.iterations, "waits": self.waits,
            "host": self.host,
        }  # fmt: skip


@dataclass
class Stragglers:
    """Everything ``mlaunch trace stragglers`` prints."""

    ranks: list[Culprit]
    ranks_seen: list[int]
    world_size: int | None
    sync_points: dict[str, int]
    total_wait_s: float
    missing_ranks: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` output: ``ranks`` sorted by ``caused_wait_s``, most first."""
        return {
            "ranks": [c.to_json() for c in self.ranks],
            "ranks_seen": self.ranks_seen,
            "missing_ranks": self.missing_ranks,
            "world_size": self.world_size,
            "sync_points": self.sync_points,
            "total_wait_s": round(self.total_wait_s, 6),
        }


@dataclass(slots=True)
class _Span:
    name: str
    start: int
    end: int
    span_id: str | None
    links: tuple[str, ...] = ()


@dataclass
class _Rank:
    rank: int
    attrs: dict[str, Any]
    spans: list[_Span] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    # Filled by _index():
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, iteration)
    seg_start: list[int] = field(default_factory=list)
    seg_end: list[int] = field(default_factory=list)
    seg_phase: list[str] = field(default_factory=list)
    collective_ends: list[int] = field(default_factory=list)
    recv_starts: list[int] = field(default_factory=list)  # the P2P receives, by start
    recvs: list[_Span] = field(default_factory=list)
    _by_it: dict[str, dict[int, list[_Span]]] = field(default_factory=dict)
    # What a window of the trace holds (stragglers_store); None: the whole trace.
    linked: bool | None = None
    """Whether any receive of the rank, anywhere in the trace, carries a link (None: any here)."""
    loaded: list[tuple[int, int]] | None = None
    """Time intervals (ascending) whose every span of the rank is here."""
    complete: frozenset[int] | None = None
    """Iterations whose every span of the rank is here."""
    paint: list[tuple[int, int, int]] | None = None
    """The steps that overlap what is here (None: ``steps``, then every step of the rank)."""

    def interval_at(self, t: int) -> tuple[int, int]:
        """The loaded interval holding ``t``; :class:`Widen` when none does."""
        for lo, hi in ((FIRST, LAST),) if self.loaded is None else self.loaded:
            if lo <= t <= hi:
                return lo, hi
        raise Widen

    def is_complete(self, it: int | None) -> bool:
        return self.complete is None or it is None or it in self.complete

    def in_iteration(self, name: str, it: int) -> list[_Span]:
        """The spans called ``name`` of iteration ``it``, in order; :class:`Widen` when the
        window does not hold all of that iteration."""
        if not self.is_complete(it):
            raise Widen
        return self.by_iteration(name).get(it, [])

    def attr_int(self, key: str) -> int | None:
        v = self.attrs.get(key)
        try:
            return None if v is None else int(v)
        except (TypeError, ValueError):
            return None

    @property
    def restart(self) -> int:
        return self.attr_int(ResourceAttr.RESTART_COUNT) or 0

    def _step_before(self, t: int) -> int:
        """The index of the last step that sorts at or before (``t``, 2^62, 0)."""
        find = getattr(self.steps, "bisect", None)  # the store's column-wise steps: no tuples
        return (find(t) if find is not None else bisect_right(self.steps, (t, 1 << 62, 0))) - 1

    def iteration_at(self, t: int) -> int | None:
        i = self._step_before(t)
        if i >= 0 and self.steps[i][0] <= t <= self.steps[i][1]:
            return self.steps[i][2]
        return None

    def step_start(self, t: int) -> int | None:
        i = self._step_before(t)
        return self.steps[i][0] if i >= 0 and self.steps[i][1] >= t else None

    def collective_before(self, t: int) -> int | None:
        """The end of the rank's last collective at or before ``t`` (None: none)."""
        ends = self.collective_ends
        find = getattr(ends, "before", None)  # a window's run of the store's ends: Widen past it
        if find is not None:
            return find(t)
        i = bisect_right(ends, t) - 1
        return ends[i] if i >= 0 else None

    def phase_times(self, a: int, b: int) -> dict[str, int]:
        """Nanoseconds of each phase within [a, b] (time no span covers is ``other``)."""
        out: dict[str, int] = defaultdict(int)
        if b <= a:
            return out
        if self.loaded is not None and self.interval_at(a)[1] < b:
            raise Widen
        i = bisect_right(self.seg_end, a)
        covered = 0
        while i < len(self.seg_start) and self.seg_start[i] < b:
            d = min(b, self.seg_end[i]) - max(a, self.seg_start[i])
            if d > 0:
                out[self.seg_phase[i]] += d
                covered += d
            i += 1
        out["other"] += (b - a) - covered
        return out

    def by_iteration(self, name: str) -> dict[int, list[_Span]]:
        """This rank's spans called ``name``, by the iteration whose step holds their start."""
        out = self._by_it.get(name)
        if out is None:
            out = self._by_it[name] = defaultdict(list)
            for s in self.spans:
                if s.name == name and (it := self.iteration_at(s.start)) is not None:
                    out[it].append(s)
        return out


#: The stored names the analysis reads: its own and older traces' names for them (an older
#: name of a span it does not read, such as ``megatron.model_init``, is left out).
KEEP = frozenset(n for n in {*PHASE_OF, *ALIASES} if ALIASES.get(n, n) in PHASE_OF)
#: Receives: where a rank waits on a pipeline neighbour.
_RECVS = frozenset({S.P2P_RECV_FORWARD, S.P2P_RECV_BACKWARD})


#: The first and last instants (the bounds of a window that holds all time before or after).
FIRST, LAST = -(1 << 63), (1 << 63) - 1


class StragglerAggregator:
    """Collects the spans the analysis needs, per rank (never the whole span dicts)."""

    def __init__(self) -> None:
        self.ranks: dict[int, _Rank] = {}

    def add(self, res: Resource, spans: list[dict[str, Any]], _flagged: bool) -> None:
        if res.launcher:
            return
        r = self.ranks.get(res.rank)
        if r is None:
            r = self.ranks[res.rank] = _Rank(res.rank, res.attrs)
        keep, canon = KEEP, ALIASES
        for s in spans:
            name = s["name"]
            if name not in keep:
                continue
            name = canon.get(name, name)
            sid = s.get("spanId")
            if sid:
                if sid in r.ids:  # a recorder dump may repeat what the exporter wrote
                    continue
                r.ids.add(sid)
            links: tuple[str, ...] = ()
            if name == S.PP_RECV_FORWARD_LINKED:
                links = tuple(lk.get("spanId") for lk in s.get("links") or () if lk.get("spanId"))
            start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
            if name == S.ITERATION:
                it = attributes(s.get("attributes")).get(Attr.ITERATION)
                if it is not None:
                    r.steps.append((start, end, int(it)))
                continue
            r.spans.append(_Span(name, start, end, sid, links))

    def finish(self) -> Stragglers:
        return analyse(self.ranks)


def _index(r: _Rank) -> None:
    """Sort the rank's spans and paint its timeline: each instant belongs to the deepest phase
    span covering it."""
    if r.paint is None:  # a window's come sorted
        r.steps.sort()
        r.spans.sort(key=lambda s: (s.start, -s.end))
    events: list[tuple[int, int, str, int]] = []
    for st, en, _ in r.steps if r.paint is None else r.paint:
        if en > st:
            events += [(st, 1, "other", 0), (en, -1, "other", 0)]
    for s in r.spans:
        if s.end > s.start:  # an instant span covers no time
            phase, depth = PHASE_OF[s.name]
            events += [(s.start, 1, phase, depth), (s.end, -1, phase, depth)]
    # By time: the order of the events at one instant is immaterial, for all of them are
    # applied before the next segment is painted (plain tuple order: no key to call).
    events.sort()
    open_: dict[tuple[int, str], int] = defaultdict(int)
    prev_t: int | None = None
    for t, delta, phase, depth in events:
        if prev_t is not None and t > prev_t and open_:
            top = max(open_)[1]
            if r.seg_phase and r.seg_phase[-1] == top and r.seg_end[-1] == prev_t:
                r.seg_end[-1] = t
            else:
                r.seg_start.append(prev_t)
                r.seg_end.append(t)
                r.seg_phase.append(top)
        key = (depth, phase)
        open_[key] += delta
        if open_[key] <= 0:
            del open_[key]
        prev_t = t
    if r.paint is None:  # a window's come with it, from the whole trace
        r.collective_ends = sorted(s.end for s in r.spans if s.name == S.GRAD_SYNC_FINISH)
    r.recvs = [s for s in r.spans if s.name in _RECVS]
    r.recv_starts = [s.start for s in r.recvs]
    if r.linked is None:
        r.linked = any(s.name == S.PP_RECV_FORWARD_LINKED and s.links for s in r.spans)


@dataclass
class _Charge:
    culprit: int
    phase: str
    iteration: int | None
    wait_ns: int
    waits: int = 1  # how many ranks' waits it stands for


@dataclass
class _P2PWait:
    """A receive that waited for a late sender (:func:`p2p_waits` says how much counts)."""

    waiter: int
    start: int
    end: int
    sender: _Rank
    send: _Span
    excess: int
    iteration: int | None


def _excess_phase(
    late: _Rank, window: tuple[int, int], peers: list[tuple[_Rank, tuple[int, int]]]
) -> str:
    """The phase in which ``late`` spent the most time in ``window`` beyond what its peers spent
    in theirs (its largest phase when it has no peers)."""
    mine = late.phase_times(*window)
    if peers:
        theirs = [p.phase_times(*w) for p, w in peers]
        excess = {ph: mine.get(ph, 0) - median(t.get(ph, 0) for t in theirs) for ph in PHASES}
    else:
        excess = {ph: mine.get(ph, 0) for ph in PHASES}
    return max(PHASES, key=lambda ph: (excess[ph], -PHASES.index(ph)))


def _window(r: _Rank, arrival: int) -> tuple[int, int]:
    """Where a rank's time before ``arrival`` is looked at: since its previous collective ended
    (so the time between steps, checkpoint, evaluation and the next batch, counts too), else
    since the start of its step."""
    a = r.collective_before(arrival)
    if a is None:
        a = r.step_start(arrival)
    return (arrival if a is None else min(a, arrival), arrival)


def _stage(r: _Rank) -> tuple[int | None, int | None]:
    """The rank's (pipeline stage, data-parallel rank); the latter is 0 without data
    parallelism, None when the resource does not say (its pipeline neighbours are then known
    only through links)."""
    dp = r.attr_int(ResourceAttr.DP_RANK)
    if dp is None and (r.attr_int(ResourceAttr.DP_SIZE) or 1) == 1:
        dp = 0
    return r.attr_int(ResourceAttr.PP_RANK), dp


def _index_of(r: _Rank, span: _Span) -> tuple[int | None, int | None]:
    """The span's iteration and its index among the spans of its name in that iteration."""
    it = r.iteration_at(span.start)
    if it is None:
        return None, None
    same = r.in_iteration(span.name, it)
    return it, next((i for i, x in enumerate(same) if x is span), None)


@dataclass(slots=True)
class P2PPair:
    """A receive joined to its send, before the floors say how much of its wait counts."""

    recv: _Rank
    rs: _Span
    sender: _Rank
    ss: _Span
    slot: tuple[Any, ...]
    """(receiver, restart, name, index in its iteration): where its floor is kept."""
    wait: int
    sslot: tuple[Any, ...]
    """The sender's (rank, restart, name, index in its iteration)."""
    into: int
    """How far into its step the sender was when it started sending."""
    iteration: int | None


def p2p_pairs(ranks: dict[int, _Rank], missing: frozenset[str] = frozenset()) -> list[P2PPair]:
    """Every P2P receive joined to its send. In a window, ``missing``: the linked sends that
    are in no window (any other the window lacks is :class:`Widen`); receives of iterations the
    window does not hold whole are left out (:func:`check_paired` guards their use)."""
    at: dict[tuple[int | None, int | None, int], _Rank] = {}
    for r in ranks.values():
        pp, dp = _stage(r)
        if pp is not None and dp is not None:
            at[(pp, dp, r.restart)] = r
    # By rank (and incarnation) and id: ranks can share ids (nemo-lens 0.1.0 seeded alike), see
    # LinkTargets.
    send_ids: LinkTargets[tuple[_Rank, _Span]] = LinkTargets()
    for r in ranks.values():
        for s in r.spans:
            if s.name == S.P2P_SEND_FORWARD and s.span_id:
                send_ids.add((r.rank, r.restart), s.span_id, (r, s))

    def pairs(recv: _Rank) -> Iterable[tuple[_Span, _Rank, _Span]]:
        pp, dp = _stage(recv)
        prev = at.get((pp - 1, dp, recv.restart)) if pp is not None and dp is not None else None
        if recv.linked:  # the link names the sender's span: no guessing which send it was
            linked = [s for s in recv.spans if s.name == S.PP_RECV_FORWARD_LINKED and s.links]
            recvs = [s for s in recv.spans if s.name == S.P2P_RECV_FORWARD]
            starts = [s.start for s in recvs]
            for lk in linked:
                i = bisect_right(starts, lk.start) - 1
                if recv.loaded is not None:
                    lo = recv.interval_at(lk.start)[0]
                    if (i < 0 or starts[i] < lo) and lo > FIRST:
                        raise Widen  # its receive may be one the window lacks
                    if i >= 0 and not _held(recv, recvs[i]):
                        continue
                # The sender is the previous stage's rank of this replica: its span of that id
                # first, as the link's own rank's would be for a block link.
                sender = send_ids.resolve(
                    (prev.rank, prev.restart) if prev else (recv.rank, recv.restart), lk.links[0]
                )
                if sender is None and recv.loaded is not None and lk.links[0] not in missing:
                    raise Widen  # the send is in the trace, outside this window
                if sender is not None and i >= 0:
                    yield recvs[i], sender[0], sender[1]
        elif prev is not None:
            yield from _ordered(recv, prev, S.P2P_RECV_FORWARD, S.P2P_SEND_FORWARD)
        if pp is not None and dp is not None and (nxt := at.get((pp + 1, dp, recv.restart))):
            yield from _ordered(recv, nxt, S.P2P_RECV_BACKWARD, S.P2P_SEND_BACKWARD)

    found = []
    for recv in ranks.values():
        for rs, sender, ss in pairs(recv):
            it, k = _index_of(recv, rs)
            _, ks = _index_of(sender, ss)
            found.append(P2PPair(
                recv, rs, sender, ss, (recv.rank, recv.restart, rs.name, k),
                max(0, min(ss.start, rs.end) - rs.start), (sender.rank, sender.restart, ss.name, ks),
                ss.start - (sender.step_start(ss.start) or ss.start), it,
            ))  # fmt: skip
    return found


def _held(r: _Rank, rs: _Span) -> bool:
    """Whether the window holds all of the receive's iteration (always, for the whole trace)."""
    return r.is_complete(r.iteration_at(rs.start))


def check_paired(r: _Rank, rs: _Span) -> None:
    """:class:`Widen` unless the window decides the receive's pairing as the whole trace does:
    its iteration is whole here, and (a linked receive) every link that can name it is here."""
    if r.loaded is None:
        return
    it = r.iteration_at(rs.start)
    if it is None and rs.name == S.P2P_RECV_FORWARD and not r.linked:
        return  # paired by order within an iteration: this one never is
    if it is None and rs.name == S.P2P_RECV_BACKWARD:
        return
    if not r.is_complete(it):
        raise Widen
    if rs.name == S.P2P_RECV_FORWARD and r.linked:
        # A link names it when it is the last receive before the link: every link up to the
        # next receive's start must be here.
        lo, hi = r.interval_at(rs.start)
        i = bisect_right(r.recv_starts, rs.start)
        nxt = next((s for s in r.recvs[i:] if s.name == rs.name), None)
        if hi < LAST and (nxt is None or nxt.start > hi):
            raise Widen


def fold_floors(found: Iterable[P2PPair], floor: dict[tuple[Any, ...], int]) -> None:
    """The floors of :func:`p2p_waits`: a receiver's shortest wait at each exchange, in any
    iteration, and the sender's earliest start into its step there."""
    for p in found:
        floor[p.slot] = min(p.wait, floor.get(p.slot, p.wait))
        floor[p.sslot] = min(p.into, floor.get(p.sslot, p.into))


def p2p_waits(found: Iterable[P2PPair], floor: dict[tuple[Any, ...], int]) -> list[_P2PWait]:
    """Every P2P receive that waited for its sender longer than its shortest wait there."""
    # A receive's wait counts only as far as it is (a) longer than the shortest wait that
    # receiver had at the same exchange in any iteration (the pipeline's fill and drain bubbles
    # are the schedule's, not a straggler's) and (b) due to the sender being later into its
    # step than it ever was at that exchange (a receiver that waited less because it was late
    # itself makes no one else look slow).
    out: list[_P2PWait] = []
    for p in found:
        excess = min(p.wait - floor[p.slot], p.into - floor[p.sslot])
        if excess > 0:
            out.append(_P2PWait(p.recv.rank, p.rs.start, p.rs.end, p.sender, p.ss, excess,
                                p.iteration))  # fmt: skip
    return out


def _ordered(
    recv: _Rank, peer: _Rank, recv_name: str, send_name: str
) -> Iterable[tuple[_Span, _Rank, _Span]]:
    """The k-th receive of an iteration with the peer's k-th send of the same iteration."""
    mine = recv.by_iteration(recv_name)
    for it, rs in mine.items():
        if recv.is_complete(it):
            for a, b in zip(rs, peer.in_iteration(send_name, it), strict=False):
                yield a, peer, b


def _p2p_peers(
    ranks: dict[int, _Rank], sender: _Rank, send: _Span
) -> list[tuple[_Rank, tuple[int, int]]]:
    """The sender's data-parallel replicas at the same exchange (same iteration, same index)."""
    pp, _ = _stage(sender)
    it, k = _index_of(sender, send)
    if pp is None or it is None or k is None:
        return []
    out = []
    for r in ranks.values():
        if r is sender or _stage(r)[0] != pp or r.restart != sender.restart:
            continue
        theirs = r.in_iteration(send.name, it)
        if k < len(theirs):
            out.append((r, _window(r, theirs[k].start)))
    return out


#: How far a charge is passed along a chain of ranks each late because it waited on the next.
_MAX_HOPS = 8


class _Blame:
    """Turns a wait into charges: the late rank's phase, or, when it was late because it was
    itself waiting on a pipeline neighbour, whoever made it wait."""

    def __init__(self, ranks: dict[int, _Rank], p2p: list[_P2PWait]) -> None:
        self.ranks = ranks
        self.waits_of: dict[int, list[_P2PWait]] = defaultdict(list)
        for w in p2p:
            self.waits_of[w.waiter].append(w)

    def charge(
        self,
        late: _Rank,
        window: tuple[int, int],
        peers: list[tuple[_Rank, tuple[int, int]]],
        amount: int,
        iteration: int | None,
        waits: int,
        hops: int = 0,
    ) -> list[_Charge]:
        phase = _excess_phase(late, window, peers)
        if phase == "communication" and hops < _MAX_HOPS:
            a, b = window
            if late.loaded is not None:  # the window must hold every receive in it
                for rs in late.recvs[bisect_right(late.recv_starts, a - 1) :]:
                    if rs.start > b:
                        break
                    if rs.end <= b:
                        check_paired(late, rs)
            up = [w for w in self.waits_of.get(late.rank, ()) if a <= w.start and w.end <= b]
            owed = sum(w.excess for w in up)
            if owed > 0:
                out: list[_Charge] = []
                for k, w in enumerate(up):
                    out += self.charge(
                        w.sender, _window(w.sender, w.send.start),
                        _p2p_peers(self.ranks, w.sender, w.send),
                        round(amount * w.excess / owed), iteration, waits if k == 0 else 0,
                        hops + 1,
                    )  # fmt: skip
                return out
        return [_Charge(late.rank, phase, iteration, amount, waits)]


class Tally:
    """The charges so far, summed per (rank, phase) and iteration: what the rows are made of."""

    def __init__(self) -> None:
        self.totals: dict[tuple[int, str], int] = defaultdict(int)
        self.per_it: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.waits: dict[tuple[int, str], int] = defaultdict(int)
        self.points = {"collectives": 0, "p2p_waits": 0}

    def add(self, charges: Iterable[_Charge]) -> None:
        for c in charges:
            if c.wait_ns <= 0:
                continue
            key = (c.culprit, c.phase)
            self.totals[key] += c.wait_ns
            self.waits[key] += c.waits
            if c.iteration is not None:
                self.per_it[key][c.iteration] += c.wait_ns

    def merge(self, other: Tally) -> None:
        for key, ns in other.totals.items():
            self.totals[key] += ns
            self.waits[key] += other.waits[key]
        for key, its in other.per_it.items():
            mine = self.per_it[key]
            for it, ns in its.items():
                mine[it] += ns
        for k, n in other.points.items():
            self.points[k] += n


def charge_waits(
    ranks: dict[int, _Rank],
    p2p: list[_P2PWait],
    owns: Any = None,
) -> Tally:
    """Charge every wait at every synchronising point to the rank that arrived last. ``owns``
    (a window's): which P2P waits and which iterations' collectives are this window's to charge
    (the rest of ``p2p`` are there for the blame of those); None: all."""
    blame = _Blame(ranks, p2p)
    tally = Tally()
    mine = p2p if owns is None else [w for w in p2p if owns.p2p(w)]
    for w in mine:
        tally.add(blame.charge(
            w.sender, _window(w.sender, w.send.start), _p2p_peers(ranks, w.sender, w.send),
            w.excess, w.iteration, 1,
        ))  # fmt: skip
    tally.points["p2p_waits"] = len(mine)

    groups: dict[tuple[int, int, int | None], list[tuple[_Rank, _Span]]] = defaultdict(list)
    for r in ranks.values():
        for it, spans in r.by_iteration(S.GRAD_SYNC_FINISH).items():
            if owns is None or owns.iteration(it):
                groups[(r.restart, it, _stage(r)[0])].append((r, spans[-1]))
    for (_, it, _), members in sorted(groups.items(), key=lambda kv: kv[0]):
        if len(members) < 2:
            continue
        tally.points["collectives"] += 1
        # The all-reduce completes for everyone when the last rank joins: the shortest wait is
        # the last arrival's (its own transfer only), every other rank waited the difference.
        last, last_span = min(members, key=lambda m: (m[1].end - m[1].start, m[0].rank))
        shortest = last_span.end - last_span.start
        total = sum((s.end - s.start) - shortest for _, s in members)
        if total <= 0:
            continue
        peers = [(r, _window(r, s.start)) for r, s in members if r is not last]
        n_waits = sum(1 for r, s in members if r is not last and s.end - s.start > shortest)
        tally.add(blame.charge(last, _window(last, last_span.start), peers, total, it, n_waits))
    return tally


def analyse(ranks: dict[int, _Rank]) -> Stragglers:
    """Charge every wait at every synchronising point to the rank that arrived last, the whole
    trace in memory (:func:`stragglers_store` runs the same rules a window at a time)."""
    for r in ranks.values():
        _index(r)
    found = p2p_pairs(ranks)
    floor: dict[tuple[Any, ...], int] = {}
    fold_floors(found, floor)
    tally = charge_waits(ranks, p2p_waits(found, floor))
    return rows(ranks, tally)


def rows(ranks: dict[int, _Rank], tally: Tally) -> Stragglers:
    """The table: one row per (rank, phase) charged, most first."""
    out = []
    for key, tot in tally.totals.items():
        rank, phase = key
        its = sorted(tally.per_it[key].items(), key=lambda kv: (-kv[1], kv[0]))
        chosen, acc = [], 0
        for it, ns in its:
            if acc >= ITERATIONS_COVER * tot:
                break
            chosen.append(it)
            acc += ns
        host = ranks[rank].attrs.get(ResourceAttr.HOST_NAME) if rank in ranks else None
        out.append(
            Culprit(rank, phase, tot / _NS, sorted(chosen), tally.waits[key],
                    None if host is None else str(host))
        )  # fmt: skip
    out.sort(key=lambda c: (-c.caused_wait_s, c.rank, PHASES.index(c.phase)))
    world = next(
        (w for r in ranks.values() if (w := r.attr_int(ResourceAttr.WORLD_SIZE)) is not None), None
    )
    seen = sorted(ranks)
    missing = sorted(set(range(world)) - set(seen)) if world else []
    return Stragglers(out, seen, world, dict(tally.points), sum(tally.totals.values()) / _NS,
                      missing)  # fmt: skip


def single_rank_error(rank: int, world: int | None) -> TraceInputError:
    """The error for a trace in which one rank exported: nobody to compare it with."""
    of = f" of {world}" if world else ""
    return TraceInputError(
        f"only rank {rank}{of} exported spans: straggler attribution needs the spans of every "
        "rank that synchronises (the default export strategy, single_rank, exports one)",
        fix="rerun with --otel-export-strategy all_ranks; or, while a job runs, dump every "
        "rank's flight recorder with `mlaunch trace capture RUN_DIR --recorded` (workers keep "
        "their last iterations when --otel-recorder-groups is set)",
    )


def no_sync_error() -> TraceInputError:
    """The error for a trace without synchronising spans (the communication group was off)."""
    return TraceInputError(
        "no synchronising spans (megatron.grad_sync.finish, megatron.p2p.*) in the trace: "
        "they belong to the communication group",
        fix="rerun with --otel-span-groups per_step,microbatch (per_step includes "
        "communication; microbatch splits forward from backward)",
    )


#: The spans that make a synchronising point.
SYNC_NAMES = frozenset({S.GRAD_SYNC_FINISH, S.P2P_RECV_FORWARD, S.P2P_RECV_BACKWARD})


def check_input(reader: Any, ranks: list[int], world: int | None, synced: bool) -> None:
    """Raise ``TraceInputError`` for a trace without spans (no ``ranks``), with one exporting
    rank, or without synchronising spans (not ``synced``)."""
    if not ranks:
        raise no_spans_error(reader)
    if len(ranks) == 1 and (world is None or world > 1):
        raise single_rank_error(ranks[0], world)
    if world != 1 and not synced:
        raise no_sync_error()


#: Phase spans (all ranks together) a window holds, about: with their painted timelines, some
#: 100 MB of Python objects.
WINDOW_SPANS = 200_000
#: Rows of filtered parts kept between windows (a part is read once while the windows cross
#: it, not once per window).
CACHE_ROWS = 1_000_000
#: Steps (all ranks together) past which each rank's steps and collective ends are kept in
#: files of the store's scratch directory and read back a window's run at a time: in memory
#: they cost 32 bytes a step, 2.5 GB at 1,024 ranks x 10^5 iterations. Up to it, in memory.
STEPS_IN_MEMORY = 250_000
_STEP_NAMES = _names({S.ITERATION})
_FINISH_NAMES = _names({S.GRAD_SYNC_FINISH})
#: What the first pass reads: the receives, sends and links of the pipeline.
_P2P = frozenset({S.P2P_RECV_FORWARD, S.P2P_SEND_FORWARD, S.P2P_RECV_BACKWARD,
                  S.P2P_SEND_BACKWARD, S.PP_RECV_FORWARD_LINKED})  # fmt: skip
#: What a window reads: every span the analysis keeps but the steps (from the first queries).
_SPAN_NAMES = sorted(n for n in KEEP if ALIASES.get(n, n) != S.ITERATION)
_P2P_NAMES = sorted(n for n in _SPAN_NAMES if ALIASES.get(n, n) in _P2P)
_COLUMNS = ["name", "start_ns", "end_ns", "span_id", "links", "resource_id"]


@dataclass
class _RankMeta:
    """What the windows need of one rank's whole trace."""

    attrs: dict[str, Any]
    steps: SortedSteps = field(init=False)  # set once every step is read
    ends: SortedEnds = field(init=False)  # its collectives' ends
    linked: bool = False
    parts: list[tuple[Path, int, int]] = field(default_factory=list)  # (part, min start, max end)


def _window_steps(m: _RankMeta, iv: list[tuple[int, int]],
                  spans: list[_Span]) -> tuple[WindowSteps, WindowEnds]:  # fmt: skip
    """The runs of the rank's steps and collective ends that answer a lookup at any time from
    the first loaded instant (or span start) to the last (or span end): from the step (and the
    end) before the first to the one after the last."""
    steps, ends = m.steps, m.ends
    times = [iv[0][0], iv[-1][1]] if iv else []
    if spans:
        times += [spans[0].start, max(s.end for s in spans)]
    if not times:
        return WindowSteps(steps, 0, 0), WindowEnds(ends, 0, 0)
    a = max(0, steps.bisect(min(times)) - 1)
    c = min(len(steps), steps.bisect(max(times)) + 1)
    e = max(0, ends.upper(min(times)) - 1)
    f = min(len(ends), ends.upper(max(times)) + 1)
    return WindowSteps(steps, a, c), WindowEnds(ends, e, f)


@dataclass
class _Trace:
    ranks: dict[int, _RankMeta]
    iterations: array[int]  # every step's iteration, distinct, ascending
    first_start: Any  # of each of them, the earliest start of its steps on any rank (numpy)
    last_start: Any  # and the latest
    missing: frozenset[str]  # link targets that are no send of any rank
    workers: Any  # numpy array of the worker resources' ids
    spans: int  # phase spans (not steps) of the workers
    p2p: int


def stragglers_store(store: Store) -> Stragglers:
    """The straggler analysis of the store's spans, a window of iterations at a time (memory
    bounded by the window, whatever the trace's size). Raises ``TraceInputError`` for a trace
    without spans, with one exporting rank, or without synchronising spans."""
    with Spill(store.scratch_dir()) as spill:
        return _stragglers(store, spill)


def _stragglers(store: Store, spill: Spill) -> Stragglers:
    trace, world, synced = _read_trace(store, spill)
    check_input(StoreReader(store), list(trace.ranks), world, synced)
    parts = _Parts(store, trace)
    per_window = max(1, WINDOW_SPANS * len(trace.iterations) // max(1, trace.spans))
    its = trace.iterations
    windows = [its[i : i + per_window] for i in range(0, len(its), per_window)] or [[]]
    floor: dict[tuple[Any, ...], int] = {}
    if trace.p2p:
        for w in range(len(windows)):
            _run(trace, parts, windows, w, lambda ranks, own: _floors(ranks, own, trace, floor),
                 _P2P_NAMES)  # fmt: skip
    tally = Tally()
    for w in range(len(windows)):
        tally.merge(_run(trace, parts, windows, w,
                         lambda ranks, own: _charges(ranks, own, trace, floor), _SPAN_NAMES))  # fmt: skip
    rank_objs = {r: _Rank(r, m.attrs) for r, m in trace.ranks.items()}
    return rows(rank_objs, tally)


def _floors(ranks: dict[int, _Rank], own: _Owns, trace: _Trace,
            floor: dict[tuple[Any, ...], int]) -> None:  # fmt: skip
    found = _owned_pairs(ranks, own, trace)
    fold_floors(found, floor)  # after every check passed: a widened window folds once


def _charges(ranks: dict[int, _Rank], own: _Owns, trace: _Trace,
             floor: dict[tuple[Any, ...], int]) -> Tally:  # fmt: skip
    found = p2p_pairs(ranks, trace.missing)
    _check_owned(ranks, own)
    return charge_waits(ranks, p2p_waits(found, floor), own)


def _owned_pairs(ranks: dict[int, _Rank], own: _Owns, trace: _Trace) -> list[P2PPair]:
    found = p2p_pairs(ranks, trace.missing)
    _check_owned(ranks, own)
    return [p for p in found if own.receive(p.recv.rank, p.rs.start, p.iteration)]


def _check_owned(ranks: dict[int, _Rank], own: _Owns) -> None:
    """Every receive this window owns must be paired here as in the whole trace."""
    for r in ranks.values():
        for rs in r.recvs:
            if own.receive(r.rank, rs.start, r.iteration_at(rs.start)):
                check_paired(r, rs)


class _Owns:
    """Which synchronising points a window charges: the collectives of its iterations, the
    receives of its iterations and those between a step of its own and the next step."""

    def __init__(self, trace: _Trace, mine: list[int], first: bool) -> None:
        self.trace, self.mine, self.first = trace, frozenset(mine), first
        self.ranks: dict[int, _Rank] = {}  # the window's ranks as loaded (set by _run)

    def iteration(self, it: int) -> bool:
        return it in self.mine

    def receive(self, rank: int, start: int, it: int | None) -> bool:
        """Whether the receive of ``rank`` at ``start`` (in iteration ``it``) is this window's:
        one outside every step goes with the step before it (the first step, before any)."""
        if it is not None:
            return it in self.mine
        steps = self.ranks[rank].steps  # the window's run: Widen when the step is past it
        if not steps.total:
            return self.first
        j = steps.bisect(start) - 1
        return steps[max(j, 0)][2] in self.mine

    def p2p(self, w: _P2PWait) -> bool:
        return self.receive(w.waiter, w.start, w.iteration)


def _run(trace: _Trace, parts: _Parts, windows: list[list[int]], w: int, work: Any,
         names: list[str]) -> Any:  # fmt: skip
    """``work(ranks, owns)`` on window ``w``, its halo widened until the window holds all it
    looks up."""
    its = trace.iterations
    lo = sum(len(x) for x in windows[:w])
    hi = lo + len(windows[w])
    own = _Owns(trace, windows[w], w == 0)
    halo = 1
    while True:
        whole = lo - halo <= 0 and hi + halo >= len(its)
        held = its[max(0, lo - halo) : hi + halo]
        ranks = own.ranks = _load(trace, parts, frozenset(held), w == 0, names, whole)
        try:
            return work(ranks, own)
        except Widen:
            if whole:
                raise RuntimeError("stragglers: the whole trace raised Widen") from None
            halo *= 4


def _load(trace: _Trace, parts: _Parts, held: frozenset[int], first: bool, names: list[str],
          whole: bool) -> dict[int, _Rank]:  # fmt: skip
    """Each rank's spans of the iterations ``held`` (and the time between them)."""
    out: dict[int, _Rank] = {}
    starts = _held_starts(trace, held)
    for rank, m in trace.ranks.items():
        iv = _intervals(m, held, first, starts)
        r = _Rank(rank, m.attrs)
        r.linked = m.linked
        if not whole:
            r.loaded, r.complete = iv, held
        r.paint = _overlapping_steps(m, iv) if names is _SPAN_NAMES else []
        r.spans = parts.spans(rank, m, iv, names)
        r.steps, r.collective_ends = _window_steps(m, iv, r.spans)  # type: ignore[assignment]
        _index(r)
        out[rank] = r
    return out


def _held_starts(trace: _Trace, held: frozenset[int]) -> tuple[int, int]:
    """The earliest and the latest start of a step of the ``held`` iterations on any rank (the
    held iterations are a run of the trace's distinct ones: a range of values)."""
    import numpy as np

    if not held:
        return 0, -1
    x = bisect_left(trace.iterations, min(held))
    y = bisect_right(trace.iterations, max(held))
    return int(np.min(trace.first_start[x:y])), int(np.max(trace.last_start[x:y]))


def _intervals(m: _RankMeta, held: frozenset[int], first: bool,
               starts: tuple[int, int]) -> list[tuple[int, int]]:  # fmt: skip
    """The time whose spans a window holds for this rank, merged: each held step from the end
    of the collective before it (or the previous step's end, whichever is earlier) to the next
    step's start; before the first step and after the last, everything."""
    n = len(m.steps)
    if not n:
        return [(FIRST, LAST)] if first else []
    # The held iterations are a range of values, whose steps start within ``starts``: read
    # them with a step either side, and the collective ends up to their starts.
    a, b = m.steps.lower(starts[0]), m.steps.upper(starts[1])
    if a >= b:
        return []
    base = max(0, a - 1)
    run = m.steps.run(base, min(n, b + 1))
    sts, ens, its = run.start, run.end, run.it
    e = max(0, m.ends.upper(sts[a - base]) - 1)
    ends = m.ends.run(e, m.ends.upper(sts[b - 1 - base]))
    lo_it, hi_it = min(held), max(held)
    raw = []
    for j in range(a - base, b - base):
        st, it = sts[j], its[j]
        if not lo_it <= it <= hi_it:
            continue
        if j + base == 0:
            lo = FIRST
        else:
            lo = min(st, ens[j - 1])
            i = bisect_right(ends, st) - 1  # none before: no end at all before st
            if i >= 0:
                lo = min(lo, ends[i])
        hi = LAST if j + base == n - 1 else max(ens[j], sts[j + 1])
        raw.append((lo, hi))
    raw.sort()
    out: list[tuple[int, int]] = []
    for lo, hi in raw:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlapping_steps(m: _RankMeta, iv: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The steps that overlap the intervals (the timeline is painted only there)."""
    out: list[tuple[int, int, int]] = []
    for lo, hi in iv:
        out += m.steps.overlapping(lo, hi)
    return out


class _Parts:
    """A rank's parts, filtered to the phase spans of worker resources, read on demand and
    kept (up to :data:`CACHE_ROWS`) while the windows cross them."""

    def __init__(self, store: Store, trace: _Trace) -> None:
        self.trace = trace
        self.cache: OrderedDict[tuple[Path, bool], Any] = OrderedDict()
        self.held = 0

    def _table(self, part: Path, names: list[str]) -> Any:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        key = (part, names is _P2P_NAMES)
        t = self.cache.get(key)
        if t is not None:
            self.cache.move_to_end(key)
            return t
        t = pq.ParquetFile(part, read_dictionary=["name"]).read(columns=_COLUMNS)
        name = t.column("name").combine_chunks()
        wanted = np.isin(np.array(name.dictionary.to_pylist(), object), names)
        keep = wanted[name.indices.to_numpy(zero_copy_only=False)] & np.isin(
            t.column("resource_id").to_numpy(), self.trace.workers
        )
        t = t.filter(pa.array(keep)).drop_columns(["resource_id"]).combine_chunks()
        self.cache[key] = t
        self.held += t.num_rows
        while self.held > CACHE_ROWS and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self.held -= old.num_rows
        return t

    def spans(self, rank: int, m: _RankMeta, iv: list[tuple[int, int]],
              names: list[str]) -> list[_Span]:  # fmt: skip
        """The rank's spans that overlap ``iv`` (ends included), each span id once (its first
        row in read order: a recorder dump may repeat what the exporter wrote), sorted as
        :func:`_index` sorts them (by start, longest first, then in
        read order)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        code_of: dict[str, int] = {}
        canon: list[str] = []
        codes, starts, ends, ids, links = [], [], [], [], []
        for part, lo, hi in m.parts:
            if not any(a <= hi and lo <= b for a, b in iv):
                continue
            t = self._table(part, names)
            if not t.num_rows:
                continue
            st = t.column("start_ns").to_numpy()
            en = t.column("end_ns").to_numpy()
            mask = np.zeros(len(st), bool)
            for a, b in iv:
                mask |= (st <= b) & (en >= a)
            idx = np.flatnonzero(mask)
            if not len(idx):
                continue
            col = t.column("name").chunk(0)
            remap = np.array(
                [code_of.setdefault(ALIASES.get(n, n), len(code_of))
                 for n in col.dictionary.to_pylist()], np.int64,
            )  # fmt: skip
            codes.append(remap[col.indices.to_numpy(zero_copy_only=False)[idx]])
            starts.append(st[idx])
            ends.append(en[idx])
            sel = pa.array(idx)
            ids.append(t.column("span_id").chunk(0).take(sel))
            links.append(t.column("links").chunk(0).take(sel))
        if not codes:
            return []
        canon = list(code_of)
        code = np.concatenate(codes)
        st, en = np.concatenate(starts), np.concatenate(ends)
        sid = pa.concat_arrays(ids)
        lk = pa.concat_arrays(links)
        named = pc.fill_null(pc.not_equal(sid, ""), False)
        if pc.count_distinct(sid.filter(named)).as_py() < pc.sum(named).as_py():
            first = np.ones(len(code), bool)  # a span id seen before: only its first row
            seen: set[str] = set()
            for k, x in enumerate(sid.to_pylist()):
                if x:
                    if x in seen:
                        first[k] = False
                    seen.add(x)
            keep = np.flatnonzero(first)
            code, st, en = code[keep], st[keep], en[keep]
            sid, lk = sid.take(pa.array(keep)), lk.take(pa.array(keep))
        order = np.lexsort((-en, st))  # stable: ties stay in read order
        code_l = code[order].tolist()
        out = [
            _Span(canon[c], a, b, None)
            for c, a, b in zip(code_l, st[order].tolist(), en[order].tolist(), strict=True)
        ]
        for c, special in ((code_of.get(S.P2P_SEND_FORWARD), "id"),
                           (code_of.get(S.PP_RECV_FORWARD_LINKED), "links")):  # fmt: skip
            if c is None:
                continue
            at = np.flatnonzero(code[order] == c)
            vals = (sid if special == "id" else lk).take(pa.array(order[at])).to_pylist()
            for k, v in zip(at.tolist(), vals, strict=True):
                if special == "id":
                    out[k].span_id = v
                elif v is not None:
                    out[k].links = tuple(x.get("spanId") for x in loads(v) or () if x.get("spanId"))
        return out


def _read_trace(store: Store, spill: Spill) -> tuple[_Trace, int | None, bool]:
    """The small whole-trace part (module docstring), the world size and whether any
    synchronising span is there. Each rank's steps and collective ends go to ``spill``'s
    blobs (files past :data:`STEPS_IN_MEMORY` steps), sorted a rank at a time."""
    import numpy as np
    import pyarrow.parquet as pq

    con = store.connect()
    try:
        res = con.execute(
            "SELECT resource_id, rank, launcher, attributes FROM resources ORDER BY resource_id"
        ).fetchall()
        workers = [rid for rid, _, launcher, _ in res if not launcher]
        attrs_of = {rid: a for rid, _, launcher, a in res if not launcher}
        where = f"resource_id IN ({', '.join(map(str, workers)) or 'NULL'})"
        sync = _sql_in(_names(SYNC_NAMES))
        per_rank = con.execute(
            f"SELECT rank, min(resource_id), count(*) FILTER (WHERE name IN ({_sql_in(_SPAN_NAMES)})),"
            f" count(*) FILTER (WHERE name IN ({sync})),"
            f" count(*) FILTER (WHERE name IN ({_sql_in(_P2P_NAMES)})),"
            f" count(*) FILTER (WHERE name IN ({_sql_in(_STEP_NAMES)}))"
            f" FROM spans WHERE {where} GROUP BY rank ORDER BY 2"
        ).fetchall()
        on_disk = sum(row[5] for row in per_rank) > STEPS_IN_MEMORY
        spool = Spool(spill, on_disk)
        metas: dict[int, _RankMeta] = {}
        seen: dict[int, set[str]] = {}
        for rank, rid, *_ in per_rank:
            metas[rank] = _RankMeta(loads(attrs_of[rid]))
            seen[rank] = set()
            spool.add_rank(rank)
        step_names = frozenset(_STEP_NAMES)
        read = f"{where} AND name IN ({_sql_in(_STEP_NAMES + _FINISH_NAMES)})"
        # Only an id written twice (a recorder dump repeats what the exporter wrote) needs the
        # first-seen check: a set of every id would grow with the trace.
        twice: dict[int, set[str]] = {rank: set() for rank in metas}
        for rank, sid in con.execute(
            f"SELECT rank, span_id FROM spans WHERE {read} AND span_id IS NOT NULL"
            " AND span_id <> '' GROUP BY ALL HAVING count(*) > 1"
        ).fetchall():
            twice[rank].add(sid)
        cur = con.sql(
            "SELECT rank, name, start_ns, end_ns, span_id,"
            f" CASE WHEN name IN ({_sql_in(_STEP_NAMES)}) THEN attributes END FROM spans"
            f" WHERE {read}"
        )
        reader = StoreReader(store)
        # Streamed, a few MB at a time (DuckDB < 1.4 names it fetch_record_batch).
        stream = getattr(cur, "to_arrow_reader", None) or cur.fetch_record_batch
        for rb in stream(8_192):
            cols = [c.to_pylist() for c in rb.columns]
            for rank, name, start, end, sid, attrs in zip(*cols, strict=True):
                if sid and sid in twice[rank]:
                    if sid in seen[rank]:
                        continue
                    seen[rank].add(sid)
                if name in step_names:
                    it = attributes(loads(attrs) if attrs else None).get(Attr.ITERATION)
                    if it is not None:
                        try:
                            it = int(it)
                            if not FIRST <= it <= LAST:  # kept as int64: refused as malformed
                                raise ValueError(f"iteration {it} is past 64 bits")
                            ss, ee, ii = spool.steps[rank]
                            ss.append(start)
                            ee.append(end)
                            ii.append(it)
                        except (TypeError, ValueError) as e:
                            raise reader.error_here(
                                f"malformed span ({type(e).__name__}: {e})"
                            ) from None
                else:
                    spool.ends[rank].append(end)
            spool.read(rb.num_rows)
        del seen, twice
        starts = IterationStarts()
        steps_blob, ends_blob = spill.blob(on_disk), spill.blob(on_disk)
        for rank, m in metas.items():
            rows, ends = spool.take(rank)
            st = rows["start"]
            if not (st[1:] > st[:-1]).all():  # as read, a rank's steps mostly come in order
                rows = rows[np.lexsort((rows["it"], rows["end"], st))]
            m.steps = SortedSteps(steps_blob, rows)
            m.ends = SortedEnds(ends_blob, np.sort(ends))
            starts.add(rows["it"], rows["start"])
            del rows, ends
        spool.close()
        linked = con.execute(
            "WITH t AS (SELECT rank, list_filter(json_extract_string(links, '$[*].spanId'),"
            f" {_lambda(con)} x IS NOT NULL AND x <> '')[1] AS id FROM spans"
            f" WHERE {where} AND name IN ({_sql_in(_names({S.PP_RECV_FORWARD_LINKED}))})"
            " AND links IS NOT NULL)"
            " SELECT rank, id, id IN (SELECT span_id FROM spans"
            f"  WHERE {where} AND name IN ({_sql_in(_names({S.P2P_SEND_FORWARD}))}))"
            " FROM t WHERE id IS NOT NULL GROUP BY ALL"
        ).fetchall()
    finally:
        con.close()
    missing = set()
    for rank, target, found in linked:
        if rank in metas:
            metas[rank].linked = True
        if not found:
            missing.add(target)
    # The ranks with a span the analysis reads (as the in-memory path keeps them).
    ranks = {
        rank: metas[rank] for rank, _, spans, *_ in per_rank if spans or len(metas[rank].steps)
    }
    for part in store.parts:
        rank = int(part.parent.name.split("=", 1)[1])
        if rank not in ranks:
            continue
        md = pq.ParquetFile(part).metadata
        lo, hi = LAST, FIRST
        cols = {md.schema.column(i).name: i for i in range(md.num_columns)}
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            a, b = rg.column(cols["start_ns"]).statistics, rg.column(cols["end_ns"]).statistics
            if a is None or b is None or not a.has_min_max or not b.has_min_max:
                lo, hi = FIRST, LAST
                break
            lo, hi = min(lo, a.min), max(hi, b.max)
        ranks[rank].parts.append((part, lo, hi))
    world = next(
        (
            w
            for m in ranks.values()
            if (w := _int(m.attrs.get(ResourceAttr.WORLD_SIZE))) is not None
        ),
        None,
    )
    synced = any(row[3] for row in per_rank if row[0] in ranks)
    trace = _Trace(
        ranks, array("q", starts.keys.tobytes()), starts.first, starts.last, frozenset(missing),
        np.array(workers, np.int32), sum(row[2] for row in per_rank if row[0] in ranks),
        sum(row[4] for row in per_rank if row[0] in ranks),
    )  # fmt: skip
    return trace, world, synced


def _lambda(con: Any) -> str:
    """The head of a one-argument lambda in this DuckDB's syntax (``lambda x:`` since 1.3,
    where 2.0 refuses the older ``x ->``)."""
    version = con.execute("SELECT version()").fetchone()[0].lstrip("v").split(".")
    return "lambda x:" if tuple(int(v) for v in version[:2]) >= (1, 3) else "x ->"


def _int(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None
