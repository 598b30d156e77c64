"""The span catalogue: every span mlaunch's trainer emits (SPEC section 4), with its group, parent,
repetition and attributes, plus the attribute, resource and metric names.

This is the single source that the trainer, the CLI tree view, the trace readers and the contract
tests all use; no other module spells a ``megatron.*`` name as a literal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mlaunch.model.groups import GOODPUT_GROUPS, SpanGroup


class SpanName(StrEnum):
    """Span names (a contract: dashboards built for Megatron-LM rely on them)."""

    PRETRAIN = "megatron.pretrain"
    MODEL_INIT = "megatron.model_init"
    DATA_SETUP = "megatron.data.setup"
    LOAD_CHECKPOINT = "megatron.load_checkpoint"
    LOAD_CHECKPOINT_IO_READ = "megatron.load_checkpoint.io_read"
    TRAIN = "megatron.train"
    FIRST_ITERATION = "megatron.first_iteration"
    TRAIN_STEP = "megatron.train_step"
    GET_BATCH = "megatron.data.get_batch"
    FORWARD_BACKWARD = "megatron.forward_backward"
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
    OPTIMIZER_STEP = "megatron.optimizer_step"
    SAVE_CHECKPOINT = "megatron.save_checkpoint"
    SAVE_CHECKPOINT_STATE_DICT = "megatron.save_checkpoint.state_dict"
    SAVE_CHECKPOINT_IO_WRITE = "megatron.save_checkpoint.io_write"
    EVALUATE = "megatron.evaluate"
    EVALUATE_STEP = "megatron.evaluate.step"
    TEXT_COMPLETION = "text_completion"  # full name is "text_completion <model>"
    REGION = "megatron.region"  # full name is "megatron.region.<name>"
    # The launcher's job trace (``mlaunch train`` itself, not a worker): a root span for the whole
    # invocation and one child per torchrun attempt. It outlives any worker, so a SIGKILLed rank
    # cannot take the run-long view with it.
    JOB = "mlaunch.job"
    JOB_ATTEMPT = "mlaunch.job.attempt"


def text_completion_name(model: str) -> str:
    """The GenAI span name for a completion request: ``text_completion <model>``."""
    return f"{SpanName.TEXT_COMPLETION.value} {model}"


def region_name(name: str) -> str:
    """The span name of a ``trace_region(name)`` marker: ``megatron.region.<name>``."""
    return f"{SpanName.REGION.value}.{name}"


class Attr(StrEnum):
    """Span attribute keys."""

    MODEL_TYPE = "megatron.model_type"
    TRAIN_ITERS = "megatron.train_iters"
    GLOBAL_BATCH_SIZE = "megatron.global_batch_size"
    ITERATION = "megatron.iteration"
    LOSS = "megatron.loss"
    GRAD_NORM = "megatron.grad_norm"
    SKIPPED = "megatron.skipped"
    NUM_MICROBATCHES = "megatron.num_microbatches"
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
    TRUNCATED = "mlaunch.span.truncated"
    TRACE_SEGMENT = "mlaunch.trace.segment"  # on re-rooted megatron.train spans (trace segments)
    # On the launcher's mlaunch.job.attempt spans.
    ATTEMPT = "mlaunch.attempt"  # 0 for the first torchrun attempt, +1 per restart
    EXIT_CODE = "mlaunch.exit_code"  # the attempt's exit code (absent when ended by a signal)
    SIGNAL = "mlaunch.signal"  # e.g. "SIGKILL" when a worker or the attempt died by a signal
    FAILED_RANK = "mlaunch.failed_rank"  # the first failing global rank, when one is known


class ResourceAttr(StrEnum):
    """Resource attribute keys set on every span and metric of a rank (SPEC section 3)."""

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


#: SLURM variable -> resource attribute, set when the variable is present.
SLURM_RESOURCE_ATTRS: dict[str, str] = {
    "SLURM_JOB_ID": "slurm.job.id",
    "SLURM_JOB_NAME": "slurm.job.name",
    "SLURM_JOB_NODELIST": "slurm.nodelist",
    "SLURM_NNODES": "slurm.nnodes",
    "SLURM_NTASKS": "slurm.ntasks",
    "SLURM_JOB_PARTITION": "slurm.partition",
    "SLURM_CLUSTER_NAME": "slurm.cluster.name",
}

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
    """One metric instrument of SPEC section 5."""

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


METRICS: tuple[MetricDef, ...] = (
    MetricDef(Metric.STEP_DURATION_MS, "histogram", "ms", "Duration of one training iteration"),
    MetricDef(Metric.LOSS, "gauge", "1", "Training loss (language-model cross entropy)"),
    MetricDef(Metric.GRAD_NORM, "gauge", "1", "Global gradient norm before clipping"),
    MetricDef(Metric.LEARNING_RATE, "gauge", "1", "Learning rate of the last iteration"),
    MetricDef(Metric.TOKENS_PER_SEC, "gauge", "{token}/s", "Training throughput in tokens"),
    MetricDef(Metric.THROUGHPUT_TFLOPS, "gauge", "TFLOP/s", "Model FLOPs per second, per rank"),
    MetricDef(
        Metric.SKIPPED_ITERS, "counter", "{iteration}", "Iterations skipped (non-finite grads)"
    ),
    MetricDef(Metric.MEMORY_ALLOCATED_GB, "gauge", "GiBy", "Accelerator memory allocated"),
)


class Repeat(StrEnum):
    """How often a span occurs."""

    ONCE = "once"  # once per job (or per resume)
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
    """A span of the contract: its group, parent, repetition, attributes and stage filter."""

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

    @property
    def is_goodput(self) -> bool:
        """Spans of the ``goodput`` preset's groups carry ``is_goodput_span=true``."""
        return self.group in GOODPUT_GROUPS


