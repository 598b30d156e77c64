"""The span groups and presets: the one definition every other module derives from.

Names and preset contents match Megatron-LM's ``MegatronSpanGroup`` (nemo-lens) exactly, plus
mlaunch's ``goodput`` preset. Adding a group is one edit to ``GROUPS`` (and the presets that
should include it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class SpanGroup(StrEnum):
    """A span group. Members are ``str``, so they compare and hash like their names."""

    JOB = "job"
    CHECKPOINT = "checkpoint"
    EVALUATE = "evaluate"
    MODEL_INIT = "model_init"
    LOAD_CHECKPOINT = "load_checkpoint"
    STEP = "step"
    FORWARD_BACKWARD = "forward_backward"
    OPTIMIZER = "optimizer"
    MICROBATCH = "microbatch"
    LAYER = "layer"
    COMMUNICATION = "communication"
    ACTIVATION_OFFLOAD = "activation_offload"
    DATA_LOADING = "data_loading"
    FIRST_ITERATION = "first_iteration"
    TRACE_REGION = "trace_region"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What a group covers, how often its spans occur, and the colour that draws it."""

    group: SpanGroup
    description: str
    frequency: str
    #: The group's colour in ``mlaunch trace report`` (categorical, readable on white).
    colour: str


GROUPS: dict[SpanGroup, GroupInfo] = {
    info.group: info
    for info in (
        GroupInfo(
            SpanGroup.JOB,
            "start-up and the training blocks: megatron.startup, megatron.train "
            "(the launcher's job trace covers the whole run)",
            "start-up once per worker start, then one block per trace (see trace segments)",
            colour="#9e9e9e",
        ),
        GroupInfo(SpanGroup.CHECKPOINT, "saving checkpoints", "every save", colour="#8c564b"),
        GroupInfo(
            SpanGroup.EVALUATE,
            "evaluation passes and their steps",
            "every eval interval",
            colour="#e377c2",
        ),
        GroupInfo(
            SpanGroup.MODEL_INIT, "building the model and optimizer", "once", colour="#bcbd22"
        ),
        GroupInfo(
            SpanGroup.LOAD_CHECKPOINT, "loading a checkpoint (resume)", "once", colour="#c49c94"
        ),
        GroupInfo(SpanGroup.STEP, "one training iteration", "every iteration", colour="#1f77b4"),
        GroupInfo(
            SpanGroup.FORWARD_BACKWARD,
            "the forward/backward pass of one iteration",
            "every iteration",
            colour="#6baed6",
        ),
        GroupInfo(SpanGroup.OPTIMIZER, "the optimizer step", "every iteration", colour="#ff7f0e"),
        GroupInfo(
            SpanGroup.MICROBATCH,
            "forward and backward of each microbatch",
            "N per iteration",
            colour="#2ca02c",
        ),
        GroupInfo(
            SpanGroup.LAYER,
            "each transformer layer's forward, with attention/MLP breakdown",
            "N x L per iteration",
            colour="#98df8a",
        ),
        GroupInfo(
            SpanGroup.COMMUNICATION,
            "pipeline P2P send/recv, gradient all-reduce, linked cross-stage spans",
            "several per iteration",
            colour="#d62728",
        ),
        GroupInfo(
            SpanGroup.ACTIVATION_OFFLOAD,
            "GPU<->CPU activation offload and reload",
            "per microbatch",
            colour="#ffbb78",
        ),
        GroupInfo(
            SpanGroup.DATA_LOADING,
            "data pipeline setup and batch fetching",
            "per iteration",
            colour="#9467bd",
        ),
        GroupInfo(
            SpanGroup.FIRST_ITERATION,
            "the first iteration this process executes (after a resume too): warm-up cost",
            "once",
            colour="#17becf",
        ),
        GroupInfo(
            SpanGroup.TRACE_REGION,
            "fine sub-phase markers inside checkpoint save/load and data setup",
            "many, only on request",
            colour="#c5b0d5",
        ),
        GroupInfo(
            SpanGroup.INFERENCE,
            "text-generation requests (GenAI semantic conventions)",
            "per request",
            colour="#f7b6d2",
        ),
    )
}

ALL_GROUPS: frozenset[SpanGroup] = frozenset(SpanGroup)

_DEFAULT = frozenset(
    {
        SpanGroup.JOB,
        SpanGroup.CHECKPOINT,
        SpanGroup.EVALUATE,
        SpanGroup.FIRST_ITERATION,
        SpanGroup.INFERENCE,
    }
)
_PER_STEP = _DEFAULT | {
    SpanGroup.MODEL_INIT,
    SpanGroup.LOAD_CHECKPOINT,
    SpanGroup.STEP,
    SpanGroup.FORWARD_BACKWARD,
    SpanGroup.OPTIMIZER,
    SpanGroup.COMMUNICATION,
    SpanGroup.DATA_LOADING,
}

#: The ``goodput`` preset (mlaunch's): the groups goodput accounting reads. Which spans carry
#: ``is_goodput_span`` is Megatron-LM's choice per span (``SpanDef.goodput``), not this set.
GOODPUT_GROUPS: frozenset[SpanGroup] = frozenset(
    {
        SpanGroup.JOB,
        SpanGroup.CHECKPOINT,
        SpanGroup.MODEL_INIT,
        SpanGroup.LOAD_CHECKPOINT,
        SpanGroup.STEP,
        SpanGroup.DATA_LOADING,
        SpanGroup.FIRST_ITERATION,
    }
)

#: Preset name -> its exact group set (the same sets as Megatron-LM's presets).
PRESETS: dict[str, frozenset[SpanGroup]] = {
    "default": _DEFAULT,
    "per_step": _PER_STEP,
    "all": ALL_GROUPS,
    "profiling": ALL_GROUPS,
    "goodput": GOODPUT_GROUPS,
}

#: Presets that Megatron-LM / nemo-lens know; ``goodput`` is mlaunch's own.
REFERENCE_PRESETS: frozenset[str] = frozenset({"default", "per_step", "all", "profiling"})

#: Groups whose spans are frequent enough to go through the cheap recording path.
FINE_GRAINED_GROUPS: frozenset[SpanGroup] = frozenset(
    {
        SpanGroup.MICROBATCH,
        SpanGroup.LAYER,
        SpanGroup.COMMUNICATION,
        SpanGroup.ACTIVATION_OFFLOAD,
        SpanGroup.TRACE_REGION,
    }
)
