"""``mlaunch trace summary``: statistics checked against numbers worked out by hand from
``support.synthetic_traces.hand_example`` (see its docstring for the timeline)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.synthetic_traces import TraceBuilder, hand_example

from mlaunch.model.spans import ResourceAttr, SpanName
from mlaunch.trace.stats import percentile
from mlaunch.trace.store import open_reader
from mlaunch.trace.summary import Summary, summarize_store


def _summary(tmp_path: Path, b: TraceBuilder, **kw: float) -> Summary:
    b.write_run_dir(tmp_path)
    return summarize_store(open_reader(tmp_path).store, **kw)


def _by_name(s: Summary) -> dict[str, object]:
    return {x.name: x for x in s.spans}


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([10, 20, 30, 40], 50) == 25
    assert percentile([10, 20, 30, 40], 95) == pytest.approx(38.5)
    assert percentile([7], 95) == 7
    assert percentile([], 50) == 0.0


def test_step_statistics_pool_all_ranks(tmp_path: Path) -> None:
    # Steps: rank 0 [130, 100, 100, 100], rank 1 [120, 120, 130, 200]
    # sorted [100,100,100,120,120,130,130,200]: p50 at 3.5 -> 120; p95 at 6.65 -> 130+70*.65.
    s = _summary(tmp_path, hand_example()[0])
    step = _by_name(s)[SpanName.ITERATION]
    assert step.count == 8
    assert step.total_ms == pytest.approx(1000)
    assert step.mean_ms == pytest.approx(125)
    assert step.p50_ms == pytest.approx(120)
    assert step.p95_ms == pytest.approx(175.5)
    assert step.max_ms == pytest.approx(200)
    assert step.share == pytest.approx(1.0)


def test_share_is_relative_to_total_step_time(tmp_path: Path) -> None:
    names = _by_name(_summary(tmp_path, hand_example()[0]))
    assert names[SpanName.CHECKPOINT_SAVE].share == pytest.approx(100 / 1000)
    assert names[SpanName.EVALUATE_STEP].share == pytest.approx(100 / 1000)
    assert names[SpanName.EVALUATE_STEP].count == 2
    assert names[SpanName.EVALUATE_STEP].p50_ms == pytest.approx(50)
    assert names[SpanName.TRAIN].share == pytest.approx(0.75)  # 750 ms / 1000 ms of steps


def test_rows_are_ordered_by_total_time(tmp_path: Path) -> None:
    s = _summary(tmp_path, hand_example()[0])
    totals = [x.total_ms for x in s.spans]
    assert totals == sorted(totals, reverse=True)


def test_skew_names_the_slowest_rank_as_straggler(tmp_path: Path) -> None:
    # Medians: rank 0 -> 100, rank 1 -> 125; reference = median(100, 125) = 112.5.
    s = _summary(tmp_path, hand_example()[0])
    assert s.skew is not None
    assert s.skew.reference_median_ms == pytest.approx(112.5)
    assert s.skew.slowest_rank == 1
    assert s.skew.slowest_median_ms == pytest.approx(125)
    assert s.skew.slowest_ratio == pytest.approx(125 / 112.5)
    assert s.skew.stragglers == [1]
    r0, r1 = s.ranks
    assert (r0.rank, r0.steps, r0.median_ms, r0.straggler) == (0, 4, 100, False)
    assert r0.ratio == pytest.approx(100 / 112.5)
    assert r1.p95_ms == pytest.approx(130 + 70 * 0.85)  # [120,120,130,200] at 2.85


def test_straggler_threshold_is_respected(tmp_path: Path) -> None:
    s = _summary(tmp_path, hand_example()[0], straggler_threshold=0.2)
    assert s.skew is not None and s.skew.stragglers == []


def test_error_and_truncated_spans_are_counted_per_name(tmp_path: Path) -> None:
    s = _summary(tmp_path, hand_example()[0])
    names = _by_name(s)
    assert (s.errors, s.truncated) == (1, 1)
    assert names[SpanName.CHECKPOINT_SAVE_IO_WRITE].errors == 1
    assert names[SpanName.ITERATION].truncated == 1
    assert names[SpanName.ITERATION].errors == 0


def test_run_identity_comes_from_resource_attributes(tmp_path: Path) -> None:
    s = _summary(tmp_path, hand_example()[0])
    assert s.run[ResourceAttr.RUN_ID] == "synthrun0001"
    assert s.run[ResourceAttr.WORLD_SIZE] == 2
    assert s.run[ResourceAttr.NUM_LAYERS] == 4
    assert s.hosts == ["node0"]
    assert s.rank_ids == [0, 1]


def test_no_steps_means_no_share_and_no_skew(tmp_path: Path) -> None:
    b = TraceBuilder()
    b.span(0, SpanName.CHECKPOINT_SAVE, 0, 10)
    s = _summary(tmp_path, b)
    assert s.skew is None and s.ranks == []
    assert s.spans[0].share is None


def test_json_form_has_every_section(tmp_path: Path) -> None:
    d = _summary(tmp_path, hand_example()[0]).to_json()
    assert set(d) >= {"run", "hosts", "spans", "step_skew", "errors", "truncated", "read"}
    assert d["step_skew"]["slowest_rank"] == 1
    assert d["read"]["spans"] == 21  # 17 on rank 0, 4 on rank 1


def test_the_launchers_job_spans_are_listed_without_a_share_of_step_time(tmp_path: Path) -> None:
    s = _summary(tmp_path, hand_example(job=(0, 1000))[0])
    by = {x.name: x for x in s.spans}
    assert by[SpanName.JOB].count == 1 and by[SpanName.JOB].share is None
    assert by[SpanName.JOB_ATTEMPT].share is None
    assert by[SpanName.ITERATION].share == pytest.approx(1.0)
    assert -1 not in s.rank_ids  # the launcher is no rank
