"""The span-group model: presets are pinned exactly, the catalogue is consistent."""

from __future__ import annotations

import pytest

from mlaunch.model import CATALOGUE, GROUPS, PRESETS, SPANS, SpanGroup, span_def
from mlaunch.model.groups import FINE_GRAINED_GROUPS, GOODPUT_GROUPS, REFERENCE_PRESETS
from mlaunch.model.spans import (
    ALIASES,
    GOODPUT_SPAN_NAMES,
    STEP_SPAN,
    canonical_name,
    effective_parent,
    estimate_spans_per_iteration,
)

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


#: The spans Megatron-LM's code emits, written out: code name -> (group, documented alias, is_goodput_span).
MEGATRON_CODE_SPANS: dict[str, tuple[str, str | None, bool]] = {
    "megatron.startup": ("job", None, True),
    # backdated by training.py from the entry point's stamps (mlaunch's trainer emits none)
    "pre_startup": ("job", None, True),
    "megatron.startup.launch_script": ("job", None, True),
    "megatron.startup.container_load": ("job", None, True),
    "megatron.startup.imports": ("job", None, True),
    "megatron.startup.arg_parse": ("job", None, True),
    "megatron.startup.inprocess_setup": ("job", None, True),
    "megatron.startup.in_job_setup": ("job", None, True),
    "megatron.startup.initialize_megatron": ("job", None, True),
    "megatron.startup.jit_fusion_options": ("job", None, True),
    "megatron.startup.model_init": ("model_init", "megatron.model_init", True),
    "megatron.startup.dataloader": ("data_loading", "megatron.data.setup", True),
    "megatron.checkpoint.load": ("load_checkpoint", "megatron.load_checkpoint", True),
    "megatron.checkpoint.load.io_read": ("load_checkpoint", "megatron.load_checkpoint.io_read", True),
    "megatron.train": ("job", None, True),
    "megatron.train.first_iteration": ("first_iteration", "megatron.first_iteration", True),
    "megatron.train.iteration": ("step", "megatron.train_step", True),
    "megatron.train.iteration.forward_backward": ("forward_backward", "megatron.forward_backward", True),
    "megatron.train.iteration.optimizer": ("optimizer", "megatron.optimizer_step", True),
    "megatron.checkpoint.save": ("checkpoint", "megatron.save_checkpoint", True),
    "megatron.checkpoint.save.state_dict": ("checkpoint", "megatron.save_checkpoint.state_dict", True),
    "megatron.checkpoint.save.io_write": ("checkpoint", "megatron.save_checkpoint.io_write", True),
    "megatron.evaluate": ("evaluate", None, False),
    "megatron.evaluate.step": ("evaluate", None, False),
    "megatron.microbatch.forward": ("microbatch", None, False),
    "megatron.microbatch.backward": ("microbatch", None, False),
    "megatron.layer.forward": ("layer", None, False),
    "megatron.layer.self_attention": ("layer", None, False),
    "megatron.layer.mlp": ("layer", None, False),
    "megatron.p2p.recv_forward": ("communication", None, False),
    "megatron.p2p.recv_backward": ("communication", None, False),
    "megatron.p2p.send_forward": ("communication", None, False),
    "megatron.p2p.send_backward": ("communication", None, False),
    "megatron.grad_sync.start": ("communication", None, False),
    "megatron.grad_sync.finish": ("communication", None, False),
    "megatron.activation.offload": ("activation_offload", None, False),
    "megatron.activation.reload": ("activation_offload", None, False),
}  # fmt: skip
#: mlaunch's extras: Megatron-LM's code emits none of them.
EXTRAS = {
    "megatron.pp.recv_forward.linked", "megatron.data.get_batch", "text_completion",
    "megatron.region",
}  # fmt: skip


def test_catalogue_is_megatron_code_names_plus_the_marked_extras() -> None:
    for d in CATALOGUE:
        if d.extra:
            assert d.name in EXTRAS and d.alias is None and not d.goodput, d.name
            continue
        group, alias, goodput = MEGATRON_CODE_SPANS[d.name]
        assert (d.group.value, d.alias, d.is_goodput) == (group, alias, goodput), d.name
    assert {d.name for d in CATALOGUE if not d.extra} == set(MEGATRON_CODE_SPANS)
    assert {d.name for d in CATALOGUE if d.extra} == EXTRAS


def test_documented_names_are_aliases_every_reader_resolves() -> None:
    for code, (_, alias, _) in MEGATRON_CODE_SPANS.items():
        if alias:
            assert ALIASES[alias] == code and canonical_name(alias) == code
            assert span_def(alias) is span_def(code)
    assert "megatron.pretrain" not in SPANS and canonical_name("megatron.pretrain") == (
        "megatron.pretrain"
    )
    assert STEP_SPAN == "megatron.train.iteration"


def test_megatron_attributes_and_mlaunch_extra_attributes() -> None:
    assert SPANS["megatron.train.iteration"].attributes == (
        "megatron.iteration",
        "megatron.skipped",
    )
    assert SPANS["megatron.train.iteration"].extra_attributes == (
        "megatron.loss",
        "megatron.grad_norm",
    )
    assert SPANS["megatron.train.iteration.forward_backward"].attributes == ("num_microbatches",)
    assert SPANS["megatron.train.iteration.optimizer"].attributes == ("megatron.update_successful",)
    assert SPANS["megatron.startup"].attributes == ("megatron.model_type",)
    assert SPANS["megatron.checkpoint.save"].attributes == ("megatron.iteration",)
    assert SPANS["megatron.evaluate.step"].attributes == ("megatron.eval_iteration",)


def test_templated_span_names_map_to_their_definition() -> None:
    assert span_def("text_completion tiny-gpt").group is SpanGroup.INFERENCE
    assert span_def("megatron.region.save.rename").group is SpanGroup.TRACE_REGION
    with pytest.raises(KeyError):
        span_def("megatron.nope")


def test_a_span_whose_parent_is_off_attaches_to_the_nearest_enabled_ancestor() -> None:
    enabled = PRESETS["default"] | {SpanGroup.MICROBATCH}
    assert effective_parent("megatron.microbatch.forward", enabled) == "megatron.train"
    assert effective_parent("megatron.train.iteration", PRESETS["per_step"]) == "megatron.train"
    assert effective_parent("megatron.startup.model_init", frozenset()) is None
    assert effective_parent("megatron.layer.forward", frozenset({SpanGroup.LAYER})) is None


def test_goodput_spans_are_flagged() -> None:
    assert SPANS["megatron.train.iteration"].is_goodput
    assert not SPANS["megatron.evaluate"].is_goodput
    assert not SPANS["megatron.data.get_batch"].is_goodput  # an extra: Megatron marks nothing
    assert {n for n, (_, _, g) in MEGATRON_CODE_SPANS.items() if g} == GOODPUT_SPAN_NAMES


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
