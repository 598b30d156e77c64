"""``mlaunch trace report`` from the span store (mlaunch/trace/report/window.py: Arrow
filters, only steps, marks and the window's spans become dicts) prepares the data the JSON path
prepares: the same timeline, curves, goodput, notes, marks and window; the summary equal within
the float rounding of the store's DuckDB percentiles (summary.py, as `trace summary`); and
the page built from either is the same HTML once it is given the same summary."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from report_synth import write_per_step_run
from support.synthetic_traces import TraceBuilder, hand_example, write_realistic_run
from support.trace_compare import assert_same, fresh_store

from mlaunch.model.spans import Attr, SpanName
from mlaunch.trace.reader import TraceInputError, TraceReader
from mlaunch.trace.report import window
from mlaunch.trace.report.build import prepare, render
from mlaunch.trace.store import StoreReader, open_store

S = SpanName


def _marked(run: Path) -> Path:
    """Steps on two ranks, a live capture over iterations 4-5, one over no step, a recorder
    dump on rank 1, a span outside every step."""
    b = TraceBuilder()
    for r in (0, 1):
        for it in range(1, 11):
            a: dict[str, object] = {Attr.ITERATION: it, Attr.LOSS: 10.0 / it}
            if it in (4, 5):
                a[Attr.CAPTURE_ID] = "cap-1"
            if r == 1 and it == 8:
                a.update({Attr.RECORDER_TRIGGER: "slow_iteration", Attr.RECORDER_DUMP: 1})
            step = b.span(r, S.ITERATION, it * 100, it * 100 + 90 + r, attrs=a)
            b.span(r, S.FORWARD_BACKWARD, it * 100 + 5, it * 100 + 80, parent=step)
    b.span(0, "custom.after", 2000, 2001)
    b.span(1, "custom.captured", 2100, 2200, attrs={Attr.CAPTURE_ID: "cap-2"})  # no step in it
    return b.write_run_dir(run)


def _runs(tmp_path: Path) -> list[Path]:
    hand = hand_example()[0].write_run_dir(tmp_path / "hand")
    a = tmp_path / "real4"
    write_realistic_run(a, steps=30, seed=1)
    b = tmp_path / "real2"
    write_realistic_run(b, ranks=2, steps=12, pp=1, microbatches=2, layers=2, batch=7, seed=3)
    per_step = write_per_step_run(tmp_path / "perstep", iterations=40)
    return [hand, a, b, per_step, _marked(tmp_path / "marked")]


def _agree(run: Path, iterations: tuple[int, int] | None = None) -> None:
    """The report of a store cut into parts of 3 rows equals that of a store built afresh in
    one piece (the JSON reader this compared with is gone: every report reads a store)."""
    from mlaunch.trace.store_build import build_store

    old = prepare(run, StoreReader(fresh_store(run)), iterations)
    build_store(run, TraceReader.open(run), segment_rows=3)
    store = open_store(run)
    assert store is not None and len(store.parts) > 2
    new = prepare(run, StoreReader(store), iterations)
    assert_same(old.summary.to_json(), new.summary.to_json(), str(run))
    assert old.goodput.to_json() == new.goodput.to_json()
    assert old.timeline == new.timeline
    assert (old.ranges, old.notes, old.marks, old.meta) == (new.ranges, new.notes, new.marks,
                                                            new.meta)  # fmt: skip
    assert (old.curve_figs, old.curve_source) == (new.curve_figs, new.curve_source)
    assert render(old).html == render(replace(new, summary=old.summary)).html


def test_the_report_from_the_store_prepares_the_json_paths_data(tmp_path: Path) -> None:
    for run in _runs(tmp_path):
        _agree(run)
    marked = prepare(tmp_path / "marked", StoreReader(open_store(tmp_path / "marked")))
    assert sorted((m.kind, m.label) for m in marked.marks) == [
        ("capture", "cap-1"),
        ("capture", "cap-2"),
        ("recorder", "slow_iteration"),
    ]


@pytest.mark.parametrize("iterations", [(2, 3), (30, 40)])
def test_a_chosen_window_from_the_store_equals_the_json_paths(
    tmp_path: Path, iterations: tuple[int, int]
) -> None:
    _agree(write_per_step_run(tmp_path / "run", iterations=40), iterations)


def test_a_window_too_large_is_refused_from_the_store_too(tmp_path: Path, monkeypatch) -> None:
    run = write_per_step_run(tmp_path / "run", iterations=10)
    monkeypatch.setattr(window, "MAX_TIMELINE_SPANS", 5)  # one limit: the store's reads it too
    for reader in (StoreReader(open_store(run)),):
        with pytest.raises(TraceInputError, match="more than 5 spans"):
            prepare(run, reader)
    shutil.rmtree(run)


def test_the_report_cli_reads_a_store_whose_json_is_gone(tmp_path: Path) -> None:
    """The JSON moved away (the store alone, as the other commands read it): the same page as
    when the JSON was there; a run directory with neither is still refused."""
    from support.trace_cli import invoke_trace

    run = tmp_path / "run"
    write_realistic_run(run, ranks=2, steps=6, pp=1)
    r = invoke_trace("report", run, "-o", tmp_path / "with.html")
    assert r.exit_code == 0, r.output
    for p in (run / "telemetry").glob("*.jsonl"):
        p.unlink()
    r = invoke_trace("report", run, "-o", tmp_path / "without.html")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "without.html").read_bytes() == (tmp_path / "with.html").read_bytes()
    shutil.rmtree(run / "trace-store")
    r = invoke_trace("report", run, "-o", tmp_path / "none.html")
    assert r.exit_code == 2 and "no trace files found" in r.output


def test_with_a_progress_file_pass_one_keeps_no_steps_and_places_the_same_window(
    tmp_path: Path,
) -> None:
    """The curves come from progress.jsonl, so pass 1 keeps only each iteration's earliest start
    and latest end (not ranks x iterations steps): the window, focus and timeline are those of
    a scan that kept every step, on both paths, and nothing per step is held."""
    import orjson

    from mlaunch.rundir import layout as lay
    from mlaunch.trace.report.window import StoreScan

    run = tmp_path / "run"
    write_realistic_run(run, ranks=4, steps=20, seed=5)
    without = prepare(run, StoreReader(fresh_store(run)))
    assert without.curve_source.startswith("megatron.train.iteration span attributes")
    records = [{"iteration": i, "loss": 5.0 - i / 10, "lr": 1e-3} for i in range(1, 21)]
    (run / lay.PROGRESS_FILE).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    store = open_store(run)
    assert store is not None
    every = StoreScan(fresh_store(run), True)
    steps = [st for r in every.steps.values() for st in r]
    ranges = [(1, 3), (9, 11), (18, 20)]
    expected = [
        (min(s.start for s in steps if a <= s.iteration <= b),
         max(s.end for s in steps if a <= s.iteration <= b)) for a, b in ranges
    ]  # fmt: skip
    for keep in (True, False):
        for scan in (StoreScan(store, keep),):
            held = sum(len(s) for s in scan.steps.values())
            assert (held > 0) == keep
            present = scan.iterations()
            assert present == sorted({s.iteration for s in steps}) == list(range(1, 21))
            assert [scan.steps_between(a, b) for a, b in ranges] == expected
            assert scan.first_start(9) == min(s.start for s in steps if s.iteration == 9)
    with_progress = prepare(run, StoreReader(store))
    assert with_progress.curve_source == lay.PROGRESS_FILE
    assert with_progress.timeline == without.timeline
    assert (with_progress.ranges, with_progress.marks) == (without.ranges, without.marks)
