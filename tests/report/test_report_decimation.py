"""Past ``MAX_CURVE_POINTS`` iterations the report's curves are decimated (mlaunch/trace/report/
curve.py): at most that many buckets a curve, each drawn as its mean with its min-max as a band,
so the page stays the same size at any run length, and a one-iteration spike still shows. Both
sources of the curves: progress.jsonl, and the step spans of a run without it (read from the
span store, whose pass 1 drops every rank's steps past MAX_KEPT_STEPS and reads the curves' rank
again, and from the JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from support.synthetic_traces import TraceBuilder

from mlaunch.model.spans import Attr, SpanName
from mlaunch.rundir import layout as lay
from mlaunch.trace.report import curve, window
from mlaunch.trace.report.build import prepare
from mlaunch.trace.report.curve import Curve
from mlaunch.trace.report.window import StoreScan
from mlaunch.trace.store import StoreReader, open_store

ITERATIONS = 400
SPIKE_AT, SPIKE = 237, 100.0
LIMIT = 16


def _loss(it: int) -> float:
    return SPIKE if it == SPIKE_AT else 2.0 + 1.0 / it


def _run(run: Path, progress: bool) -> Path:
    """Two ranks, ``ITERATIONS`` steps each (the loss on rank 1: the curves' rank), a loss
    spike at one iteration; with ``progress``, the same losses in progress.jsonl."""
    b = TraceBuilder()
    for it in range(1, ITERATIONS + 1):
        for r in (0, 1):
            a: dict[str, object] = {Attr.ITERATION: it}
            if r == 1:
                a.update({Attr.LOSS: _loss(it), Attr.GRAD_NORM: 1.0})
            b.span(r, SpanName.ITERATION, it * 100, it * 100 + 90 + r, attrs=a)
    b.write_run_dir(run, batch=200)
    if progress:
        recs = [{"iteration": i, "loss": _loss(i), "lr": 1e-3, "step_ms": 9.0}
                for i in range(1, ITERATIONS + 1)]  # fmt: skip
        (run / lay.PROGRESS_FILE).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    return run


def test_a_curve_past_the_limit_keeps_its_spike_in_a_bounded_number_of_buckets() -> None:
    c = Curve(limit=LIMIT)
    for it in range(1, ITERATIONS + 1):
        c.add(it, _loss(it))
    p = c.points()
    assert 0 < len(p.xs) <= LIMIT and p.lo is not None and p.hi is not None
    assert max(p.hi) == SPIKE and min(p.lo) == _loss(ITERATIONS)
    assert p.iterations == ITERATIONS and p.width > 1
    # the spike's bucket is the one around its iteration; its mean holds it, diluted
    k = max(range(len(p.hi)), key=p.hi.__getitem__)
    assert abs(p.xs[k] - SPIKE_AT) <= p.width and _loss(1) < p.ys[k] < SPIKE
    assert all(lo <= y <= hi for lo, y, hi in zip(p.lo, p.ys, p.hi, strict=True))
    # under the limit: every point, the last value of an iteration counting
    c = Curve(limit=LIMIT)
    for it, v in ((3, 1.0), (1, 5.0), (3, 2.0), (2, None)):
        c.add(it, v)
    assert c.points() == curve.Points([1, 3], [5.0, 2.0])


@pytest.mark.parametrize("progress", [True, False])
def test_the_reports_curves_are_decimated_past_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, progress: bool
) -> None:
    run = _run(tmp_path / "run", progress)
    full = prepare(run, StoreReader(open_store(run)))
    assert len(full.curve_figs["chart-loss"]["data"]) == 1  # under the limit: one trace
    assert len(full.curve_figs["chart-loss"]["data"][0]["x"]) == ITERATIONS
    every = list(StoreScan(open_store(run), keep_steps=True).rank_steps(1))  # all kept
    monkeypatch.setattr(curve, "MAX_CURVE_POINTS", LIMIT)
    # and past a few steps pass 1 drops them all and reads the curves' rank again
    monkeypatch.setattr(window, "MAX_KEPT_STEPS", 50)
    for scan in (StoreScan(open_store(run), keep_steps=True),):
        assert scan.dropped_steps and not any(len(s) for s in scan.steps.values())
        assert scan.curve_rank() == 1
        assert list(scan.rank_steps(1)) == every and len(every) == ITERATIONS
    for reader in (StoreReader(open_store(run)),):
        d = prepare(run, reader)
        assert d.curve_source == (lay.PROGRESS_FILE if progress else
                                  "megatron.train.iteration span attributes of rank 1 "
                                  "(no progress.jsonl)")  # fmt: skip
        loss = d.curve_figs["chart-loss"]
        assert "decimated" in loss["layout"]["title"]["text"]
        lo, hi, mean = loss["data"]
        assert all(0 < len(t["x"]) <= LIMIT for t in loss["data"])
        assert max(hi["y"]) == SPIKE and max(mean["y"]) < SPIKE
        assert all(n <= LIMIT for counts in d.meta["charts"].values() for n in counts)


def test_the_iteration_times_folded_in_many_buffers_are_a_dicts_min_and_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pass 1's per-iteration step times (numpy arrays, a buffer folded in at a time) answer
    as a dict of each iteration's earliest start and latest end does, steps in any order."""
    import random

    from mlaunch.trace.report.window import IterationTimes

    monkeypatch.setattr(IterationTimes, "_MIN_FOLD", 7)  # hundreds of folds
    times, ref = IterationTimes(), {}
    rng = random.Random(1)
    for _ in range(3000):
        it, s = rng.randrange(-50, 900), rng.randrange(-(10**18), 10**18)
        e = s + rng.randrange(10**6)
        times.add(it, s, e)
        lohi = ref.setdefault(it, [s, e])
        lohi[0], lohi[1] = min(lohi[0], s), max(lohi[1], e)
    assert times.iterations() == sorted(ref)
    for a in range(-60, 910, 13):
        for b in (a, a + 5, a + 200):
            chosen = [v for k, v in ref.items() if a <= k <= b]
            if chosen:
                want = (min(lo for lo, _ in chosen), max(hi for _, hi in chosen))
                assert times.steps_between(a, b) == want
    assert all(times.first_start(k) == v[0] for k, v in ref.items())
    with pytest.raises(KeyError):
        times.first_start(10**6)


def _step(it: int, rank: int, loss: bool) -> dict[str, object]:
    a = [{"key": Attr.ITERATION.value, "value": {"intValue": str(it)}}]
    if loss:
        a.append({"key": Attr.LOSS.value, "value": {"doubleValue": 1.0 / it}})
    return {"name": SpanName.ITERATION.value, "startTimeUnixNano": it * 100 + rank,
            "endTimeUnixNano": it * 100 + 90, "attributes": a}  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True])
