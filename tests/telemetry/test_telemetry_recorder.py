"""The flight recorder in one process: a non-exporting rank records the recorder groups into a
ring of its last K iterations (bounded by bytes too), writes them as OTLP-JSON with the trigger
on every span, with the run's trace ids and parents; an exporting rank records only the groups it
does not export, nested under its exported spans; a dump never writes a span twice."""

from __future__ import annotations

import timeit

import pytest
from telemetry_helpers import read_trace_file

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay
from mlaunch.telemetry import _recorder

LAYERS = 3


def _iterations(first: int, last: int) -> None:
    for it in range(first, last + 1):
        telemetry.set_iteration(it)
        with telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: it}):
            for layer in range(LAYERS):
                with telemetry.span(G.LAYER, "megatron.layer.forward", layer=layer):
                    pass


def _dumped(run_dir, rank: int) -> list[dict]:
    return otlp_json.read_spans(lay.recorder_file(run_dir, rank))


def test_non_exporting_rank_keeps_last_k_iterations_and_dumps_them_with_the_trigger(
    make_settings, tmp_path
):
    # single_rank exports the last rank: rank 0 of 2 exports nothing but records everything.
    settings = make_settings(
        EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="all", RECORDER_ITERS="4"
    )
    handle = telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    assert not handle.exporting and telemetry.recorder_active()
    _iterations(1, 10)
    telemetry.set_iteration(11)  # seals iteration 10
    assert telemetry.recorder_dump("slow_iteration") == 4 * (1 + LAYERS)
    spans = _dumped(tmp_path, 0)
    steps = {s["attributes"][Attr.ITERATION]: s for s in spans if s["name"] == SpanName.ITERATION}
    assert sorted(steps) == [7, 8, 9, 10]
    assert {s["attributes"][Attr.RECORDER_TRIGGER] for s in spans} == {"slow_iteration"}
    by_id = {s["span_id"]: s for s in spans}
    for s in spans:
        if s["name"] != SpanName.ITERATION:
            parent = by_id[s["parent_span_id"]]
            assert parent["name"] == SpanName.ITERATION and s["trace_id"] == parent["trace_id"]
    # The run's deterministic trace id of block 0 (as every rank and the runtime derive it).
    runtime_like = _recorder.RECORDER
    expected = _recorder.segment_trace_id("testrun", runtime_like.incarnation, 0)
    assert {s["trace_id"] for s in spans} == {f"{expected:032x}"}
    assert not (tmp_path / "telemetry" / "traces-rank0.jsonl").exists()
    # What was written is gone: a second trigger writes only what came after.
    _iterations(11, 12)
    assert telemetry.recorder_dump("signal") == 2 * (1 + LAYERS)
    lines = lay.recorder_file(tmp_path, 0).read_text().splitlines()
    assert len(lines) == 2
    assert telemetry.recorder_dump("request") == 0


def test_memory_bound_drops_the_oldest_iterations_first(make_settings, tmp_path):
    per_iter = (1 + LAYERS) * _recorder.SPAN_BYTES
    mib = 3.5 * per_iter / (1 << 20)  # room for three iterations and a half
    settings = make_settings(
        EXPORT_STRATEGY="single_rank",
        RECORDER_GROUPS="all",
        RECORDER_ITERS="50",
        RECORDER_MAX_MIB=repr(mib),
    )
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    _iterations(1, 20)
    telemetry.set_iteration(21)
    rec = _recorder.RECORDER
    assert rec.held_iterations() == [18, 19, 20]
    assert rec.memory_bytes() <= mib * (1 << 20)
    telemetry.recorder_dump("exception")
    its = {s["attributes"].get(Attr.ITERATION) for s in _dumped(tmp_path, 0)} - {None}
    assert its == {18, 19, 20}


def test_exporting_rank_records_only_what_it_does_not_export_nested_under_exported_spans(
    make_settings, tmp_path
):
    settings = make_settings(SPAN_GROUPS="per_step", RECORDER_GROUPS="all")
    handle = telemetry.setup(settings, rank=0, world_size=1, run_dir=tmp_path)
    assert handle.exporting
    _iterations(1, 3)
    telemetry.set_iteration(4)
    telemetry.recorder_dump("request")
    telemetry.shutdown()
    exported = read_trace_file(tmp_path, 0)
    recorded = _dumped(tmp_path, 0)
    assert {s["name"] for s in exported} >= {SpanName.ITERATION}
    assert "megatron.layer.forward" not in {s["name"] for s in exported}
    assert {s["name"] for s in recorded} == {"megatron.layer.forward"}
    steps = {s["span_id"]: s for s in exported if s["name"] == SpanName.ITERATION}
    assert len(recorded) == 3 * LAYERS
    for s in recorded:
        assert s["parent_span_id"] in steps
        assert s["trace_id"] == steps[s["parent_span_id"]]["trace_id"]


