"""The schema: one pydantic section per configuration area and the whole :class:`Settings`.
Every setting is defined here once; the checks between sections are :mod:`.checks`."""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mlaunch.model.groups import SpanGroup
from mlaunch.model.segments import DEFAULT_SEGMENT_ITERS, TRACE_SEGMENTS
from mlaunch.model.spec import closest_word, quoted, resolve
from mlaunch.model.strategies import exporting_ranks, load_strategy
from mlaunch.settings.args import Arg, NotPassed
from mlaunch.settings.names import flag_name
from mlaunch.settings.problems import UnknownName
from mlaunch.settings.run_id import is_run_id
from mlaunch.settings.values import (
    Bool,
    check_url,
    module_problem,
    not_blank,
    parse_key_values,
    path_is,
)

TRACE_SAMPLERS: tuple[str, ...] = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
#: Text settings whose value is a name from a list (validated by the field): ``--help`` lists
#: the names (Literal fields list theirs already).
CHOICES: dict[str, tuple[str, ...]] = {"telemetry.otel.traces_sampler": TRACE_SAMPLERS}
RATIO_SAMPLERS: frozenset[str] = frozenset({"traceidratio", "parentbased_traceidratio"})
OTLP_PROTOCOLS: tuple[str, ...] = ("grpc", "http/protobuf", "http/json")
#: What ``OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_PROTOCOL`` may say (nemo-lens and the SDK take all
#: three; the Python SDK's HTTP exporter always encodes protobuf, whichever HTTP one is named).
Protocol = Literal["grpc", "http/protobuf", "http/json"]
EXPORTERS: tuple[str, ...] = ("otlp", "console", "file", "none")
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"


#: The integer range an OpenTelemetry attribute holds (int64).
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


class _Section(BaseModel):
    # Attribute docstrings are each setting's help (`mlaunch train --help`): read by
    # :func:`attribute_docs` when the CLI builds its options, not by pydantic at class creation
    # (use_attribute_docstrings), which every worker and CLI process would pay (it finds and parses
    # each class's source: about 0.06 CPU-s a process) for text only the CLI shows.
    # allow_inf_nan=False: "inf" parses as a float and passes every lower bound (``--lr inf``).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, v: Any) -> Any:
        # Settings become span/resource attributes; OTel encodes integers as int64, and a larger
        # one fails in every exporter (a stderr full of encoding tracebacks), so refuse it here.
        if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(
                f"{v} does not fit in 64 bits (OpenTelemetry attributes are int64: at most"
                f" {INT64_MAX:,})"
            )
        return v


def attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> its attribute docstring (the string right under the field), cleaned as
    pydantic's ``use_attribute_docstrings`` cleans it; a subclass's docstring wins."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        docs.update(_class_docs().get(cls.__qualname__, {}))
    return docs


#: Texts defined once elsewhere that a docstring names by ``{NAME}`` instead of restating them.
_DOC_TEXTS = {"{TRACE_SEGMENTS}": TRACE_SEGMENTS}


