"""``mlaunch trace goodput``: the wall-time split checked against the hand-computed example
(``support.synthetic_traces.hand_example``) and against nesting traps."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.synthetic_traces import TraceBuilder, hand_example

from mlaunch.model.spans import Attr, LegacyName, SpanName
from mlaunch.trace.goodput import GoodputReport, goodput_store
from mlaunch.trace.store import open_store

S = SpanName


def _report(tmp_path: Path, b: TraceBuilder) -> GoodputReport:
    """The goodput of ``b``'s run, from its span store."""
    b.write_run_dir(tmp_path)
    return _both(tmp_path)


def _both(run: Path) -> GoodputReport:
    store = open_store(run)
    assert store is not None
    return goodput_store(store)


@pytest.mark.parametrize("legacy", [False, True], ids=["code-names", "documented-names"])
def test_full_tree_rank_splits_wall_time_by_hand(tmp_path: Path, legacy: bool) -> None:
    # Steps 130+100+100+100 = 430; median 100, first step 130 -> excess 30; productive 400.
    # Restart: model_init 100 + load 100 (io_read inside, not added) + data 50
    #          + first_iteration outside its step 150-130 = 20, + excess 30 -> 50 => 300.
    # Checkpoint 100 (io_write inside not added), eval 100, unaccounted 900..1000 = 100.
    # The same in an older trace's names, whose megatron.pretrain (0-1000) gives the wall.
    r0 = _report(tmp_path, hand_example(legacy=legacy)[0]).ranks[0]
    b = r0.breakdown
    assert r0.wall_source == (LegacyName.PRETRAIN if legacy else "span extent")
    assert r0.median_step_ms == pytest.approx(100)
    assert r0.first_iteration_excess_ms == pytest.approx(30)
    assert b.wall_ms == pytest.approx(1000)
    assert b.productive_ms == pytest.approx(400)
    assert b.restart_ms == pytest.approx(300)
    assert b.restart_split_ms == pytest.approx(
        {
            "launch": 0,
            "model_init": 100,
            "load_checkpoint": 100,
            "data_setup": 50,
            "first_iteration": 50,
            "startup": 0,
            "requeue": 0,
        }  # fmt: skip
    )
    assert b.checkpoint_ms == pytest.approx(100)
    assert b.evaluation_ms == pytest.approx(100)
    assert b.unaccounted_ms == pytest.approx(100)
    assert b.goodput == pytest.approx(0.4)


def _megatron_launch(b: TraceBuilder) -> None:
    """A Megatron-LM start-up backdated from the launch stamps (times in ms): pre_startup
    0..300 (SLURM's job start to the launch), startup 300..700 with launch_script 300..400,
    container_load 400..450, model_init 450..550; one step 700..800."""
    b.span(0, S.PRE_STARTUP, 0, 300)
    startup = b.span(0, S.STARTUP, 300, 700)
    b.span(0, S.STARTUP_LAUNCH_SCRIPT, 300, 400, parent=startup)
    b.span(0, S.STARTUP_CONTAINER_LOAD, 400, 450, parent=startup)
    b.span(0, S.MODEL_INIT, 450, 550, parent=startup)
    train = b.span(0, S.TRAIN, 700, 800)
    b.span(0, S.ITERATION, 700, 800, parent=train, attrs={Attr.ITERATION: 1})


def test_the_launch_before_a_megatron_workers_python_is_restart_time(tmp_path: Path) -> None:
    # Wall = the launcher's job 300..800: launch_script + container_load = 150 (pre_startup lies
    # before the job); model_init 100; the rest of the start-up 400-150-100 = 150; the step 100.
    b = TraceBuilder(world_size=1)
    _megatron_launch(b)
    b.span(TraceBuilder.LAUNCHER, S.JOB, 300, 800)
    bd = _report(tmp_path / "job", b).ranks[0].breakdown
    assert bd.restart_split_ms["launch"] == pytest.approx(150)
    assert bd.restart_split_ms["model_init"] == pytest.approx(100)
    assert bd.restart_split_ms["startup"] == pytest.approx(150)
    assert (bd.wall_ms, bd.productive_ms, bd.unaccounted_ms) == pytest.approx((500, 100, 0))
    # Without the launcher's trace the wall is the rank's extent, 0..800: pre_startup too.
    b = TraceBuilder(world_size=1)
    _megatron_launch(b)
    bd = _report(tmp_path / "collector", b).ranks[0].breakdown
    assert bd.restart_split_ms["launch"] == pytest.approx(450)
    assert (bd.wall_ms, bd.unaccounted_ms) == pytest.approx((800, 0))