def test_recorded_spans_keep_the_exported_train_span_they_began_under_across_a_block_change(
    make_settings, tmp_path
):
    # Blocks of 2 iterations: set_iteration(3) re-roots the exported megatron.train in place
    # (new ids); the iterations recorded before it stay children of the block-0 train span.
    settings = make_settings(
        SPAN_GROUPS="job", RECORDER_GROUPS="all", RECORDER_ITERS="10", TRACE_SEGMENT_ITERS="2"
    )
    assert telemetry.setup(settings, rank=0, world_size=1, run_dir=tmp_path).exporting
    telemetry.set_iteration(1)
    with telemetry.span(G.JOB, SpanName.TRAIN):
        _iterations(1, 4)
        telemetry.set_iteration(5)
        assert telemetry.recorder_dump("request") == 4 * (1 + LAYERS)
    telemetry.shutdown()
    trains = [s for s in read_trace_file(tmp_path, 0) if s["name"] == SpanName.TRAIN]
    assert len(trains) == 3  # blocks 0, 1 and 2 (re-rooted at iterations 3 and 5)
    train_of_block = {
        t["attributes"][Attr.TRAIN_BLOCK]: (t["trace_id"], t["span_id"]) for t in trains
    }
    recorded = _dumped(tmp_path, 0)
    by_id = {s["span_id"]: s for s in recorded}
    assert len(by_id) == len(recorded)  # unique ids
    for s in recorded:
        if s["name"] == SpanName.ITERATION:
            block = (s["attributes"][Attr.ITERATION] - 1) // 2
            assert (s["trace_id"], s["parent_span_id"]) == train_of_block[block]
        else:  # a layer, under its recorded iteration
            parent = by_id[s["parent_span_id"]]
            assert parent["name"] == SpanName.ITERATION and parent["trace_id"] == s["trace_id"]


def test_ids_read_from_an_open_recorded_span_are_the_ones_its_dump_writes(make_settings, tmp_path):
    # A recorded span makes its ids when first read (here by current_context_ints, as the
    # stage-to-stage exchange does), and they stay: the dump writes the same ones.
    settings = make_settings(EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="all")
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    telemetry.set_iteration(1)
    with (
        telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: 1}),
        telemetry.span(G.LAYER, SpanName.LAYER_FORWARD),
    ):
        hi, lo, sid, sampled = telemetry.current_context_ints()
    telemetry.set_iteration(2)
    assert telemetry.recorder_dump("request") == 2
    (layer,) = [s for s in _dumped(tmp_path, 0) if s["name"] == SpanName.LAYER_FORWARD]
    as_hex = f"{((hi % (1 << 64)) << 64) | (lo % (1 << 64)):032x}"
    assert (layer["trace_id"], layer["span_id"], sampled) == (as_hex, f"{sid % (1 << 64):016x}", 1)


def test_slow_check_uses_the_rolling_median_after_warm_up(make_settings, tmp_path):
    settings = make_settings(
        EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="layer", RECORDER_SLOW_FACTOR="3"
    )
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    assert not telemetry.recorder_step(1000.0)  # no history yet
    flags = [telemetry.recorder_step(ms) for ms in (10, 11, 9, 10, 10, 29, 31, 10)]
    assert flags == [False] * 6 + [True, False]


def test_recorder_off_without_groups_and_with_telemetry_off(make_settings, tmp_path):
    telemetry.setup(make_settings(EXPORT_STRATEGY="single_rank"), rank=0, world_size=2)
    assert not telemetry.recorder_active()
    assert telemetry.recorder_dump("request") == 0
    telemetry.shutdown()
    telemetry.setup(make_settings(ENABLED="0", RECORDER_GROUPS="all"), rank=0, world_size=2)
    assert not telemetry.recorder_active()


@pytest.mark.parametrize("spec", ["nonsense", "layer,-"])
def test_bad_recorder_spec_is_a_settings_error(make_settings, spec):
    from mlaunch.settings import SettingsError

    with pytest.raises(SettingsError):
        make_settings(RECORDER_GROUPS=spec)


def test_recorded_span_costs_little_on_the_training_thread(make_settings, tmp_path):
    """A smoke bound only (no timing threshold): the recorded path must not be the SDK path.
    The number itself is measured by benchmarks/span_overhead.py."""
    settings = make_settings(EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="all")
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    telemetry.set_iteration(1)

    def one() -> None:
        with telemetry.span(G.LAYER, "megatron.layer.forward"):
            pass

    timeit.timeit(one, number=1000)
    assert len(_recorder.RECORDER.current) == 1000
