"""The report's two passes (:mod:`.window`) on the span store, column-wise.

Pass 1 is the store's own queries for the summary and goodput (:func:`summarize_store`,
:func:`goodput_aggregate`); of the rest of a :class:`~.window.Scan` (each iteration's step times,
each rank's count of steps, the capture and recorder marks) Arrow filters each part down to the spans that can be a step or a
mark (a step name, or an attribute list that names a mark key), and only those become dicts, fed
to :meth:`Scan.note` as the JSON pass feeds them. Pass 2 keeps the spans overlapping the window
by a numpy mask over each part's times; only those (at most ``MAX_TIMELINE_SPANS``) become
:class:`~.window.WSpan` records. Both passes read the parts in read order, so the results are the
JSON passes' own, in the same order. The steps of the one rank the curves are drawn from
(without ``progress.jsonl``) are read again from its parts once pass 1 has chosen it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orjson import loads

from mlaunch.model.spans import ALIASES
from mlaunch.otlp.otlp_json import attributes
from mlaunch.trace.goodput import goodput_aggregate
from mlaunch.trace.report import window
from mlaunch.trace.report.window import _MARK_KEYS, _STEP, RankSteps, Scan, Step, WSpan, step_of
from mlaunch.trace.store import Store, StoreReader
from mlaunch.trace.summary import Summary

_STEP_NAMES = sorted({_STEP, *(n for n, c in ALIASES.items() if c == _STEP)})
#: An attribute list that names a mark key (a key as OTLP-JSON writes it: quoted).
_MARK_PATTERN = "|".join(re.escape(f'"{k}"') for k in sorted(_MARK_KEYS))


class StoreScan(Scan):
    """A :class:`Scan` of the store: ``goodput`` is the filled aggregator, ``summary`` is not
    used (the finished :class:`Summary` is :attr:`result`)."""

    def __init__(self, store: Store, keep_steps: bool = True) -> None:
        from mlaunch.trace.summary import summarize_store

        super().__init__(keep_steps, max_kept=window.MAX_KEPT_STEPS)
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


def collect_window_store(store: Store, segs: list[tuple[int, int]]) -> dict[int, list[WSpan]]:
    """:func:`~.window.collect_window` on the store. Raises ``TraceInputError`` past
    :data:`~.window.MAX_TIMELINE_SPANS` (read from there, where the tests lower it)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlaunch.trace.reader import TraceInputError

    res = StoreReader(store).resources()
    out: dict[int, list[WSpan]] = {}
    kept, limit = 0, window.MAX_TIMELINE_SPANS
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
