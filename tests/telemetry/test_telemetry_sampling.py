# ruff: noqa: SIM117 - nested with-blocks mirror the span tree under test
"""Which ranks export (strategies) and which spans are kept (samplers, composed)."""

from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from telemetry_helpers import read_trace_file

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr
from mlaunch.model.spans import SpanName as S
from mlaunch.model.strategies import rank_sampled
from mlaunch.rundir import layout as lay
from mlaunch.telemetry.samplers import build_sampler


def _exporting(
    make_settings, tmp_path, world: int, local_per_node: int | None = None, **env: str
) -> list[int]:
    out = []
    for rank in range(world):
        local = rank % local_per_node if local_per_node else rank
        handle = telemetry.setup(
            make_settings(**env), rank=rank, world_size=world, local_rank=local, run_dir=tmp_path
        )
        if handle.exporting:
            assert handle.enabled_groups and telemetry.is_enabled(G.JOB)
            out.append(rank)
        else:
            assert handle.enabled_groups == frozenset() and not telemetry.is_enabled(G.JOB)
        telemetry.shutdown()
    return out


def test_sampled_strategy_world_8_rate_0_1_exports_ranks_3_5_6(make_settings, tmp_path):
    assert _exporting(
        make_settings, tmp_path, 8, EXPORT_STRATEGY="sampled", EXPORT_SAMPLE_RATE="0.1"
    ) == [3, 5, 6]


@pytest.mark.parametrize(
    ("env", "local_per_node", "expected"),
    [
        ({"EXPORT_STRATEGY": "single_rank"}, None, [3]),
        ({"EXPORT_STRATEGY": "single_rank", "EXPORT_RANK": "1"}, None, [1]),
        ({"EXPORT_STRATEGY": "all_ranks"}, None, [0, 1, 2, 3]),
        ({"EXPORT_STRATEGY": "first_rank_per_node"}, 2, [0, 2]),
    ],
)
def test_builtin_strategies_choose_the_exporting_ranks(
    make_settings, tmp_path, env, local_per_node, expected
):
    assert _exporting(make_settings, tmp_path, 4, local_per_node, **env) == expected


def test_non_exporting_ranks_write_nothing(make_settings, tmp_path):
    _exporting(make_settings, tmp_path, 4, EXPORT_STRATEGY="single_rank")
    assert not lay.traces_file(tmp_path, 0).exists()


def test_composed_sampler_keeps_a_span_only_when_both_keep_it():
    rng = random.Random(7)
    trace_ids = [rng.getrandbits(128) for _ in range(400)]
    ratio = TraceIdRatioBased(0.3)
    for rank in range(8):
        sampler = build_sampler(
            rank=rank,
            traces_sampler="traceidratio",
            traces_sampler_arg=0.3,
            rank_aware=True,
            sample_rate=0.5,
        )
        for tid in trace_ids:
            got = sampler.should_sample(None, tid, "x").decision.is_sampled()
            want = (
                rank_sampled(rank, 0.5)
                and ratio.should_sample(None, tid, "x").decision.is_sampled()
            )
            assert got == want


@pytest.mark.parametrize(
    ("name", "arg", "kept"),
    [
        ("always_on", None, True),
        ("always_off", None, False),
        ("parentbased_always_off", None, False),
        (None, None, True),
    ],
)
def test_trace_sampler_names(name, arg, kept):
    sampler = build_sampler(
        rank=0, traces_sampler=name, traces_sampler_arg=arg, rank_aware=False, sample_rate=1.0
    )
    assert sampler.should_sample(None, 12345, "x").decision.is_sampled() is kept


def _sampled_iterations(make_settings, tmp_path, rank: int, **env: str) -> set[int]:
    settings = make_settings(SPAN_GROUPS="step,layer", TRACE_SEGMENT_ITERS="1", **env)
    telemetry.setup(settings, rank=rank, world_size=8, run_dir=tmp_path)
    for it in range(40):
        telemetry.set_iteration(it)
        with telemetry.span(G.STEP, S.ITERATION, **{Attr.ITERATION: it}):  # noqa: SIM117
            with telemetry.span(G.LAYER, S.LAYER_FORWARD, **{Attr.ITERATION: it}):
                pass
    telemetry.shutdown()
    path = lay.traces_file(tmp_path, rank)
    spans = read_trace_file(tmp_path, rank) if path.exists() else []
    steps = {s["attributes"][Attr.ITERATION] for s in spans if s["name"] == S.ITERATION}
    layers = {s["attributes"][Attr.ITERATION] for s in spans if s["name"] == S.LAYER_FORWARD}
    assert steps == layers  # fine children follow their coarse root's decision
    return steps


def test_ratio_sampling_keeps_the_same_steps_on_every_rank_and_composes_with_rank_aware(
    make_settings, tmp_path
):
    env = {
        "SAMPLER_ENABLED": "1",
        "EXPORT_SAMPLE_RATE": "0.1",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    kept3 = _sampled_iterations(make_settings, tmp_path, 3, **env)
    kept5 = _sampled_iterations(make_settings, tmp_path, 5, **env)
    dropped0 = _sampled_iterations(make_settings, tmp_path, 0, **env)  # rank 0 is not under 0.1
    assert not rank_sampled(0, 0.1) and rank_sampled(3, 0.1)
    assert kept3 == kept5
    assert 0 < len(kept3) < 40  # some steps dropped by the ratio, the same ones on both ranks
    assert dropped0 == set()