G = SpanGroup
S = SpanName
A = Attr

#: The span tree of SPEC section 4, in display order (a parent always precedes its children).
CATALOGUE: tuple[SpanDef, ...] = (
    SpanDef(S.PRETRAIN, G.JOB, None, Repeat.ONCE, (A.MODEL_TYPE, A.TRAIN_ITERS, A.GLOBAL_BATCH_SIZE)),
    SpanDef(S.MODEL_INIT, G.MODEL_INIT, S.PRETRAIN, Repeat.ONCE),
    SpanDef(S.DATA_SETUP, G.DATA_LOADING, S.PRETRAIN, Repeat.ONCE),
    SpanDef(S.LOAD_CHECKPOINT, G.LOAD_CHECKPOINT, S.PRETRAIN, Repeat.ONCE, (A.ITERATION,), note="on resume"),
    SpanDef(S.LOAD_CHECKPOINT_IO_READ, G.LOAD_CHECKPOINT, S.LOAD_CHECKPOINT, Repeat.ONCE),
    SpanDef(S.TRAIN, G.JOB, S.PRETRAIN, Repeat.ONCE, (A.TRAIN_ITERS,)),
    SpanDef(S.FIRST_ITERATION, G.FIRST_ITERATION, S.TRAIN, Repeat.ONCE, (A.ITERATION,)),
    SpanDef(
        S.TRAIN_STEP, G.STEP, S.TRAIN, Repeat.ITERATION,
        (A.ITERATION, A.LOSS, A.GRAD_NORM, A.SKIPPED),
    ),
    SpanDef(S.GET_BATCH, G.DATA_LOADING, S.TRAIN_STEP, Repeat.ITERATION),
    SpanDef(S.FORWARD_BACKWARD, G.FORWARD_BACKWARD, S.TRAIN_STEP, Repeat.ITERATION, (A.NUM_MICROBATCHES,)),
    SpanDef(S.MICROBATCH_FORWARD, G.MICROBATCH, S.FORWARD_BACKWARD, Repeat.MICROBATCH, (A.MICROBATCH_ID,)),
    SpanDef(S.LAYER_FORWARD, G.LAYER, S.MICROBATCH_FORWARD, Repeat.LAYER, (A.LAYER_NUMBER,)),
    SpanDef(S.LAYER_SELF_ATTENTION, G.LAYER, S.LAYER_FORWARD, Repeat.LAYER),
    SpanDef(S.LAYER_MLP, G.LAYER, S.LAYER_FORWARD, Repeat.LAYER),
    SpanDef(S.MICROBATCH_BACKWARD, G.MICROBATCH, S.FORWARD_BACKWARD, Repeat.MICROBATCH, (A.MICROBATCH_ID,)),
    SpanDef(
        S.PP_RECV_FORWARD_LINKED, G.COMMUNICATION, S.FORWARD_BACKWARD, Repeat.MICROBATCH,
        (A.PP_RANK, A.DL_MICROBATCH_ID), Stages.NOT_FIRST, "PP>1; links to the sender's send_forward",
    ),
    SpanDef(S.P2P_RECV_FORWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, Repeat.MICROBATCH, (), Stages.NOT_FIRST, "PP>1"),
    SpanDef(S.P2P_SEND_FORWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, Repeat.MICROBATCH, (), Stages.NOT_LAST, "PP>1"),
    SpanDef(S.P2P_RECV_BACKWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, Repeat.MICROBATCH, (), Stages.NOT_LAST, "PP>1"),
    SpanDef(S.P2P_SEND_BACKWARD, G.COMMUNICATION, S.FORWARD_BACKWARD, Repeat.MICROBATCH, (), Stages.NOT_FIRST, "PP>1"),
    SpanDef(S.ACTIVATION_OFFLOAD, G.ACTIVATION_OFFLOAD, S.FORWARD_BACKWARD, Repeat.MICROBATCH, note="--offload-activations"),
    SpanDef(S.ACTIVATION_RELOAD, G.ACTIVATION_OFFLOAD, S.FORWARD_BACKWARD, Repeat.MICROBATCH, note="--offload-activations"),
    SpanDef(S.GRAD_SYNC_START, G.COMMUNICATION, S.TRAIN_STEP, Repeat.ITERATION, note="DP>1"),
    SpanDef(S.GRAD_SYNC_FINISH, G.COMMUNICATION, S.TRAIN_STEP, Repeat.ITERATION, note="DP>1"),
    SpanDef(S.OPTIMIZER_STEP, G.OPTIMIZER, S.TRAIN_STEP, Repeat.ITERATION, (A.GRAD_NORM, A.UPDATE_SUCCESSFUL)),
    SpanDef(S.SAVE_CHECKPOINT, G.CHECKPOINT, S.TRAIN, Repeat.SAVE, (A.ITERATION,)),
    SpanDef(S.SAVE_CHECKPOINT_STATE_DICT, G.CHECKPOINT, S.SAVE_CHECKPOINT, Repeat.SAVE),
    SpanDef(S.SAVE_CHECKPOINT_IO_WRITE, G.CHECKPOINT, S.SAVE_CHECKPOINT, Repeat.SAVE),
    SpanDef(S.EVALUATE, G.EVALUATE, S.TRAIN, Repeat.EVAL, (A.EVAL_ITERS,)),
    SpanDef(S.EVALUATE_STEP, G.EVALUATE, S.EVALUATE, Repeat.EVAL_STEP, (A.EVAL_ITERATION,)),
    SpanDef(
        S.TEXT_COMPLETION, G.INFERENCE, None, Repeat.REQUEST,
        (A.GEN_AI_OPERATION, A.GEN_AI_REQUEST_MODEL, A.GEN_AI_INPUT_TOKENS, A.GEN_AI_OUTPUT_TOKENS),
        note="named 'text_completion <model>'",
    ),
    SpanDef(S.REGION, G.TRACE_REGION, None, Repeat.REGION, note="'megatron.region.<name>' inside checkpoint save/load and data setup"),
)  # fmt: skip

SPANS: dict[str, SpanDef] = {d.name: d for d in CATALOGUE}


def span_def(name: str) -> SpanDef:
    """The catalogue entry for a span name, including the templated ``text_completion <model>``
    and ``megatron.region.<name>`` forms."""
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
    """Estimated spans per training iteration for each pipeline stage (index = stage).

    Counts the steady-state spans only (one-off spans like ``megatron.pretrain`` and per-save or
    per-eval spans are excluded). Layers are split evenly across stages.
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