def test_rank_without_job_span_uses_span_extent(tmp_path: Path) -> None:
    # Steps 120,120,130,200 back to back from 0 to 570; median 125 > first step 120 -> no excess.
    r1 = _report(tmp_path, hand_example()[0]).ranks[1]
    assert r1.wall_source == "span extent"
    assert r1.breakdown.wall_ms == pytest.approx(570)
    assert r1.breakdown.productive_ms == pytest.approx(570)
    assert r1.first_iteration_excess_ms == 0
    assert r1.breakdown.goodput == pytest.approx(1.0)


def test_overall_sums_rank_time(tmp_path: Path) -> None:
    rep = _report(tmp_path, hand_example()[0])
    assert rep.overall.wall_ms == pytest.approx(1570)
    assert rep.overall.productive_ms == pytest.approx(970)
    assert rep.overall.goodput == pytest.approx(970 / 1570)
    assert rep.job_wall_ms == pytest.approx(1000)
    d = rep.to_json()
    assert d["overall"]["goodput"] == pytest.approx(970 / 1570)
    assert [r["rank"] for r in d["ranks"]] == [0, 1]


def test_parts_add_up_to_wall(tmp_path: Path) -> None:
    for r in _report(tmp_path, hand_example()[0]).ranks:
        b = r.breakdown
        parts = b.productive_ms + b.restart_ms + b.checkpoint_ms + b.evaluation_ms
        assert parts + b.unaccounted_ms == pytest.approx(b.wall_ms)


def test_nested_and_overlapping_phase_spans_count_once(tmp_path: Path) -> None:
    # A save nested in a save, an eval overlapping the save, and a region inside the save:
    # checkpoint = union 100-200 = 100; eval 150-250 minus the checkpoint part = 50.
    b = TraceBuilder()
    pre = b.span(0, LegacyName.PRETRAIN, 0, 300)
    outer = b.span(0, S.CHECKPOINT_SAVE, 100, 200, parent=pre)
    b.span(0, S.CHECKPOINT_SAVE, 120, 180, parent=outer)
    b.span(0, S.CHECKPOINT_SAVE_IO_WRITE, 130, 170, parent=outer)
    b.span(0, "megatron.region.write_shards", 130, 160, parent=outer)
    b.span(0, S.EVALUATE, 150, 250, parent=pre)
    bd = _report(tmp_path, b).ranks[0].breakdown
    assert (bd.checkpoint_ms, bd.evaluation_ms) == (pytest.approx(100), pytest.approx(50))
    assert bd.unaccounted_ms == pytest.approx(150)
    assert bd.productive_ms == 0


def test_first_step_falls_back_to_earliest_step_without_first_iteration(tmp_path: Path) -> None:
    # Steps 300, 100, 100 -> median 100, excess 200 moved from productive to restart.
    b = TraceBuilder()
    pre = b.span(0, LegacyName.PRETRAIN, 0, 500)
    for s, e in ((0, 300), (300, 400), (400, 500)):
        b.span(0, S.ITERATION, s, e, parent=pre)
    r = _report(tmp_path, b).ranks[0]
    assert r.first_iteration_excess_ms == pytest.approx(200)
    assert r.breakdown.productive_ms == pytest.approx(300)
    assert r.breakdown.restart_split_ms["first_iteration"] == pytest.approx(200)


