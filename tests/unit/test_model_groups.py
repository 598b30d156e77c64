"""The span-group model: presets are pinned exactly, the catalogue is consistent."""

from __future__ import annotations

import pytest

from mlaunch.model import CATALOGUE, GROUPS, PRESETS, SPANS, SpanGroup, span_def
from mlaunch.model.groups import FINE_GRAINED_GROUPS, GOODPUT_GROUPS, REFERENCE_PRESETS
from mlaunch.model.spans import effective_parent, estimate_spans_per_iteration

DEFAULT = {"job", "checkpoint", "evaluate", "first_iteration", "inference"}
PER_STEP = DEFAULT | {
    "model_init", "load_checkpoint", "step", "forward_backward", "optimizer",
    "communication", "data_loading",
}  # fmt: skip
ALL = {
    "job", "checkpoint", "evaluate", "model_init", "load_checkpoint", "step",
    "forward_backward", "optimizer", "microbatch", "layer", "communication",
    "activation_offload", "data_loading", "first_iteration", "trace_region", "inference",
}  # fmt: skip
GOODPUT = {
    "job", "checkpoint", "model_init", "load_checkpoint", "step", "data_loading",
    "first_iteration",
}  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("default", DEFAULT),
        ("per_step", PER_STEP),
        ("all", ALL),
        ("profiling", ALL),
        ("goodput", GOODPUT),
    ],
)
def test_every_preset_has_exactly_the_spec_groups(preset: str, expected: set[str]) -> None:
    assert {g.value for g in PRESETS[preset]} == expected


def test_there_are_sixteen_groups_each_described() -> None:
    assert len(SpanGroup) == 16
    assert set(GROUPS) == set(SpanGroup)
    for info in GROUPS.values():
        assert info.description and info.frequency


def test_fine_grained_groups_are_only_in_all() -> None:
    assert {
        SpanGroup.MICROBATCH, SpanGroup.LAYER, SpanGroup.COMMUNICATION,
        SpanGroup.ACTIVATION_OFFLOAD, SpanGroup.TRACE_REGION,
    } == FINE_GRAINED_GROUPS  # fmt: skip
    for only_in_all in ("microbatch", "layer", "activation_offload", "trace_region"):
        owners = {name for name, members in PRESETS.items() if only_in_all in members}
        assert owners == {"all", "profiling"}


def test_reference_presets_exclude_goodput() -> None:
    assert {"default", "per_step", "all", "profiling"} == REFERENCE_PRESETS
    assert PRESETS["goodput"] == GOODPUT_GROUPS


def test_catalogue_parents_precede_children_and_exist() -> None:
    seen: set[str] = set()
    for d in CATALOGUE:
        assert d.parent is None or d.parent in seen, d.name
        seen.add(d.name)
    assert len(SPANS) == len(CATALOGUE)


def test_catalogue_has_every_spec_span() -> None:
    names = {d.name for d in CATALOGUE}
    for name in (
        "megatron.pretrain",
        "megatron.train",
        "megatron.train_step",
        "megatron.forward_backward",
        "megatron.microbatch.forward",
        "megatron.layer.forward",
        "megatron.layer.self_attention",
        "megatron.layer.mlp",
        "megatron.pp.recv_forward.linked",
        "megatron.grad_sync.start",
        "megatron.optimizer_step",
        "megatron.save_checkpoint.io_write",
        "megatron.evaluate.step",
        "megatron.load_checkpoint.io_read",
        "megatron.first_iteration",
        "megatron.data.get_batch",
    ):
        assert name in names


def test_templated_span_names_map_to_their_definition() -> None:
    assert span_def("text_completion tiny-gpt").group is SpanGroup.INFERENCE
    assert span_def("megatron.region.save.rename").group is SpanGroup.TRACE_REGION
    with pytest.raises(KeyError):
        span_def("megatron.nope")


def test_a_span_whose_parent_is_off_attaches_to_the_nearest_enabled_ancestor() -> None:
    enabled = PRESETS["default"] | {SpanGroup.MICROBATCH}
    assert effective_parent("megatron.microbatch.forward", enabled) == "megatron.train"
    assert effective_parent("megatron.train_step", PRESETS["per_step"]) == "megatron.train"
    assert effective_parent("megatron.layer.forward", frozenset({SpanGroup.LAYER})) is None


def test_goodput_spans_are_flagged() -> None:
    assert SPANS["megatron.train_step"].is_goodput
    assert not SPANS["megatron.evaluate"].is_goodput


def test_estimate_counts_microbatch_and_layer_spans_per_stage() -> None:
    # per_step, 1 stage, DP 1: train_step, get_batch, forward_backward, optimizer_step.
    assert estimate_spans_per_iteration(PRESETS["per_step"], microbatches=4, layers=4) == [4]
    # all, 2 stages of 2 layers, 4 microbatches, DP 2, per stage:
    #   per iteration: train_step, get_batch, forward_backward, grad_sync x2, optimizer = 6
    #   microbatch forward + backward: 2 x 4 = 8;  layer, attention, mlp: 3 x 4 x 2 = 24
    #   P2P: stage 0 send_forward + recv_backward (2 x 4); stage 1 recv_forward, the linked
    #   span and send_backward (3 x 4).
    per_stage = estimate_spans_per_iteration(PRESETS["all"], microbatches=4, layers=4, pp=2, dp=2)
    assert per_stage == [38 + 8, 38 + 12]