@functools.cache
def _class_docs() -> dict[str, dict[str, str]]:
    """Class name -> field docstrings, of every class in this file (one parse, on first use)."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(Path(__file__).read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = out[node.name] = {}
        for before, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(before, ast.AnnAssign)
                and isinstance(before.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                text = inspect.cleandoc(after.value.value)
                for name, value in _DOC_TEXTS.items():
                    text = text.replace(name, value)
                docs[before.target.id] = text
    return out


class OtelSettings(_Section):
    """The standard OpenTelemetry variables, validated (the SDK would only warn)."""

    traces_sampler: str | None = None
    """``OTEL_TRACES_SAMPLER``: the sampler (the SDK's default is parentbased_always_on)."""
    traces_sampler_arg: float | None = None
    """``OTEL_TRACES_SAMPLER_ARG``: the ratio in [0,1] for the ratio samplers."""
    base_endpoint: str | None = None
    """``OTEL_EXPORTER_OTLP_ENDPOINT``: base URL for every signal."""
    traces_endpoint: str | None = None
    """``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: full traces URL (wins over the base)."""
    metrics_endpoint_override: str | None = None
    """``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``: full metrics URL (wins over the base)."""
    base_protocol: Protocol = "grpc"
    """``OTEL_EXPORTER_OTLP_PROTOCOL``: grpc (default), http/protobuf or http/json (scripts only)."""
    traces_protocol: Protocol | None = None
    """``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: wins over the base protocol for traces."""
    metrics_protocol_override: Protocol | None = None
    """``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``: wins over the base protocol for metrics."""
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    """``OTEL_EXPORTER_OTLP_HEADERS``: a secret (authentication tokens); redacted in output."""
    timeout_s: float | None = Field(default=None, gt=0)
    """``OTEL_EXPORTER_OTLP_TIMEOUT``: export timeout in SECONDS (the Python SDK reads seconds)."""
    certificate: str | None = None
    """``OTEL_EXPORTER_OTLP_CERTIFICATE``: CA bundle for TLS."""
    insecure: Bool | None = None
    """``OTEL_EXPORTER_OTLP_INSECURE``: plaintext gRPC even for non-localhost endpoints."""
    resource_attributes: dict[str, str] = Field(default_factory=dict)
    """``OTEL_RESOURCE_ATTRIBUTES``: extra resource attributes."""
    metric_export_interval_ms: int | None = Field(default=None, gt=0)
    """``OTEL_METRIC_EXPORT_INTERVAL``: metric export period in milliseconds."""
    sdk_disabled: Bool = False
    """``OTEL_SDK_DISABLED``: turns every SDK signal into a no-op."""

    @field_validator("traces_sampler", mode="before")
    @classmethod
    def _sampler(cls, v: Any) -> Any:
        if v is None:
            return None
        name = str(v).strip().lower()
        if name not in TRACE_SAMPLERS:
            close = closest_word(name, TRACE_SAMPLERS)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise UnknownName(
                f"unknown sampler {v!r}{hint}; use one of {', '.join(TRACE_SAMPLERS)}", close
            )
        return name

    @field_validator("traces_sampler_arg", mode="before")
    @classmethod
    def _sampler_arg(cls, v: Any) -> Any:
        if v is None:
            return None
        try:
            ratio = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"expected a ratio in [0, 1], got {v!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"expected a ratio in [0, 1], got {v!r}")
        return ratio

    @field_validator("base_protocol", "traces_protocol", "metrics_protocol_override", mode="before")
    @classmethod
    def _protocol(cls, v: Any) -> Any:
        if v is None:
            return None
        name = str(v).strip().lower()
        if name not in OTLP_PROTOCOLS:
            raise ValueError(f"unknown OTLP protocol {v!r}; use {', '.join(OTLP_PROTOCOLS)}")
        return name

    @field_validator("base_endpoint", "traces_endpoint", "metrics_endpoint_override")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return check_url(v)

    @field_validator("headers", mode="before")
    @classmethod
    def _headers(cls, v: Any) -> Any:
        return parse_key_values(v, "header", secret=True) if v is not None else {}

    @field_validator("resource_attributes", mode="before")
    @classmethod
    def _resource(cls, v: Any) -> Any:
        return parse_key_values(v, "resource attribute") if v is not None else {}

    @property
    def protocol(self) -> Protocol:
        """The effective traces protocol (per-signal variable wins)."""
        return self.traces_protocol or self.base_protocol

    @property
    def metrics_protocol(self) -> Protocol:
        """The effective metrics protocol."""
        return self.metrics_protocol_override or self.base_protocol

    def _signal_endpoint(self, override: str | None, protocol: str, path: str) -> str:
        if override:
            return override
        if protocol == "grpc":
            return self.base_endpoint or DEFAULT_GRPC_ENDPOINT
        base = (self.base_endpoint or DEFAULT_HTTP_ENDPOINT).rstrip("/")
        return f"{base}/{path}"

    @property
    def endpoint(self) -> str:
        """The effective traces endpoint (full URL; ``/v1/traces`` appended for HTTP)."""
        return self._signal_endpoint(self.traces_endpoint, self.protocol, "v1/traces")

    @property
    def metrics_endpoint(self) -> str:
        """The effective metrics endpoint (full URL; ``/v1/metrics`` appended for HTTP)."""
        return self._signal_endpoint(
            self.metrics_endpoint_override, self.metrics_protocol, "v1/metrics"
        )

    @property
    def endpoint_configured(self) -> bool:
        """Whether the user named an OTLP endpoint at all."""
        return bool(self.base_endpoint or self.traces_endpoint)


class TelemetrySettings(_Section):
    """The ``MEGATRON_OTEL_*`` / ``NEMO_LENS_*`` keys plus the standard OpenTelemetry variables."""

    enabled: Bool = False
    """Master switch (``ENABLED``)."""
    span_groups: str = "default"
    """Span-group spec (``SPAN_GROUPS``): presets and groups, comma separated, ``-x`` excludes."""
    export_strategy: str = "single_rank"
    """Which ranks export (``EXPORT_STRATEGY``, alias ``RANK_STRATEGY``)."""
    export_rank: int = Field(default=-1, ge=-1)
    """The exporting rank for ``single_rank``; -1 = the last rank."""
    export_sample_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of ranks kept by ``sampled`` and by the rank-aware sampler, in [0, 1]."""
    sampler_enabled: Bool = False
    """Install the rank-aware sampler (``SAMPLER_ENABLED``, alias ``SAMPLING_STRATEGY=rank_aware``)."""
    traces_enabled: Bool = True
    """Export traces."""
    metrics_enabled: Bool = True
    """Export metrics."""
    logs_enabled: Bool = False
    """Bridge Python logging to OTel logs."""
    exporter: Literal["otlp", "console", "file", "none"] | None = None
    """Where telemetry goes; unset = ``otlp`` when an OTLP endpoint is configured, else ``file``.
    An endpoint you set (flag or variable) wins over a shipped config's exporter."""
    run_id: str | None = None
    """Shared by every rank of a run; unset = SLURM_JOB_ID, else a fresh 12-hex-digit id."""
    user_id: str = ""
    """``nemo.user.id`` resource attribute."""
    service_name: str = "megatron-lm"
    """``service.name`` (``--otel-service-name``, ``OTEL_SERVICE_NAME``)."""
    shutdown_timeout_s: float = Field(default=5.0, gt=0, le=600)
    """Hard deadline for flushing telemetry at shutdown (mlaunch key ``SHUTDOWN_TIMEOUT``)."""
    trace_segment_iters: int = Field(default=DEFAULT_SEGMENT_ITERS, ge=1)
    """{TRACE_SEGMENTS}"""
    recorder_groups: str = ""
    """Flight-recorder span-group spec (``RECORDER_GROUPS``): every rank keeps the spans of these
    groups that it does not export in memory and writes them out on a trigger; empty = off."""
    recorder_iters: int = Field(default=20, ge=1, le=100_000)
    """The flight recorder keeps this many last iterations."""
    recorder_max_mib: float = Field(default=64.0, gt=0, le=65_536)
    """The flight recorder's memory bound per rank, MiB (oldest iterations go first)."""
    recorder_slow_factor: float = Field(default=2.0, gt=1.0, le=1000)
    """An iteration slower than this many times the rolling median dumps the recorder."""
    otel: OtelSettings = Field(default_factory=OtelSettings)
    """The standard ``OTEL_*`` variables."""

    _groups: frozenset[SpanGroup] = PrivateAttr(default=frozenset())
    _recorder_groups: frozenset[SpanGroup] = PrivateAttr(default=frozenset())

    # SpanSpecError and StrategyError are ValueErrors with a ``suggestion``: pydantic keeps the
    # error itself, and the problem it becomes carries that word (like UnknownName's).
    @field_validator("span_groups", "recorder_groups")
    @classmethod
    def _spec(cls, v: str) -> str:
        resolve(v)
        return v

    @field_validator("export_strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        load_strategy(v)
        return v.strip().lower() if ":" not in v else v.strip()

    @field_validator("service_name")
    @classmethod
    def _service_name(cls, v: str) -> str:
        not_blank(v)  # an empty service.name makes every span of the run unattributable
        return v

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip()
        if not is_run_id(v):
            raise ValueError(
                f"{quoted(v)} is not a valid run id: use 1-128 letters, digits, '.', '_' or '-',"
                " starting with a letter or digit (it names the run directory: a leading '-'"
                " would read as an option, a leading '.' would hide it)"
            )
        return v

    @model_validator(mode="after")
    def _derive(self) -> TelemetrySettings:
        self._groups = resolve(self.span_groups)
        self._recorder_groups = resolve(self.recorder_groups)
        if self.exporter is None:
            self.exporter = "otlp" if self.otel.endpoint_configured else "file"
        return self

    @property
    def groups(self) -> frozenset[SpanGroup]:
        """The resolved span groups."""
        return self._groups

    @property
    def recorder_group_set(self) -> frozenset[SpanGroup]:
        """The resolved flight-recorder groups (empty: no recorder)."""
        return self._recorder_groups


#: The largest world mlaunch plans for: the plan visits every rank (exporting ranks), so an
#: absurd ``--nnodes 99999999999`` would hang the launcher instead of failing.
MAX_WORLD_SIZE = 2**20
#: The most worker processes on one node.
MAX_NPROC_PER_NODE = 1024


#: The words ``hang_timeout`` takes besides a number of seconds.
HANG_TIMEOUT_WORDS: tuple[str, ...] = ("auto", "off")
#: A hang timeout below this would fire between two healthy iterations' progress checks (the
#: launcher looks once a second); above it (a week) is a typo.
HANG_TIMEOUT_MIN_S = 1.0
HANG_TIMEOUT_MAX_S = 7 * 86400.0


class LaunchSettings(_Section):
    """How ``mlaunch train`` starts torchrun."""

    nproc_per_node: int = Field(default=2, ge=1, le=MAX_NPROC_PER_NODE)
    """Worker processes per node (``--nproc-per-node``)."""
    nnodes: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE)
    """Number of nodes."""
    node_rank: int = Field(default=0, ge=0)
    """This node's rank in [0, nnodes)."""
    rdzv_backend: str = "c10d"
    """torchrun rendezvous backend."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous (required for nnodes > 1; a free local port otherwise)."""
    rdzv_id: str | None = None
    """Rendezvous id shared by all nodes (default: the run id)."""
    max_restarts: int = Field(default=0, ge=0)
    """How many times torchrun restarts a failed worker group."""
    run_dir: str | None = None
    """The run directory (default ``runs/<run_id>/`` under the current directory)."""
    script: str | None = None
    """Launch this Python script instead of mlaunch's trainer (e.g. Megatron-LM's pretrain_gpt.py)."""
    module: str | None = None
    """Launch this Python module instead of mlaunch's trainer."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where workers run; ``auto`` = CUDA when available."""
    otlp_relay: Bool | None = None
    """With an OTLP endpoint: workers export to the launcher's local receiver, which forwards to
    the endpoint and spools what it cannot deliver (``mlaunch trace replay`` sends it later).
    Unset = on for ``script``/``module``, off for mlaunch's trainer (it spools by itself)."""
    megatron_args: Bool | None = None
    """For ``script``/``module``: pass the model/training/parallelism settings and Megatron-LM's
    ``--otel-*`` flags as Megatron-LM arguments (false: only the environment and ``-- ARGS``).
    Unset = on only for a Megatron-LM entry point (a ``pretrain_*.py`` script, a script beside a
    ``megatron/`` package, a ``megatron.*`` module); any other script gets none."""
    hang_timeout: str = "auto"
    """Hang watchdog (SECONDS|auto|off): no training progress on this node for this long is a
    hang. ``auto`` = the larger of 300 s and 10x the median time between iterations once 5 have
    run; start-up (before the first iteration of each attempt) has a longer bound."""
    on_hang: Literal["report", "stop"] = "stop"
    """What a hang does: ``report`` writes the verdict and the stacks and lets the job go on;
    ``stop`` also stops the workers (torchrun restarts them while restarts are left)."""
    tee: Bool | None = None
    """Show the workers' stdout and stderr on this launcher's console as they write them, each
    line prefixed with its rank (they always go to the per-rank logs too). Unset = on for
    ``script``/``module``, off for mlaunch's trainer (its live view is the console)."""
    local_ranks_filter: str | None = None
    """Show only these ranks' output on the console (R,R,...): global ranks, as the lines'
    prefix names them (torchrun's flag of this name takes local ones); each node's launcher shows
    those of its own ranks. Turns ``tee`` on unless it is set off."""

    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _hang_timeout(cls, v: Any) -> str:
        text = str(v).strip().lower()
        if text in HANG_TIMEOUT_WORDS:
            return text
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not (HANG_TIMEOUT_MIN_S <= seconds <= HANG_TIMEOUT_MAX_S):
            raise ValueError(
                f"{v!r} is not a hang timeout: use a number of seconds from"
                f" {HANG_TIMEOUT_MIN_S:g} to {HANG_TIMEOUT_MAX_S:g}, auto or off"
            )
        return f"{seconds:g}"

    @property
    def hang_timeout_s(self) -> float | None:
        """The fixed hang timeout in seconds; None for ``auto`` and ``off``."""
        return None if self.hang_timeout in HANG_TIMEOUT_WORDS else float(self.hang_timeout)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return None
        host, sep, port = v.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{v!r} is not host:port (e.g. 127.0.0.1:29500)")
        return v.strip()

    # Checks between fields are field validators on the later field (not a model validator), so
    # the error is labelled with the flag, variable or file key the user typed, not "launch".
    @field_validator("rdzv_backend", "rdzv_id", "run_dir", "module")
    @classmethod
    def _blank(cls, v: str | None) -> str | None:
        return not_blank(v)

    @field_validator("node_rank")
    @classmethod
    def _node_rank(cls, v: int, info: ValidationInfo) -> int:
        nnodes = info.data.get("nnodes")
        if nnodes is not None and v >= nnodes:
            raise ValueError(
                f"node rank {v} must be below the number of nodes {nnodes} (0..{nnodes - 1})"
            )
        return v

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if not_blank(v) is not None and not path_is(Path.is_file, v):
            raise ValueError(f"script {quoted(v)} does not exist or is not a file")
        return v

    @field_validator("module")
    @classmethod
    def _one_entry(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("script"):
            raise ValueError("give either --script or --module, not both")
        if v is not None and (why := module_problem(v.strip(), Path.cwd())) is not None:
            raise ValueError(why)  # checked before launch, as --script's file is
        return v

    @field_validator("local_ranks_filter", mode="before")
    @classmethod
    def _ranks_filter(cls, v: Any, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        items = v if isinstance(v, list | tuple) else str(v).split(",")
        words = [str(item).strip() for item in items]
        bad = [w for w in words if not w.isdecimal()]
        if not words or bad:
            what = f"{bad[0]!r} is not a rank" if bad and bad[0] else "a rank is missing"
            raise ValueError(f"{what}: give global ranks as R[,R...] (e.g. 0 or 0,3)")
        ranks = sorted({int(w) for w in words})
        world = info.data.get("nnodes", 0) * info.data.get("nproc_per_node", 0)
        if world and ranks[-1] >= world:
            raise ValueError(
                f"rank {ranks[-1]} is not in this run: its {world} ranks are 0..{world - 1}"
            )
        if info.data.get("tee") is False:
            raise ValueError("shows ranks on the console, which --no-tee turns off; drop one")
        return ",".join(map(str, ranks))

    @property
    def world_size(self) -> int:
        """Total worker processes."""
        return self.nnodes * self.nproc_per_node

    @property
    def tee_on(self) -> bool:
        """Whether the workers' output reaches the launcher's console (``tee`` resolved: unset is
        on for a script or module, and wherever a ``local_ranks_filter`` is given)."""
        if self.tee is not None:
            return self.tee
        return bool(self.script or self.module) or self.local_ranks_filter is not None

    @property
    def shown_ranks(self) -> frozenset[int] | None:
        """The global ranks ``local_ranks_filter`` names; None: every rank."""
        if self.local_ranks_filter is None:
            return None
        return frozenset(int(r) for r in self.local_ranks_filter.split(","))


class ModelSettings(_Section):
    """The GPT model (Megatron-LM argument names)."""

    num_layers: Annotated[int, Arg("transformer layers")] = Field(default=2, ge=1)
    """Transformer layers."""
    hidden_size: Annotated[int, Arg("model width")] = Field(default=64, ge=1)
    """Hidden size."""
    num_attention_heads: Annotated[int, Arg("attention heads")] = Field(default=4, ge=1)
    """Attention heads (must divide hidden_size)."""
    seq_length: Annotated[int, Arg("tokens per sample")] = Field(default=64, ge=2)
    """Sequence length in tokens."""
    untie_embeddings: Annotated[
        Bool,
        Arg(
            "use a separate LM-head matrix instead of the input embedding (mlaunch)",
            megatron="--untie-embeddings-and-output-weights",
        ),
    ] = False
    """Use a separate LM-head matrix instead of the token embedding."""


class TrainingSettings(_Section):
    """The training run (Megatron-LM argument names)."""

    micro_batch_size: Annotated[int, Arg("samples per microbatch")] = Field(default=2, ge=1)
    """Sequences per microbatch."""
    global_batch_size: Annotated[
        int,
        Arg(
            "samples per iteration = micro batch x microbatches x DP (default: micro x DP)",
            bare_default=None,
        ),
    ] = Field(default=8, ge=1)
    """Sequences per iteration over all data-parallel ranks."""
    train_iters: Annotated[int, Arg("iterations to train in total")] = Field(default=40, ge=1)
    """Iterations to train."""
    lr: Annotated[float, Arg("peak learning rate")] = Field(default=3e-3, gt=0)
    """Peak learning rate."""
    min_lr: Annotated[
        float,
        Arg("final learning rate of the cosine decay"),
    ] = Field(default=3e-4, ge=0)
    """Final learning rate of the cosine schedule."""
    lr_warmup_iters: Annotated[int, Arg("linear warm-up iterations")] = Field(default=5, ge=0)
    """Linear warm-up iterations."""
    weight_decay: Annotated[float, Arg("AdamW weight decay")] = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    clip_grad: Annotated[
        float,
        Arg("global gradient-norm clip (0: off)"),
    ] = Field(default=1.0, ge=0)
    """Gradient-norm clipping (0 = off)."""
    eval_interval: Annotated[int, Arg("iterations between evaluations")] = Field(default=20, ge=0)
    """Evaluate every this many iterations (0 = never)."""
    eval_iters: Annotated[int, Arg("batches per evaluation (0: none)")] = Field(default=2, ge=0)
    """Batches per evaluation."""
    log_interval: Annotated[int, Arg("iterations between log lines")] = Field(default=1, ge=1)
    """Metrics/progress every this many iterations."""
    save: Annotated[
        str | None,
        Arg("directory to save checkpoints to", group="checkpointing"),
    ] = None
    """Checkpoint directory (unset = ``<run_dir>/checkpoints`` when save_interval > 0)."""
    load: Annotated[
        str | None,
        Arg("directory to resume from (latest valid checkpoint)", group="checkpointing"),
    ] = None
    """Checkpoint directory to resume from (default: save, when it holds a checkpoint)."""
    save_interval: Annotated[
        int,
        Arg("iterations between saves", group="checkpointing", bare_default=None),
    ] = Field(default=0, ge=0)
    """Save every this many iterations (0 = only at the end when save is set)."""
    keep_last: Annotated[
        int,
        Arg(
            "keep only the last K checkpoints (0: all; mlaunch)",
            group="checkpointing",
            bare_default=0,
            megatron=None,
        ),
    ] = Field(default=2, ge=1)
    """Checkpoints to keep."""
    # At most 2**32-1 (numpy's limit, Megatron's convention): the trainer seeds torch generators
    # with seed x 1_000_003 + index, which overflows torch's 64-bit seed for huge values.
    seed: Annotated[
        int,
        Arg("seed for weights and data order"),
    ] = Field(default=1234, ge=0, le=2**32 - 1)
    """Random seed, in [0, 2**32-1]."""
    precision: Annotated[
        Literal["fp32", "bf16", "fp16"],
        Arg(
            choices={
                "bf16": "bfloat16 autocast",
                "fp16": "float16 autocast with dynamic loss scaling",
            }
        ),
    ] = "fp32"
    """Training precision (Megatron's --bf16 / --fp16)."""
    data_path: Annotated[
        str | None,
        Arg(
            "text file or folder of text (byte-level tokens); default: Python's stdlib sources",
            group="data",
            megatron_list=True,
        ),
    ] = None
    """mlaunch's trainer: a text file or folder (byte-level tokens; unset = the built-in corpus).
    A Megatron-LM script: its ``--data-path``, dataset prefixes (``.bin``/``.idx`` without the
    suffix), space separated, optionally weighted (``0.3 /a/prefix 0.7 /b/prefix``)."""
    offload_activations: Annotated[
        Bool,
        Arg(
            "move saved activations to CPU after forward and back before backward (mlaunch)",
            megatron=None,
        ),
    ] = False
    """Move saved activations to CPU between forward and backward."""
    sample_tokens: Annotated[
        int,
        Arg(
            "at each evaluation, generate this many tokens as a text completion (mlaunch)",
            megatron=None,
        ),
    ] = Field(default=0, ge=0)
    """Tokens to generate during evaluation (a text_completion span); 0 = off."""

    @field_validator("save", "load")
    @classmethod
    def _blank(cls, v: str | None) -> str | None:
        return not_blank(v)

    @field_validator("data_path")
    @classmethod
    def _data_path(cls, v: str | None) -> str | None:
        # What the value must be depends on the entry point (a text corpus for mlaunch's trainer,
        # Megatron-LM dataset prefixes for a script): checked between sections, in checks.py.
        return not_blank(v)


class ParallelSettings(_Section):
    """Model parallel sizes; data parallel is derived from the world size."""

    tensor_model_parallel_size: Annotated[
        int,
        Arg("accepted for Megatron-LM compatibility; only 1 is supported"),
    ] = Field(default=1, ge=1)
    """Tensor parallel size (mlaunch's trainer supports 1; other scripts may use more)."""
    pipeline_model_parallel_size: Annotated[int, Arg("pipeline stages")] = Field(default=1, ge=1)
    """Pipeline stages."""
    context_parallel_size: Annotated[
        int,
        NotPassed(
            "mlaunch's trainer has none (must be 1); scripts get MEGATRON_ONLY_ARGS",
            megatron="--context-parallel-size",
        ),
    ] = Field(default=1, ge=1)
    """Context parallel size (``--context-parallel-size``; scripts only: mlaunch's trainer has 1)."""
    data_parallel_size: Annotated[
        int | None,
        NotPassed("derived by the trainer from the world size; checked here"),
    ] = Field(default=None, ge=1)
    """Data-parallel size; unset = world size / (tensor x pipeline x context)."""


SECTIONS: dict[str, type[_Section]] = {
    "launch": LaunchSettings,
    "telemetry": TelemetrySettings,
    "model": ModelSettings,
    "training": TrainingSettings,
    "parallelism": ParallelSettings,
}


class Source(NamedTuple):
    """Where a setting's value came from."""

    kind: Literal["flag", "env", "file", "default", "derived"]
    name: str  # the flag, the variable, "FILE [section] key", or "" for defaults

    def __str__(self) -> str:
        return self.name if self.name else self.kind


class Settings(BaseModel):
    """The validated configuration of one run (:func:`mlaunch.settings.load_settings` builds it
    from its sources and records where each value came from)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    launch: LaunchSettings = Field(default_factory=LaunchSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    parallelism: ParallelSettings = Field(default_factory=ParallelSettings)

    _sources: dict[str, Source] = PrivateAttr(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Total worker processes."""
        return self.launch.world_size

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel size (given or derived)."""
        if self.parallelism.data_parallel_size is not None:
            return self.parallelism.data_parallel_size
        return max(1, self.world_size // self.model_parallel_size)

    @property
    def model_parallel_size(self) -> int:
        """Ranks per data-parallel replica: tensor x pipeline x context (Megatron-LM's rule)."""
        p = self.parallelism
        return (
            p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        )

    @property
    def num_microbatches(self) -> int:
        """Microbatches per iteration on each data-parallel rank."""
        return max(
            1,
            self.training.global_batch_size
            // (self.training.micro_batch_size * self.data_parallel_size),
        )

    @property
    def uses_builtin_trainer(self) -> bool:
        """Whether the workers run mlaunch's own trainer."""
        return not (self.launch.script or self.launch.module)

    def source(self, path: str) -> Source:
        """Where the value at dotted ``path`` came from."""
        return self._sources.get(path, Source("default", ""))

    def label(self, path: str) -> str:
        """What the user typed for ``path``: the flag, variable or config-file key that set it (the
        flag's name when it is a default), so a bad ``run_dir`` in a config file names the file."""
        source = self.source(path)
        return source.name if source.kind in ("flag", "env", "file") else flag_name(path)

    def sources(self) -> dict[str, Source]:
        """Every dotted path that was set by a flag, variable or file, with its source."""
        return dict(self._sources)

    def exporting_ranks(self, world_size: int | None = None) -> list[int]:
        """The ranks that export telemetry under these settings, in a world of ``world_size``
        processes (default: the run's). A custom strategy is user code: it may raise anything."""
        t = self.telemetry
        return exporting_ranks(
            t.export_strategy,
            self.world_size if world_size is None else world_size,
            nproc_per_node=self.launch.nproc_per_node,
            export_rank=t.export_rank,
            sample_rate=t.export_sample_rate,
        )