def test_restarted_attempts_each_have_a_first_iteration(tmp_path: Path) -> None:
    # Two attempts on one rank: the gap between them (200-300) is unaccounted.
    b = TraceBuilder()
    for off in (0, 300):
        pre = b.span(0, LegacyName.PRETRAIN, off, off + 200)
        fi = b.span(0, S.FIRST_ITERATION, off, off + 80, parent=pre)
        b.span(0, S.ITERATION, off, off + 80, parent=fi)
        for k in range(4):
            b.span(0, S.ITERATION, off + 80 + 30 * k, off + 110 + 30 * k, parent=pre)
    r = _report(tmp_path, b).ranks[0]
    # median of [80,30,30,30,30]*2 = 30; two first steps of 80 -> excess 2 x 50 = 100.
    assert r.first_iteration_excess_ms == pytest.approx(100)
    assert r.breakdown.wall_ms == pytest.approx(500)
    assert r.breakdown.productive_ms == pytest.approx(2 * 200 - 100)
    assert r.breakdown.unaccounted_ms == pytest.approx(100)


def _incarnation(b: TraceBuilder, start: float) -> None:
    """One incarnation of rank 0 from ``start``: startup 100 ms, then two 100 ms steps."""
    b.span(0, S.STARTUP, start, start + 100)
    for i in range(2):
        b.span(0, S.ITERATION, start + 100 + 100 * i, start + 200 + 100 * i)


def test_a_requeue_between_launcher_incarnations_is_restart_cost(tmp_path: Path) -> None:
    # Incarnation 1: job 0-400, workers 50-350. SLURM requeues it; incarnation 2: job 1000-1500,
    # workers from 1200. Requeue = the gap 400-1000 (600) + the new launcher's head 1000-1200.
    b = TraceBuilder(world_size=1)
    b.span(b.LAUNCHER, S.JOB, 0, 400)
    b.span(b.LAUNCHER, S.JOB_ATTEMPT, 10, 390, attrs={"mlaunch.attempt": 0})
    b.span(b.LAUNCHER, S.JOB, 1000, 1500)
    b.span(b.LAUNCHER, S.JOB_ATTEMPT, 1010, 1490, attrs={"mlaunch.attempt": 0})
    _incarnation(b, 50)
    _incarnation(b, 1200)
    r0 = _report(tmp_path, b).ranks[0]
    bd = r0.breakdown
    assert r0.wall_source == S.JOB
    assert bd.wall_ms == pytest.approx(1500)
    assert bd.restart_split_ms["requeue"] == pytest.approx(800)
    assert bd.restart_split_ms["startup"] == pytest.approx(200)
    assert bd.restart_ms == pytest.approx(1000)
    # 0-50, 350-400 and 1500 after the last step: the launcher's own time, unaccounted
    assert bd.unaccounted_ms == pytest.approx(1500 - 400 - 1000)


def test_a_torchrun_restart_inside_one_job_counts_its_head_as_restart_cost(tmp_path: Path) -> None:
    # One job 0-1000; attempt 0 10-400 (a worker died), attempt 1 from 420 with workers at 600.
    b = TraceBuilder(world_size=1)
    b.span(b.LAUNCHER, S.JOB, 0, 1000)
    b.span(b.LAUNCHER, S.JOB_ATTEMPT, 10, 400, attrs={"mlaunch.attempt": 0})
    b.span(b.LAUNCHER, S.JOB_ATTEMPT, 420, 990, attrs={"mlaunch.attempt": 1})
    _incarnation(b, 50)
    _incarnation(b, 600)
    bd = _report(tmp_path, b).ranks[0].breakdown
    assert bd.restart_split_ms["requeue"] == pytest.approx(600 - 420)


def test_without_a_launcher_trace_incarnations_come_from_the_run_uuid(tmp_path: Path) -> None:
    # A collector's view of a requeued Megatron-LM run: no launcher file, two run uuids.
    b1, b2 = TraceBuilder(world_size=1), TraceBuilder(world_size=1)
    b1.resource(0)["nemo.lens.run_uuid"] = "incarnation-1"
    b2.resource(0)["nemo.lens.run_uuid"] = "incarnation-2"
    _incarnation(b1, 0)  # 0-300
    _incarnation(b2, 1000)  # 1000-1300
    tel = tmp_path / "telemetry"
    tel.mkdir()
    (tel / "traces-rank0.jsonl").write_text(
        "".join(line + "\n" for line in [*b1.lines(0), *b2.lines(0)])
    )
    bd = _both(tmp_path).ranks[0].breakdown
    assert bd.wall_ms == pytest.approx(1300)
    assert bd.restart_split_ms["requeue"] == pytest.approx(700)
    assert bd.productive_ms == pytest.approx(400)
