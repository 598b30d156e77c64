"""``mlaunch trace stragglers`` on the span store, a window of iterations at a time: memory
bounded by the window, not by the trace (:mod:`mlaunch.trace.stragglers` holds the rules; the
windowed answer equals theirs on the whole trace at once, which tests/trace/test_trace_stragglers.py
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
end past the runs it read) raises :class:`~mlaunch.trace.stragglers.Widen`, and the window is
done again with a halo four times wider (the last resort, the whole trace: the answer never
depends on the window).

Two passes: the P2P floors (a receiver's shortest wait at each exchange in any iteration, the
sender's earliest start into its step there) are global, so a first pass over the windows
reads only the P2P spans for them; the second charges the waits.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orjson import loads

from mlaunch.model.spans import ALIASES, Attr, ResourceAttr, SpanName
from mlaunch.otlp.otlp_json import attributes
from mlaunch.trace.goodput import _in, _names
from mlaunch.trace.store import Store, StoreReader
from mlaunch.trace.store_steps import (
    IterationStarts,
    SortedEnds,
    SortedSteps,
    Spill,
    Spool,
    WindowEnds,
    WindowSteps,
)
from mlaunch.trace.stragglers import (
    FIRST,
    KEEP,
    LAST,
    SYNC_NAMES,
    P2PPair,
    Stragglers,
    Tally,
    Widen,
    _index,
    _P2PWait,
    _Rank,
    _Span,
    charge_waits,
    check_input,
    check_paired,
    fold_floors,
    p2p_pairs,
    p2p_waits,
    rows,
)

S = SpanName
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
        :func:`~mlaunch.trace.stragglers._index` sorts them (by start, longest first, then in
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
        sync = _in(_names(SYNC_NAMES))
        per_rank = con.execute(
            f"SELECT rank, min(resource_id), count(*) FILTER (WHERE name IN ({_in(_SPAN_NAMES)})),"
            f" count(*) FILTER (WHERE name IN ({sync})),"
            f" count(*) FILTER (WHERE name IN ({_in(_P2P_NAMES)})),"
            f" count(*) FILTER (WHERE name IN ({_in(_STEP_NAMES)}))"
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
        read = f"{where} AND name IN ({_in(_STEP_NAMES + _FINISH_NAMES)})"
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
            f" CASE WHEN name IN ({_in(_STEP_NAMES)}) THEN attributes END FROM spans"
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
            f" WHERE {where} AND name IN ({_in(_names({S.PP_RECV_FORWARD_LINKED}))})"
            " AND links IS NOT NULL)"
            " SELECT rank, id, id IN (SELECT span_id FROM spans"
            f"  WHERE {where} AND name IN ({_in(_names({S.P2P_SEND_FORWARD}))}))"
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
