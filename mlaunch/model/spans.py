"""The span catalogue: every span mlaunch's trainer emits, under the name Megatron-LM's code
emits (its code, not its documentation), with its group, parent, repetition, attributes,
``is_goodput_span`` mark, documented alias and whether it is an mlaunch extra; the one alias
table every trace reader uses; plus the attribute, resource and metric names (the SLURM resource
attributes: :mod:`.identity`); and the spans-per-iteration estimate.

This is the single source that the trainer, the CLI tree view, the trace readers and the contract
tests all use; no other module emits or matches a span by a ``megatron.*`` name spelled as a
literal (a message may quote one).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mlaunch.model.groups import SpanGroup
from mlaunch.model.segments import TRACE_SEGMENTS


class SpanName(StrEnum):
    """Span names as Megatron-LM's code emits them (a contract: dashboards built on real
    Megatron-LM runs rely on them). The documented names of Megatron-LM's docs, which older
    mlaunch traces carry, are :class:`LegacyName`; :data:`ALIASES` maps them here."""

    STARTUP = "megatron.startup"
    # Megatron-LM's backdated start-up phases (its code emits them, mlaunch's trainer does not:
    # ``SpanDef.megatron_only``): from SLURM_JOB_START_TIME and the launch stamps
    # (envcontract.LAUNCH_SCRIPT_*_TIME) to the worker's first line, then its own set-up.
    # ``pre_startup`` is the root of a trace of its own, the others children of the start-up.
    PRE_STARTUP = "pre_startup"
    STARTUP_LAUNCH_SCRIPT = "megatron.startup.launch_script"
    STARTUP_CONTAINER_LOAD = "megatron.startup.container_load"
    STARTUP_IMPORTS = "megatron.startup.imports"
    STARTUP_ARG_PARSE = "megatron.startup.arg_parse"
    STARTUP_INPROCESS_SETUP = "megatron.startup.inprocess_setup"
    STARTUP_IN_JOB_SETUP = "megatron.startup.in_job_setup"
    STARTUP_INITIALIZE_MEGATRON = "megatron.startup.initialize_megatron"
    STARTUP_JIT_FUSION_OPTIONS = "megatron.startup.jit_fusion_options"
    MODEL_INIT = "megatron.startup.model_init"
    DATALOADER = "megatron.startup.dataloader"
    CHECKPOINT_LOAD = "megatron.checkpoint.load"
    CHECKPOINT_LOAD_IO_READ = "megatron.checkpoint.load.io_read"
    TRAIN = "megatron.train"
    FIRST_ITERATION = "megatron.train.first_iteration"
    ITERATION = "megatron.train.iteration"
    GET_BATCH = "megatron.data.get_batch"
    FORWARD_BACKWARD = "megatron.train.iteration.forward_backward"
    MICROBATCH_FORWARD = "megatron.microbatch.forward"
    LAYER_FORWARD = "megatron.layer.forward"
    LAYER_SELF_ATTENTION = "megatron.layer.self_attention"
    LAYER_MLP = "megatron.layer.mlp"
    MICROBATCH_BACKWARD = "megatron.microbatch.backward"
    PP_RECV_FORWARD_LINKED = "megatron.pp.recv_forward.linked"
    P2P_RECV_FORWARD = "megatron.p2p.recv_forward"
    P2P_SEND_FORWARD = "megatron.p2p.send_forward"
    P2P_RECV_BACKWARD = "megatron.p2p.recv_backward"
    P2P_SEND_BACKWARD = "megatron.p2p.send_backward"
    ACTIVATION_OFFLOAD = "megatron.activation.offload"
    ACTIVATION_RELOAD = "megatron.activation.reload"
    GRAD_SYNC_START = "megatron.grad_sync.start"
    GRAD_SYNC_FINISH = "megatron.grad_sync.finish"
    OPTIMIZER = "megatron.train.iteration.optimizer"
    CHECKPOINT_SAVE = "megatron.checkpoint.save"
    CHECKPOINT_SAVE_STATE_DICT = "megatron.checkpoint.save.state_dict"
    CHECKPOINT_SAVE_IO_WRITE = "megatron.checkpoint.save.io_write"
    EVALUATE = "megatron.evaluate"
    EVALUATE_STEP = "megatron.evaluate.step"
    TEXT_COMPLETION = "text_completion"  # full name is "text_completion <model>"
    REGION = "megatron.region"  # full name is "megatron.region.<name>"
    # The launcher's job trace (``mlaunch train`` itself, not a worker): a root span for the whole
    # invocation and one child per torchrun attempt. It outlives any worker, so a SIGKILLed rank
    # cannot take the run-long view with it.
    JOB = "mlaunch.job"
    JOB_ATTEMPT = "mlaunch.job.attempt"


class LegacyName(StrEnum):
    """The names of Megatron-LM's documentation (which differ from what its code emits), which
    mlaunch's trainer emitted until it switched to the code names. Readers accept them; nothing
    emits them any more."""

    PRETRAIN = "megatron.pretrain"  # a run-long umbrella; Megatron-LM's code has none
    MODEL_INIT = "megatron.model_init"
    DATA_SETUP = "megatron.data.setup"
    LOAD_CHECKPOINT = "megatron.load_checkpoint"
    LOAD_CHECKPOINT_IO_READ = "megatron.load_checkpoint.io_read"
    FIRST_ITERATION = "megatron.first_iteration"
    TRAIN_STEP = "megatron.train_step"
    FORWARD_BACKWARD = "megatron.forward_backward"
    OPTIMIZER_STEP = "megatron.optimizer_step"
    SAVE_CHECKPOINT = "megatron.save_checkpoint"
    SAVE_CHECKPOINT_STATE_DICT = "megatron.save_checkpoint.state_dict"
    SAVE_CHECKPOINT_IO_WRITE = "megatron.save_checkpoint.io_write"


def text_completion_name(model: str) -> str:
    """The GenAI span name for a completion request: ``text_completion <model>``."""
    return f"{SpanName.TEXT_COMPLETION.value} {model}"


def region_name(name: str) -> str:
    """The span name of a ``trace_region(name)`` marker: ``megatron.region.<name>``."""
    return f"{SpanName.REGION.value}.{name}"


class Attr(StrEnum):
    """Span attribute keys."""

    MODEL_TYPE = "megatron.model_type"
    ITERATION = "megatron.iteration"
    LOSS = "megatron.loss"
    GRAD_NORM = "megatron.grad_norm"
    SKIPPED = "megatron.skipped"
    NUM_MICROBATCHES = "num_microbatches"  # no prefix: what Megatron-LM's code sets
    MICROBATCH_ID = "megatron.microbatch_id"
    LAYER_NUMBER = "megatron.layer_number"
    PP_RANK = "dl.pipeline_parallel.rank"
    DL_MICROBATCH_ID = "dl.microbatch_id"
    UPDATE_SUCCESSFUL = "megatron.update_successful"
    EVAL_ITERS = "megatron.eval_iters"
    EVAL_ITERATION = "megatron.eval_iteration"
    GEN_AI_OPERATION = "gen_ai.operation.name"
    GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
    GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    IS_GOODPUT = "is_goodput_span"
    TRUNCATED = "nemo.span.truncated"  # what nemo-lens sets on spans ended at shutdown
    LEGACY_TRUNCATED = "mlaunch.span.truncated"  # older mlaunch traces; readers accept both
    #: On a span the flight recorder wrote out: why (one of :data:`RECORDER_TRIGGERS`).
    RECORDER_TRIGGER = "mlaunch.recorder.trigger"
    #: On a recorded span written while still open (the parent of what a dump holds, e.g. the
    #: ``megatron.train`` block of a rank that exports nothing): its end is the dump's time.
    RECORDER_OPEN = "mlaunch.recorder.open"
    #: On a span the flight recorder wrote out: which of its rank's dumps (0, 1, ...), so a
    #: reader can tell two dumps of consecutive iterations apart.
    RECORDER_DUMP = "mlaunch.recorder.dump"
    #: On a span a live capture added (``mlaunch trace capture --groups``): the capture's id.
    CAPTURE_ID = "mlaunch.capture.id"
    TRAIN_BLOCK = "mlaunch.train.block"  # on megatron.train: the block number (an mlaunch extra)
    # On the launcher's mlaunch.job.attempt spans.
    ATTEMPT = "mlaunch.attempt"  # 0 for the first torchrun attempt, +1 per restart
    EXIT_CODE = "mlaunch.exit_code"  # the attempt's exit code (absent when ended by a signal)
    SIGNAL = "mlaunch.signal"  # e.g. "SIGKILL" when a worker or the attempt died by a signal
    FAILED_RANK = "mlaunch.failed_rank"  # the first failing global rank, when one is known
    HANG = "mlaunch.hang"  # true on an attempt the hang watchdog declared hung


#: Attribute keys that mark a span as ended at shutdown, the current one first.
TRUNCATED_ATTRS: tuple[str, ...] = (Attr.TRUNCATED.value, Attr.LEGACY_TRUNCATED.value)


class ResourceAttr(StrEnum):
    """Resource attribute keys set on every span and metric of a rank."""

    SERVICE_NAME = "service.name"
    SERVICE_VERSION = "service.version"
    SERVICE_INSTANCE_ID = "service.instance.id"
    RUN_ID = "nemo.run.id"
    USER_ID = "nemo.user.id"
    RANK = "dl.rank"
    WORLD_SIZE = "dl.world_size"
    LOCAL_RANK = "dl.local_rank"
    NODE_RANK = "dl.node_rank"  # on the launcher's job trace (one launcher per node)
    RESTART_COUNT = "dl.restart_count"
    TP_SIZE = "dl.tensor_parallel.size"
    PP_SIZE = "dl.pipeline_parallel.size"
    DP_SIZE = "dl.data_parallel.size"
    TP_RANK = "dl.tensor_parallel.rank"
    PP_RANK = "dl.pipeline_parallel.rank"
    DP_RANK = "dl.data_parallel.rank"
    BATCH_SIZE = "dl.batch_size"
    SEQUENCE_LENGTH = "dl.sequence_length"
    NUM_LAYERS = "megatron.num_layers"
    HIDDEN_SIZE = "megatron.hidden_size"
    NUM_ATTENTION_HEADS = "megatron.num_attention_heads"
    TRAIN_ITERS = "megatron.train_iters"
    MICRO_BATCH_SIZE = "megatron.micro_batch_size"
    CKPT_FORMAT = "megatron.ckpt_format"
    PRECISION = "megatron.precision"
    HOST_NAME = "host.name"
    PROCESS_PID = "process.pid"
    GPU_COUNT = "host.gpu.count"
    # The accelerator a rank drives, as Megatron-LM reads it from NVML (CUDA ranks only).
    GPU_INDEX = "dl.gpu.index"
    GPU_NAME = "dl.gpu.name"
    GPU_UUID = "dl.gpu.uuid"
    GPU_SERIAL = "dl.gpu.serial"
    GPU_PCI_BUS_ID = "dl.gpu.pci_bus_id"


#: Kubernetes variable (downward API / conventional names) -> resource attribute.
K8S_RESOURCE_ATTRS: dict[str, str] = {
    "POD_NAMESPACE": "k8s.namespace.name",
    "K8S_NAMESPACE": "k8s.namespace.name",
    "POD_NAME": "k8s.pod.name",
    "K8S_POD_NAME": "k8s.pod.name",
    "NODE_NAME": "k8s.node.name",
    "K8S_NODE_NAME": "k8s.node.name",
    "POD_UID": "k8s.pod.uid",
    "K8S_POD_UID": "k8s.pod.uid",
    "CONTAINER_NAME": "k8s.container.name",
}


@dataclass(frozen=True, slots=True)
class MetricDef:
    """One metric instrument an exporting rank records every log interval."""

    name: str
    kind: str  # "histogram" | "gauge" | "counter"
    unit: str
    description: str


class Metric(StrEnum):
    """Metric instrument names."""

    STEP_DURATION_MS = "megatron.training.step_duration_ms"
    LOSS = "megatron.training.loss"
    GRAD_NORM = "megatron.training.grad_norm"
    LEARNING_RATE = "megatron.training.learning_rate"
    TOKENS_PER_SEC = "megatron.training.tokens_per_sec"
    THROUGHPUT_TFLOPS = "megatron.training.throughput_tflops"
    SKIPPED_ITERS = "megatron.training.skipped_iters"
    MEMORY_ALLOCATED_GB = "megatron.training.memory_allocated_gb"


#: Megatron-LM's instruments as it creates them (``megatron/training/training_metrics.py``): only
#: the step duration has a unit. A unit is part of the name a Prometheus backend gives a metric
#: (``ms`` -> ``_milliseconds``, ``1`` on a gauge -> ``_ratio``), and the Grafana dashboard Lens
#: ships for Megatron queries ``megatron_training_loss``, not ``megatron_training_loss_ratio``.
METRICS: tuple[MetricDef, ...] = (
    MetricDef(Metric.STEP_DURATION_MS, "histogram", "ms", "Duration of one training iteration"),
    MetricDef(Metric.LOSS, "gauge", "", "Training loss (language-model cross entropy)"),
    MetricDef(Metric.GRAD_NORM, "gauge", "", "Global gradient norm before clipping"),
    MetricDef(Metric.LEARNING_RATE, "gauge", "", "Learning rate of the last iteration"),
    MetricDef(Metric.TOKENS_PER_SEC, "gauge", "", "Training throughput in tokens per second"),
    MetricDef(Metric.THROUGHPUT_TFLOPS, "gauge", "", "Model TFLOP/s per rank"),
    MetricDef(Metric.SKIPPED_ITERS, "counter", "", "Iterations skipped (non-finite grads)"),
    MetricDef(Metric.MEMORY_ALLOCATED_GB, "gauge", "", "Peak accelerator memory allocated, GB"),
)


class Repeat(StrEnum):
    """How often a span occurs."""

    ONCE = "once"  # once per worker incarnation (start-up) or per train block's first pass
    BLOCK = "block"  # once per megatron.train block (save_interval iterations)
    ITERATION = "iteration"  # once per training iteration
    MICROBATCH = "microbatch"  # N per iteration
    LAYER = "layer"  # N x L(stage) per iteration
    SAVE = "save"  # once per checkpoint save
    EVAL = "eval"  # once per evaluation pass
    EVAL_STEP = "eval_step"  # eval_iters per evaluation pass
    REQUEST = "request"  # per generation request
    REGION = "region"  # trace_region markers, on request


class Stages(StrEnum):
    """Which pipeline stages emit a span."""

    ALL = "all"
    NOT_FIRST = "not_first"
    NOT_LAST = "not_last"


@dataclass(frozen=True, slots=True)
class SpanDef:
    """A span of the contract: its group, parent, repetition, attributes and stage filter.

    ``name`` is what Megatron-LM's code emits (and mlaunch's trainer emits); ``alias`` is the
    documented name where that differs; ``attributes`` are Megatron-LM's, ``extra_attributes``
    the ones mlaunch adds; ``goodput`` says whether the span carries ``is_goodput_span=true``
    (Megatron-LM's own choice per span)."""

    name: str
    group: SpanGroup
    parent: str | None
    repeat: Repeat
    attributes: tuple[str, ...] = ()
    stages: Stages = Stages.ALL
    note: str = ""
    extra: bool = False
    """An mlaunch extra: Megatron-LM's code emits nothing like it (a Megatron-LM worker never will)."""
    alias: str | None = None
    """The documented name (Megatron-LM's docs) where the code emits another; readers accept both."""
    extra_attributes: tuple[str, ...] = ()
    """Attributes mlaunch sets beyond Megatron-LM's (never on a Megatron-LM worker's spans)."""
    goodput: bool = False
    megatron_only: bool = False
    """Megatron-LM's code emits it and mlaunch's trainer does not: the start-up phases Megatron-LM
    backdates from its entry point's timestamps (readers and the announced names know them)."""

    @property
    def is_goodput(self) -> bool:
        """Whether the span carries ``is_goodput_span=true`` (as Megatron-LM marks it)."""
        return self.goodput

    @property
    def all_attributes(self) -> tuple[str, ...]:
        """Megatron-LM's attributes and mlaunch's extras."""
        return self.attributes + self.extra_attributes


G = SpanGroup
S = SpanName
L = LegacyName
A = Attr
R = Repeat
_X = True  # readability: extra=_X / goodput=_X in the table below

#: The span trees the trainer emits, in display order (a parent always precedes its children).
#: Two roots per worker: ``megatron.startup`` (once per incarnation) and ``megatron.train`` (one
#: per block, each a trace of its own: :data:`~mlaunch.model.segments.TRACE_SEGMENTS`).
CATALOGUE: tuple[SpanDef, ...] = (
    SpanDef(S.STARTUP, G.JOB, None, R.ONCE, (A.MODEL_TYPE,), goodput=_X,
            note="root of its own trace, one per worker incarnation"),
    SpanDef(S.PRE_STARTUP, G.JOB, None, R.ONCE, goodput=_X, megatron_only=_X,
            note="backdated: SLURM_JOB_START_TIME to the launch, a trace of its own"),
    SpanDef(S.STARTUP_LAUNCH_SCRIPT, G.JOB, S.STARTUP, R.ONCE, goodput=_X, megatron_only=_X,
            note="backdated: the launch to the launcher starting the workers"),
    SpanDef(S.STARTUP_CONTAINER_LOAD, G.JOB, S.STARTUP, R.ONCE, goodput=_X, megatron_only=_X,
            note="backdated: to the worker's first line"),
    SpanDef(S.STARTUP_IMPORTS, G.JOB, S.STARTUP, R.ONCE, goodput=_X, megatron_only=_X),
    SpanDef(S.STARTUP_ARG_PARSE, G.JOB, S.STARTUP, R.ONCE, goodput=_X, megatron_only=_X),
    SpanDef(S.STARTUP_INPROCESS_SETUP, G.JOB, S.STARTUP, R.ONCE, goodput=_X, megatron_only=_X),
    SpanDef(S.STARTUP_IN_JOB_SETUP, G.JOB, S.STARTUP, R.ONCE, goodput=_X, megatron_only=_X),
    SpanDef(S.STARTUP_INITIALIZE_MEGATRON, G.JOB, S.STARTUP, R.ONCE, goodput=_X,
            megatron_only=_X),
    SpanDef(S.STARTUP_JIT_FUSION_OPTIONS, G.JOB, S.STARTUP, R.ONCE, goodput=_X,
            megatron_only=_X),
    SpanDef(S.MODEL_INIT, G.MODEL_INIT, S.STARTUP, R.ONCE, alias=L.MODEL_INIT, goodput=_X),
    SpanDef(S.DATALOADER, G.DATA_LOADING, S.STARTUP, R.ONCE, alias=L.DATA_SETUP, goodput=_X),
    SpanDef(S.CHECKPOINT_LOAD, G.LOAD_CHECKPOINT, S.STARTUP, R.ONCE, (A.ITERATION,),
            note="on resume", alias=L.LOAD_CHECKPOINT, goodput=_X),
    SpanDef(S.CHECKPOINT_LOAD_IO_READ, G.LOAD_CHECKPOINT, S.CHECKPOINT_LOAD, R.ONCE,
            alias=L.LOAD_CHECKPOINT_IO_READ, goodput=_X),
    SpanDef(S.TRAIN, G.JOB, None, R.BLOCK, extra_attributes=(A.TRAIN_BLOCK,), goodput=_X,
            note=f"each block the root of a trace, linked to the previous one. {TRACE_SEGMENTS}"),
    SpanDef(S.FIRST_ITERATION, G.FIRST_ITERATION, S.TRAIN, R.ONCE, (A.ITERATION,),
            alias=L.FIRST_ITERATION, goodput=_X,
            note="wraps the first iteration this process runs"),
    SpanDef(S.ITERATION, G.STEP, S.TRAIN, R.ITERATION, (A.ITERATION, A.SKIPPED),
            extra_attributes=(A.LOSS, A.GRAD_NORM), alias=L.TRAIN_STEP, goodput=_X),
    SpanDef(S.GET_BATCH, G.DATA_LOADING, S.ITERATION, R.ITERATION, extra=_X),
    SpanDef(S.FORWARD_BACKWARD, G.FORWARD_BACKWARD, S.ITERATION, R.ITERATION,
            (A.NUM_MICROBATCHES,), alias=L.FORWARD_BACKWARD, goodput=_X),
    SpanDef(S.MICROBATCH_FORWARD, G.MICROBATCH, S.FORWARD_BACKWARD, R.MICROBATCH,
            extra_attributes=(A.MICROBATCH_ID,)),
    SpanDef(S.LAYER_FORWARD, G.LAYER, S.MICROBATCH_FORWARD, R.LAYER, (A.LAYER_NUMBER,)),
    SpanDef(S.LAYER_SELF_ATTENTION, G.LAYER, S.LAYER_FORWARD, R.LAYER),
    SpanDef(S.LAYER_MLP, G.LAYER, S.LAYER_FORWARD, R.LAYER),
    SpanDef(S.MICROBATCH_BACKWARD, G.MICROBATCH, S.FORWARD_BACKWARD, R.MICROBATCH,
            extra_attributes=(A.MICROBATCH_ID,)),
    SpanDef(S.PP_RECV_FORWARD_LINKED, G.COMMUNICATION, S.FORWARD_BACKWARD, R.MICROBATCH,
            (A.PP_RANK, A.DL_MICROBATCH_ID), Stages.NOT_FIRST,
            "PP>1; links to the sender's send_forward", extra=_X),
    SpanDef(S.P2P_RECV_FORWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, R.MICROBATCH, (), Stages.NOT_FIRST, "PP>1"),
    SpanDef(S.P2P_SEND_FORWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, R.MICROBATCH, (), Stages.NOT_LAST, "PP>1"),
    SpanDef(S.P2P_RECV_BACKWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, R.MICROBATCH, (), Stages.NOT_LAST, "PP>1"),
    SpanDef(S.P2P_SEND_BACKWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, R.MICROBATCH, (), Stages.NOT_FIRST, "PP>1"),
    SpanDef(S.ACTIVATION_OFFLOAD, G.ACTIVATION_OFFLOAD, S.FORWARD_BACKWARD, R.MICROBATCH, note="--offload-activations"),
    SpanDef(S.ACTIVATION_RELOAD, G.ACTIVATION_OFFLOAD, S.FORWARD_BACKWARD, R.MICROBATCH, note="--offload-activations"),
    SpanDef(S.GRAD_SYNC_START, G.COMMUNICATION, S.ITERATION, R.ITERATION, note="DP>1"),
    SpanDef(S.GRAD_SYNC_FINISH, G.COMMUNICATION, S.ITERATION, R.ITERATION, note="DP>1"),
    SpanDef(S.OPTIMIZER, G.OPTIMIZER, S.ITERATION, R.ITERATION, (A.UPDATE_SUCCESSFUL,),
            extra_attributes=(A.GRAD_NORM,), alias=L.OPTIMIZER_STEP, goodput=_X),
    SpanDef(S.CHECKPOINT_SAVE, G.CHECKPOINT, S.TRAIN, R.SAVE, (A.ITERATION,),
            alias=L.SAVE_CHECKPOINT, goodput=_X),
    SpanDef(S.CHECKPOINT_SAVE_STATE_DICT, G.CHECKPOINT, S.CHECKPOINT_SAVE, R.SAVE,
            alias=L.SAVE_CHECKPOINT_STATE_DICT, goodput=_X),
    SpanDef(S.CHECKPOINT_SAVE_IO_WRITE, G.CHECKPOINT, S.CHECKPOINT_SAVE, R.SAVE,
            alias=L.SAVE_CHECKPOINT_IO_WRITE, goodput=_X),
    SpanDef(S.EVALUATE, G.EVALUATE, S.TRAIN, R.EVAL, (A.EVAL_ITERS,)),
    SpanDef(S.EVALUATE_STEP, G.EVALUATE, S.EVALUATE, R.EVAL_STEP, (A.EVAL_ITERATION,)),
    SpanDef(
        S.TEXT_COMPLETION, G.INFERENCE, None, R.REQUEST,
        (A.GEN_AI_OPERATION, A.GEN_AI_REQUEST_MODEL, A.GEN_AI_INPUT_TOKENS, A.GEN_AI_OUTPUT_TOKENS),
        note="named 'text_completion <model>'", extra=_X,
    ),
    SpanDef(S.REGION, G.TRACE_REGION, None, R.REGION, extra=_X,
            note="'megatron.region.<name>' inside checkpoint save/load and data setup"),
)  # fmt: skip

SPANS: dict[str, SpanDef] = {d.name: d for d in CATALOGUE}

#: The one alias table every reader uses: a documented (legacy) name -> the code name emitted now.
#: ``megatron.pretrain`` has no code counterpart (a run-long span Megatron-LM removed); readers
#: treat it as a legacy job span in its own right.
ALIASES: dict[str, str] = {str(d.alias): str(d.name) for d in CATALOGUE if d.alias}

#: Names of the spans that carry ``is_goodput_span=true``.
GOODPUT_SPAN_NAMES: frozenset[str] = frozenset(str(d.name) for d in CATALOGUE if d.goodput)

#: Megatron-LM's step span: the one every per-step reader (summary skew, goodput, report) keys on.
STEP_SPAN: str = SpanName.ITERATION.value


def canonical_name(name: str) -> str:
    """The code name for ``name``: itself, or what a documented (legacy) alias stands for."""
    return ALIASES.get(name, name)


def names_for(name: str) -> frozenset[str]:
    """Every name a reader accepts for the code name ``name``: itself and its documented alias."""
    d = SPANS.get(name)
    return frozenset({name, d.alias} if d is not None and d.alias else {name})


def span_def(name: str) -> SpanDef:
    """The catalogue entry for a span name (a code name or its documented alias), including the
    templated ``text_completion <model>`` and ``megatron.region.<name>`` forms."""
    name = ALIASES.get(name, name)
    if name in SPANS:
        return SPANS[name]
    if name.startswith(SpanName.TEXT_COMPLETION.value + " "):
        return SPANS[SpanName.TEXT_COMPLETION]
    if name.startswith(SpanName.REGION.value + "."):
        return SPANS[SpanName.REGION]
    raise KeyError(name)


def effective_parent(name: str, enabled: frozenset[SpanGroup] | set[SpanGroup]) -> str | None:
    """The nearest enabled ancestor a span attaches to when its own parent's group is off."""
    parent = SPANS[name].parent
    while parent is not None and SPANS[parent].group not in enabled:
        parent = SPANS[parent].parent
    return parent


def _stage_emits(d: SpanDef, stage: int, pp: int) -> bool:
    if d.stages is Stages.NOT_FIRST:
        return stage > 0
    if d.stages is Stages.NOT_LAST:
        return stage < pp - 1
    return True


def estimate_spans_per_iteration(
    enabled: frozenset[SpanGroup] | set[SpanGroup],
    *,
    microbatches: int = 1,
    layers: int = 1,
    pp: int = 1,
    dp: int = 1,
    offload: bool = False,
) -> list[int]:
    """Spans per training iteration and exporting rank, for each pipeline stage (index = stage).

    One iteration is its ``megatron.train.iteration`` span and everything beneath it (with the
    step group off: what would be beneath it), the same in every iteration, the first included;
    what hangs outside every iteration is not counted: start-up, the block root, the first
    iteration's ``megatron.train.first_iteration`` wrapper, checkpoint saves, evaluations.
    Layers are split evenly across stages. Checked against real runs'
    traces (tests/integration/test_spans_per_iteration.py).
    """
    layers_per_stage = max(1, layers // max(1, pp))
    per_repeat = {
        Repeat.ITERATION: 1,
        Repeat.MICROBATCH: microbatches,
        Repeat.LAYER: microbatches * layers_per_stage,
    }
    out: list[int] = []
    for stage in range(pp):
        total = 0
        for d in CATALOGUE:
            if d.group not in enabled or d.repeat not in per_repeat:
                continue
            if not _stage_emits(d, stage, pp):
                continue
            if d.group is SpanGroup.ACTIVATION_OFFLOAD and not offload:
                continue
            if d.name in (SpanName.GRAD_SYNC_START, SpanName.GRAD_SYNC_FINISH) and dp <= 1:
                continue
            total += per_repeat[d.repeat]
        out.append(total)
    return out


#: Why the flight recorder wrote its rings out (``mlaunch.recorder.trigger``).
RECORDER_TRIGGERS: tuple[str, ...] = ("slow_iteration", "exception", "signal", "hang", "request")