def test_past_the_steps_kept_pass_one_keeps_the_leader_and_reads_a_dropped_one_again(
    interleaved: bool,
) -> None:
    """Four ranks, the loss on ranks 1 and 3 (two last pipeline stages: the tie goes to 3),
    room for 250 steps: read a rank at a time, ranks 0-2 are dropped and rank 3's steps are
    all kept (no second read); read in halves (a dropped rank gets more steps later), the
    rank chosen is read again, and the curves' steps are the same either way."""
    from mlaunch.trace.reader import Resource
    from mlaunch.trace.report.window import Scan, step_of

    class Rereading(Scan):  # reads the batches again, as the store's scan reads its parts
        def _steps_again(self, rank: int) -> Any:
            reads.append(1)
            for r, spans, _ in batches:
                if r.rank == rank:
                    yield from (st for s in spans if (st := step_of(s)) is not None)

    res = {r: Resource({}, r) for r in range(4)}
    halves = [(r, h) for h in (range(1, 51), range(51, 101)) for r in range(4)]
    order = halves if interleaved else sorted(halves, key=lambda x: x[0])
    batches = [(res[r], [_step(it, r, r in (1, 3)) for it in its], False) for r, its in order]
    full = Rereading(True)
    scan = Rereading(True, max_kept=250)
    reads: list[int] = []
    for r, spans, _ in batches:
        full.note(r.rank, spans)
        scan.note(r.rank, spans)
    assert scan.curve_rank() == full.curve_rank() == 3
    assert sum(len(s) for s in scan.steps.values()) <= 250
    assert list(scan.rank_steps(3)) == list(full.rank_steps(3))
    assert len(list(full.rank_steps(3))) == 100
    assert scan.kept_whole(3) != interleaved and len(reads) == int(interleaved)
