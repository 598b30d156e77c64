"""Every configuration source -> one validated :class:`Settings` object.

Precedence, highest first (SPEC section 2.1):

1. flags (``mlaunch train`` options, or the trainer's own ``--otel-*`` flags),
2. the environment: ``MEGATRON_OTEL_<KEY>``, else ``NEMO_LENS_<KEY>`` (a non-empty, stripped
   value wins), and the standard ``OTEL_*`` variables,
3. a TOML config file with ``[launch]``, ``[telemetry]`` (+ ``[telemetry.otel]``), ``[model]``,
   ``[training]`` and ``[parallelism]`` sections,
4. defaults.

Each source is a pydantic-settings source; :func:`load_settings` merges them and records, for
every field, where its value came from (:class:`Source`). Problems are collected, not raised one
by one: :class:`SettingsError` carries one ``(field, message)`` per problem, where ``field`` names
what the user typed (a flag, a variable, a file key).

This module imports only pydantic; it never imports torch or the OpenTelemetry SDK.
"""

from __future__ import annotations

import contextvars
import os
import re
import secrets
import tomllib
import typing
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mlaunch.envcontract import FALLBACK_PREFIX, PRIMARY_PREFIX
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spec import SpanSpecError, closest_word, quoted, resolve
from mlaunch.model.strategies import StrategyError, load_strategy

# --------------------------------------------------------------------------------------------
# Errors and provenance


#: What went wrong, for a reader that acts on it (doctor): ``unknown`` a name that is not a
#: setting (a variable, a file key or section); ``invalid`` a value a setting refuses;
#: ``conflict`` settings that disagree with each other; ``unreadable`` a config file that cannot
#: be read or parsed.
ProblemKind = Literal["unknown", "invalid", "conflict", "unreadable"]


class Problem(tuple[str, str]):
    """One problem with a configuration, as a value: what the user typed (``field``), what is
    wrong and how to fix it (``message``), its ``kind``, and the "did you mean" word
    (``suggestion``, None when there is none).

    It is also the pair ``(field, message)``: it unpacks, indexes and compares as that pair, the
    shape every renderer prints as ``field: message`` (which ``str()`` gives).
    """

    kind: ProblemKind
    suggestion: str | None

    def __new__(
        cls,
        field: str,
        message: str,
        kind: ProblemKind = "invalid",
        suggestion: str | None = None,
    ) -> Problem:
        self = super().__new__(cls, (field, message))
        self.kind = kind
        self.suggestion = suggestion
        return self

    @property
    def field(self) -> str:
        """What the user typed: a flag, a variable, ``FILE [section] key``."""
        return self[0]

    @property
    def message(self) -> str:
        """What is wrong and how to fix it."""
        return self[1]

    def __getnewargs__(self) -> tuple[Any, ...]:  # type: ignore[override]
        # Pickling rebuilds through __new__: give it every argument, not the bare pair.
        return (self[0], self[1], self.kind, self.suggestion)

    def __str__(self) -> str:
        return f"{self[0]}: {self[1]}"

    def __repr__(self) -> str:
        return (
            f"Problem({self[0]!r}, {self[1]!r}, kind={self.kind!r}, suggestion={self.suggestion!r})"
        )


def as_problem(item: Problem | tuple[str, str]) -> Problem:
    """``item`` as a :class:`Problem` (a bare ``(field, message)`` pair is an ``invalid`` one)."""
    return item if isinstance(item, Problem) else Problem(item[0], item[1])


class SettingsError(ValueError):
    """Invalid configuration: one :class:`Problem` per problem, in ``problems``."""

    def __init__(self, problems: Iterable[Problem | tuple[str, str]]) -> None:
        self.problems: list[Problem] = [as_problem(p) for p in problems]
        super().__init__("\n".join(str(p) for p in self.problems))


class UnknownName(ValueError):
    """A value that is not one of a list of names, with the closest name (``suggestion``) for
    the :class:`Problem` a validator's error becomes."""

    def __init__(self, message: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.suggestion = suggestion


class Source(NamedTuple):
    """Where a setting's value came from."""

    kind: Literal["flag", "env", "file", "default", "derived"]
    name: str  # the flag, the variable, "FILE [section] key", or "" for defaults

    def __str__(self) -> str:
        return self.name if self.name else self.kind


# --------------------------------------------------------------------------------------------
# Value parsers shared by every source

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(value: Any) -> Any:
    """``1/true/yes/on`` and ``0/false/no/off`` in any case; anything else is an error (pydantic
    alone would also take ``t``, ``y``, ``f``, ``n``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    raise ValueError(f"expected a boolean (1/true/yes/on or 0/false/no/off), got {value!r}")


Bool = Annotated[bool, BeforeValidator(parse_bool)]


def parse_key_values(value: Any, what: str, *, secret: bool = False) -> dict[str, str]:
    """``k1=v1,k2=v2`` (URL-encoded values) as used by OTEL_RESOURCE_ATTRIBUTES / _HEADERS.

    ``secret``: a malformed entry is named by its position only (it may hold a token)."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    out: dict[str, str] = {}
    for n, item in enumerate(str(value).split(","), 1):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            shown = f"#{n} (not shown: a secret)" if secret else repr(item.strip())
            raise ValueError(f"malformed {what} entry {shown}: expected key=value")
        out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(val.strip())
    return out


def _check_url(value: str | None) -> str | None:
    if value is None:
        return None
    from mlaunch.endpoints import parse_endpoint

    parse_endpoint(value)  # EndpointError (a ValueError) with a redacted message
    return value.strip()


def _not_blank(value: str | None) -> str | None:
    """Reject an empty or blank text value: for a path or a name, ``""`` is never meant (``--script
    ""`` used to launch mlaunch's own trainer, ``--save ""`` reached the workers)."""
    if value is not None and not value.strip():
        raise ValueError("must not be empty (omit it to use the default)")
    return value


def _is(check: Any, path: str) -> bool:
    """``check(Path(path))``, with an unusable path (a 5,000-character name: ENAMETOOLONG, which
    pathlib re-raises) counting as "no" instead of escaping as an OSError traceback."""
    try:
        return bool(check(Path(path)))
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# The sections

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
    # Attribute docstrings become field descriptions: `mlaunch train --help` shows them.
    # allow_inf_nan=False: "inf" parses as a float and passes every lower bound (``--lr inf``).
    model_config = ConfigDict(
        extra="forbid", validate_default=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

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
        return _check_url(v)

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
    """The ``MEGATRON_OTEL_*`` / ``NEMO_LENS_*`` keys (SPEC section 2.2) plus OTel standards."""

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
    """Where telemetry goes; unset = ``otlp`` when an OTLP endpoint is configured, else ``file``."""
    run_id: str | None = None
    """Shared by every rank of a run; unset = SLURM_JOB_ID, else a fresh 12-hex-digit id."""
    user_id: str = ""
    """``nemo.user.id`` resource attribute."""
    service_name: str = "megatron-lm"
    """``service.name`` (``--otel-service-name``, ``OTEL_SERVICE_NAME``)."""
    shutdown_timeout_s: float = Field(default=5.0, gt=0, le=600)
    """Hard deadline for flushing telemetry at shutdown (mlaunch key ``SHUTDOWN_TIMEOUT``)."""
    trace_segment_iters: int = Field(default=100, ge=1)
    """``megatron.train`` is re-rooted into a new trace every this many iterations."""
    otel: OtelSettings = Field(default_factory=OtelSettings)
    """The standard ``OTEL_*`` variables."""

    _groups: frozenset[SpanGroup] = PrivateAttr(default=frozenset())

    @field_validator("span_groups")
    @classmethod
    def _spec(cls, v: str) -> str:
        try:
            resolve(v)
        except SpanSpecError as exc:
            raise UnknownName(str(exc), exc.suggestion) from None
        return v

    @field_validator("export_strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        try:
            load_strategy(v)
        except StrategyError as exc:
            raise UnknownName(str(exc), getattr(exc, "suggestion", None)) from None
        return v.strip().lower() if ":" not in v else v.strip()

    @field_validator("service_name")
    @classmethod
    def _service_name(cls, v: str) -> str:
        _not_blank(v)  # an empty service.name makes every span of the run unattributable
        return v

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip()
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v):
            raise ValueError(
                f"{quoted(v)} is not a valid run id: use 1-128 letters, digits, '.', '_' or '-',"
                " starting with a letter or digit (it names the run directory: a leading '-'"
                " would read as an option, a leading '.' would hide it)"
            )
        return v

    @model_validator(mode="after")
    def _derive(self) -> TelemetrySettings:
        self._groups = resolve(self.span_groups)
        if self.exporter is None:
            self.exporter = "otlp" if self.otel.endpoint_configured else "file"
        return self

    @property
    def groups(self) -> frozenset[SpanGroup]:
        """The resolved span groups."""
        return self._groups


#: The largest world mlaunch plans for: the plan visits every rank (exporting ranks), so an
#: absurd ``--nnodes 99999999999`` would hang the launcher instead of failing.
MAX_WORLD_SIZE = 2**20


class LaunchSettings(_Section):
    """How ``mlaunch train`` starts torchrun."""

    nproc_per_node: int = Field(default=2, ge=1, le=1024)
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
        return _not_blank(v)

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
        if _not_blank(v) is not None and not _is(Path.is_file, v):
            raise ValueError(f"script {quoted(v)} does not exist or is not a file")
        return v

    @field_validator("module")
    @classmethod
    def _one_entry(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("script"):
            raise ValueError("give either --script or --module, not both")
        return v

    @property
    def world_size(self) -> int:
        """Total worker processes."""
        return self.nnodes * self.nproc_per_node


class ModelSettings(_Section):
    """The GPT model (Megatron-LM argument names)."""

    num_layers: int = Field(default=2, ge=1)
    """Transformer layers."""
    hidden_size: int = Field(default=64, ge=1)
    """Hidden size."""
    num_attention_heads: int = Field(default=4, ge=1)
    """Attention heads (must divide hidden_size)."""
    seq_length: int = Field(default=64, ge=2)
    """Sequence length in tokens."""
    untie_embeddings: Bool = False
    """Use a separate LM-head matrix instead of the token embedding."""


class TrainingSettings(_Section):
    """The training run (Megatron-LM argument names)."""

    micro_batch_size: int = Field(default=2, ge=1)
    """Sequences per microbatch."""
    global_batch_size: int = Field(default=8, ge=1)
    """Sequences per iteration over all data-parallel ranks."""
    train_iters: int = Field(default=40, ge=1)
    """Iterations to train."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=3e-4, ge=0)
    """Final learning rate of the cosine schedule."""
    lr_warmup_iters: int = Field(default=5, ge=0)
    """Linear warm-up iterations."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    clip_grad: float = Field(default=1.0, ge=0)
    """Gradient-norm clipping (0 = off)."""
    eval_interval: int = Field(default=20, ge=0)
    """Evaluate every this many iterations (0 = never)."""
    eval_iters: int = Field(default=2, ge=0)
    """Batches per evaluation."""
    log_interval: int = Field(default=1, ge=1)
    """Metrics/progress every this many iterations."""
    save: str | None = None
    """Checkpoint directory (unset = ``<run_dir>/checkpoints`` when save_interval > 0)."""
    load: str | None = None
    """Checkpoint directory to resume from (default: save, when it holds a checkpoint)."""
    save_interval: int = Field(default=0, ge=0)
    """Save every this many iterations (0 = only at the end when save is set)."""
    keep_last: int = Field(default=2, ge=1)
    """Checkpoints to keep."""
    # At most 2**32-1 (numpy's limit, Megatron's convention): the trainer seeds torch generators
    # with seed x 1_000_003 + index, which overflows torch's 64-bit seed for huge values.
    seed: int = Field(default=1234, ge=0, le=2**32 - 1)
    """Random seed, in [0, 2**32-1]."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision (Megatron's --bf16 / --fp16)."""
    data_path: str | None = None
    """Text file or folder (byte-level tokens); unset = the built-in corpus."""
    offload_activations: Bool = False
    """Move saved activations to CPU between forward and backward."""
    sample_tokens: int = Field(default=0, ge=0)
    """Tokens to generate during evaluation (a text_completion span); 0 = off."""

    @field_validator("save", "load")
    @classmethod
    def _blank(cls, v: str | None) -> str | None:
        return _not_blank(v)

    @field_validator("data_path")
    @classmethod
    def _data_path(cls, v: str | None) -> str | None:
        if _not_blank(v) is not None and not _is(Path.exists, v):
            raise ValueError(f"data_path {quoted(v)} does not exist; give a text file or folder")
        if v is not None:
            from mlaunch.model.corpus import empty_data_problem

            if problem := empty_data_problem(v):
                raise ValueError(problem)
        return v


class ParallelSettings(_Section):
    """Model parallel sizes; data parallel is derived from the world size."""

    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """Tensor parallel size (mlaunch's trainer supports 1; other scripts may use more)."""
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    """Pipeline stages."""
    context_parallel_size: int = Field(default=1, ge=1)
    """Context parallel size (``--context-parallel-size``; scripts only: mlaunch's trainer has 1)."""
    data_parallel_size: int | None = Field(default=None, ge=1)
    """Data-parallel size; unset = world size / (tensor x pipeline x context)."""


# --------------------------------------------------------------------------------------------
# Sources (pydantic-settings)

#: Telemetry key (the suffix after the prefix) -> TelemetrySettings field.
TELEMETRY_KEYS: dict[str, str] = {
    "ENABLED": "enabled",
    "SPAN_GROUPS": "span_groups",
    "EXPORT_STRATEGY": "export_strategy",
    "EXPORT_RANK": "export_rank",
    "EXPORT_SAMPLE_RATE": "export_sample_rate",
    "SAMPLER_ENABLED": "sampler_enabled",
    "TRACES_ENABLED": "traces_enabled",
    "METRICS_ENABLED": "metrics_enabled",
    "LOGS_ENABLED": "logs_enabled",
    "EXPORTER": "exporter",
    "RUN_ID": "run_id",
    "USER_ID": "user_id",
    # mlaunch additions
    "SHUTDOWN_TIMEOUT": "shutdown_timeout_s",
    "TRACE_SEGMENT_ITERS": "trace_segment_iters",
}

#: Names Megatron-LM's docs use that nemo-lens ignores; mlaunch honours them as aliases.
ALIAS_KEYS: dict[str, str] = {
    "RANK_STRATEGY": "EXPORT_STRATEGY",
    "SAMPLING_STRATEGY": "SAMPLER_ENABLED",
}

#: Standard OpenTelemetry variable -> (section path, field).
OTEL_ENV: dict[str, tuple[str, str]] = {
    "OTEL_SERVICE_NAME": ("telemetry", "service_name"),
    "OTEL_TRACES_SAMPLER": ("telemetry.otel", "traces_sampler"),
    "OTEL_TRACES_SAMPLER_ARG": ("telemetry.otel", "traces_sampler_arg"),
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("telemetry.otel", "base_endpoint"),
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ("telemetry.otel", "traces_endpoint"),
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ("telemetry.otel", "metrics_endpoint_override"),
    "OTEL_EXPORTER_OTLP_PROTOCOL": ("telemetry.otel", "base_protocol"),
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": ("telemetry.otel", "traces_protocol"),
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": ("telemetry.otel", "metrics_protocol_override"),
    "OTEL_EXPORTER_OTLP_HEADERS": ("telemetry.otel", "headers"),
    "OTEL_EXPORTER_OTLP_TIMEOUT": ("telemetry.otel", "timeout_s"),
    "OTEL_EXPORTER_OTLP_CERTIFICATE": ("telemetry.otel", "certificate"),
    "OTEL_EXPORTER_OTLP_INSECURE": ("telemetry.otel", "insecure"),
    "OTEL_RESOURCE_ATTRIBUTES": ("telemetry.otel", "resource_attributes"),
    "OTEL_METRIC_EXPORT_INTERVAL": ("telemetry.otel", "metric_export_interval_ms"),
    "OTEL_SDK_DISABLED": ("telemetry.otel", "sdk_disabled"),
}

#: Variables whose values are secrets: never printed, logged or written unredacted.
SECRET_ENV: frozenset[str] = frozenset(
    {
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
        "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
    }
)

SECTIONS: dict[str, type[_Section]] = {
    "launch": LaunchSettings,
    "telemetry": TelemetrySettings,
    "model": ModelSettings,
    "training": TrainingSettings,
    "parallelism": ParallelSettings,
}


#: Flags spelled differently from their field: the OTLP base settings read as the variables do
#: (``--otlp-endpoint`` for OTEL_EXPORTER_OTLP_ENDPOINT, not ``--otlp-base-endpoint``).
_FLAG_OVERRIDES: dict[str, str] = {
    "telemetry.otel.base_endpoint": "--otlp-endpoint",
    "telemetry.otel.base_protocol": "--otlp-protocol",
    "telemetry.otel.metrics_endpoint_override": "--otlp-metrics-endpoint",
    "telemetry.otel.metrics_protocol_override": "--otlp-metrics-protocol",
}


def flag_name(path: str) -> str:
    """The command-line flag of a dotted settings path (Megatron-LM's names where they exist)."""
    if path in _FLAG_OVERRIDES:
        return _FLAG_OVERRIDES[path]
    section, _, field = path.partition(".")
    if section == "telemetry":
        if field.startswith("otel."):
            return "--otlp-" + field.removeprefix("otel.").replace("_", "-")
        return "--otel-" + field.replace("_", "-")
    if path == "training.precision":
        return "--precision"
    return "--" + field.replace("_", "-")


def env_names(field: str) -> tuple[str, ...]:
    """The telemetry variables that can set ``field``, highest precedence first."""
    keys = [k for k, f in TELEMETRY_KEYS.items() if f == field]
    keys += [a for a, target in ALIAS_KEYS.items() if target in keys]
    return tuple(p + k for p in (PRIMARY_PREFIX, FALLBACK_PREFIX) for k in keys)


class _Layer(PydanticBaseSettingsSource):
    """A source holding a nested dict and, per dotted path, where each value came from."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self.values: dict[str, Any] = {}  # dotted path -> raw value
        self.origin: dict[str, Source] = {}

    def set(self, path: str, value: Any, origin: Source) -> None:
        self.values[path] = value
        self.origin[path] = origin

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole tree

    def __call__(self) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for path, value in self.values.items():
            *parents, leaf = path.split(".")
            node = tree
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return tree


class FlagSource(_Layer):
    """Command-line flags: ``{dotted path: value}``; ``None`` means not given."""

    def __init__(self, settings_cls: type[BaseSettings], flags: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        for path, value in flags.items():
            if value is not None:
                self.set(path, value, Source("flag", flag_name(path)))


class EnvSource(_Layer):
    """``MEGATRON_OTEL_*`` with ``NEMO_LENS_*`` fallback, plus the standard ``OTEL_*`` variables.

    Collects problems (typos, conflicting aliases) in ``problems`` instead of raising, so every
    problem of a configuration is reported at once.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.problems: list[Problem] = []
        valid = list(TELEMETRY_KEYS) + list(ALIAS_KEYS)
        for name in sorted(environ):
            for prefix in (PRIMARY_PREFIX, FALLBACK_PREFIX):
                if name.startswith(prefix) and name[len(prefix) :] not in valid:
                    close = closest_word(name[len(prefix) :], valid)
                    meant = prefix + close if close else None
                    hint = f"did you mean {meant}? " if meant else ""
                    self.problems.append(
                        Problem(
                            name,
                            f"unknown variable; {hint}valid keys: {', '.join(valid)}",
                            "unknown",
                            meant,
                        )
                    )
        for key, field in TELEMETRY_KEYS.items():
            found = self._lookup(environ, key)
            if found is not None:
                var, value = found
                if var.endswith("SAMPLING_STRATEGY"):
                    value = self._sampling_strategy(var, value)
                    if value is None:
                        continue
                self.set(f"telemetry.{field}", value, Source("env", var))
        for var, (section, field) in OTEL_ENV.items():
            value = environ.get(var, "").strip()
            if value:
                self.set(f"{section}.{field}", value, Source("env", var))

    def _lookup(self, environ: Mapping[str, str], key: str) -> tuple[str, str] | None:
        aliases = [a for a, target in ALIAS_KEYS.items() if target == key]
        for prefix in (PRIMARY_PREFIX, FALLBACK_PREFIX):
            given = [
                (prefix + k, environ[prefix + k].strip())
                for k in [key, *aliases]
                if environ.get(prefix + k, "").strip()
            ]
            if not given:
                continue
            if len(given) > 1 and len({self._norm(k, v) for k, v in given}) > 1:
                shown = " and ".join(f"{k}={v!r}" for k, v in given)
                self.problems.append(
                    Problem(given[0][0], f"conflicts with its alias: {shown}; set one", "conflict")
                )
            return given[0]
        return None

    @staticmethod
    def _norm(var: str, value: str) -> str:
        if var.endswith("SAMPLING_STRATEGY"):
            return "true" if value.lower() == "rank_aware" else "false"
        if var.endswith("SAMPLER_ENABLED"):
            return "true" if value.lower() in _TRUE else "false"
        return value.lower()

    def _sampling_strategy(self, var: str, value: str) -> str | None:
        v = value.lower()
        if v == "rank_aware":
            return "true"
        if v in ("none", "off", "default"):
            return "false"
        self.problems.append(
            Problem(var, f"unknown sampling strategy {value!r}; use rank_aware or none")
        )
        return None


class FileSource(_Layer):
    """A TOML config file; unknown sections and keys are problems with a did-you-mean."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        super().__init__(settings_cls)
        self.problems: list[Problem] = []
        try:
            # utf-8-sig: an editor's byte-order mark (Windows Notepad) is not TOML, but not an error.
            data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except FileNotFoundError:
            self.problems.append(Problem(str(path), "config file not found", "unreadable"))
            return
        except (OSError, UnicodeDecodeError) as exc:
            self.problems.append(
                Problem(str(path), f"cannot read config file ({exc})", "unreadable")
            )
            return
        except tomllib.TOMLDecodeError as exc:
            self.problems.append(Problem(str(path), f"not valid TOML: {exc}", "unreadable"))
            return
        self._walk(path, data, "", None)

    def _walk(
        self, path: Path, data: Mapping[str, Any], prefix: str, model: type[BaseModel] | None
    ) -> None:
        for key, value in data.items():
            if model is None:  # top level: keys are sections
                where, known, what = f"{path} [{key}]", list(SECTIONS), "section"
            else:
                where, known, what = (
                    f"{path} [{prefix.rstrip('.')}] {key}",
                    list(model.model_fields),
                    "key",
                )
            if key not in known:
                close = closest_word(key, known)
                hint = f" (did you mean {close!r}?)" if close else ""
                self.problems.append(
                    Problem(
                        where, f"unknown {what}{hint}; valid: {', '.join(known)}", "unknown", close
                    )
                )
                continue
            sub = SECTIONS[key] if model is None else _submodel(model.model_fields[key])
            if (
                sub is None
                and isinstance(value, bool)
                and model is not None
                and not _mentions_bool(model.model_fields[key].annotation)
            ):
                # pydantic would take true as 1 (``train_iters = true`` ran one iteration).
                self.problems.append(
                    Problem(
                        where, f"expected a number or text, got a boolean ({str(value).lower()})"
                    )
                )
                continue
            if (
                sub is None
                and isinstance(value, str)
                and _looks_numeric(value)
                and model is not None
                and _is_number_only(model.model_fields[key].annotation)
            ):
                # Refused like a boolean: TOML has numbers, and a quoted one is usually a
                # mistake (pydantic would convert it silently).
                self.problems.append(
                    Problem(
                        where,
                        f"expected a number, got text {quoted(value)}; write it without quotes:"
                        f" {key} = {value.strip()}",
                    )
                )
                continue
            if sub is None:
                self.set(f"{prefix}{key}", value, Source("file", where))
            elif isinstance(value, dict):
                self._walk(path, value, f"{prefix}{key}.", sub)
            else:
                self.problems.append(Problem(where, f"expected a table ([{prefix}{key}])"))


def _mentions_bool(annotation: Any) -> bool:
    """Whether a field's annotation accepts a boolean (``bool``, ``Bool``, ``Bool | None``)."""
    if annotation is bool:
        return True
    return any(_mentions_bool(arg) for arg in typing.get_args(annotation))


def _looks_numeric(text: str) -> bool:
    """Whether ``text`` reads as a number (``"30"``, ``"1e-4"``; not ``"two"``)."""
    try:
        float(text.strip().replace("_", ""))
    except ValueError:
        return False
    return True


def _is_number_only(annotation: Any) -> bool:
    """Whether a field takes numbers and no text (``int``, ``float``, ``int | None``)."""
    if annotation is str:
        return False
    args = typing.get_args(annotation)
    if args:
        return any(_is_number_only(a) for a in args) and not any(a is str for a in args)
    return annotation in (int, float)


def _submodel(field_or_model: Any) -> type[BaseModel] | None:
    if isinstance(field_or_model, type) and issubclass(field_or_model, BaseModel):
        return field_or_model
    ann = getattr(field_or_model, "annotation", None)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    return None


_ACTIVE_SOURCES: contextvars.ContextVar[tuple[PydanticBaseSettingsSource, ...]] = (
    contextvars.ContextVar("mlaunch_settings_sources", default=())
)


# --------------------------------------------------------------------------------------------
# The whole configuration


class Settings(BaseSettings):
    """The validated configuration of one run."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)

    launch: LaunchSettings = Field(default_factory=LaunchSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    parallelism: ParallelSettings = Field(default_factory=ParallelSettings)

    _sources: dict[str, Source] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Sources are built per call by load_settings (they need the flags, environment and
        # file of that call); highest precedence first.
        return _ACTIVE_SOURCES.get()

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

    def sources(self) -> dict[str, Source]:
        """Every dotted path that was set by a flag, variable or file, with its source."""
        return dict(self._sources)

    def cross_field_problems(self) -> list[Problem]:
        """Checks that span sections: world layout, batch arithmetic, export rank."""
        p = self.parallelism
        problems: list[Problem] = []
        world = self.world_size
        mp = self.model_parallel_size

        def label(path: str, *others: str) -> str:
            # Of the settings in conflict, name the one set by the highest-precedence source
            # (``--hidden-size 65`` against the file's heads is the flag's fault, not the file's).
            rank = {"flag": 0, "env": 1, "derived": 2, "file": 3, "default": 4}
            path = min((path, *others), key=lambda q: rank[self.source(q).kind])
            src = self.source(path)
            return src.name if src.kind != "default" else path

        m = self.model
        if m.hidden_size % m.num_attention_heads:
            problems.append(
                _conflict(
                    label("model.num_attention_heads", "model.hidden_size"),
                    f"{m.num_attention_heads} attention heads do not divide hidden size"
                    f" {m.hidden_size}",
                )
            )
        if self.training.min_lr > self.training.lr:
            problems.append(
                _conflict(
                    label("training.min_lr", "training.lr"),
                    f"min_lr {self.training.min_lr} must be <= lr {self.training.lr}",
                )
            )

        if world > MAX_WORLD_SIZE:
            problems.append(
                _conflict(
                    label("launch.nnodes", "launch.nproc_per_node"),
                    f"world size {world} (nnodes {self.launch.nnodes} x nproc_per_node"
                    f" {self.launch.nproc_per_node}) is above mlaunch's limit {MAX_WORLD_SIZE}",
                )
            )
        if world % mp:
            problems.append(
                _conflict(
                    label("parallelism.pipeline_model_parallel_size"),
                    f"world size {world} (nnodes {self.launch.nnodes} x nproc_per_node"
                    f" {self.launch.nproc_per_node}) is not divisible by tensor x pipeline"
                    f" = {p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size}"
                    + (
                        f" x context {p.context_parallel_size}"
                        if p.context_parallel_size > 1
                        else ""
                    ),
                )
            )
        elif p.data_parallel_size is not None and p.data_parallel_size * mp != world:
            problems.append(
                _conflict(
                    label("parallelism.data_parallel_size"),
                    f"world size {world} != tensor {p.tensor_model_parallel_size} x pipeline"
                    f" {p.pipeline_model_parallel_size}"
                    + (
                        f" x context {p.context_parallel_size}"
                        if p.context_parallel_size > 1
                        else ""
                    )
                    + f" x data {p.data_parallel_size}",
                )
            )
        dp = self.data_parallel_size
        t = self.training
        if t.global_batch_size % (t.micro_batch_size * dp):
            problems.append(
                _conflict(
                    label("training.global_batch_size"),
                    f"global batch {t.global_batch_size} is not divisible by micro batch"
                    f" {t.micro_batch_size} x data-parallel size {dp}",
                )
            )
        if self.model.num_layers % p.pipeline_model_parallel_size:
            problems.append(
                _conflict(
                    label("model.num_layers"),
                    f"{self.model.num_layers} layers cannot be split evenly across"
                    f" {p.pipeline_model_parallel_size} pipeline stages",
                )
            )
        if self.telemetry.export_rank >= world:
            problems.append(
                _conflict(
                    label("telemetry.export_rank"),
                    f"export rank {self.telemetry.export_rank} is outside the world size {world}"
                    f" (ranks 0..{world - 1}; -1 = last rank)",
                )
            )
        if self.uses_builtin_trainer and p.tensor_model_parallel_size != 1:
            problems.append(
                _conflict(
                    label("parallelism.tensor_model_parallel_size"),
                    "mlaunch's trainer supports tensor parallel size 1 only;"
                    " use --script for a trainer with tensor parallelism",
                )
            )
        if self.uses_builtin_trainer and p.context_parallel_size != 1:
            problems.append(
                _conflict(
                    label("parallelism.context_parallel_size"),
                    "mlaunch's trainer supports context parallel size 1 only;"
                    " use --script for a trainer with context parallelism",
                )
            )
        if self.uses_builtin_trainer:
            problems += self._trainer_protocol_problems(label)
        return problems

    def _trainer_protocol_problems(self, label: Any) -> list[Problem]:
        """``http/json`` is the reference's (nemo-lens takes it and sends OTLP/HTTP protobuf, the
        only encoding the Python SDK has); mlaunch's own trainer exports through that same SDK,
        so it refuses the name rather than send protobuf while the summary says JSON."""
        o = self.telemetry.otel
        out = []
        for fld in ("base_protocol", "traces_protocol", "metrics_protocol_override"):
            if getattr(o, fld) == "http/json":
                out.append(
                    _conflict(
                        label(f"telemetry.otel.{fld}"),
                        "http/json is not supported by mlaunch's trainer: it exports through the"
                        " OpenTelemetry Python SDK, which has no OTLP/JSON encoder; use"
                        " http/protobuf (every OTLP/HTTP receiver accepts it), or run a --script"
                        " worker (nemo-lens takes http/json and sends protobuf)",
                    )
                )
        return out


def _conflict(field: str, message: str) -> Problem:
    """A problem between settings (each valid alone)."""
    return Problem(field, message, "conflict")


def _error_label(loc: tuple[Any, ...], layers: list[_Layer]) -> str:
    """Name what the user typed for a pydantic error location."""
    parts = [str(x) for x in loc if not isinstance(x, int)]
    for n in range(len(parts), 0, -1):
        path = ".".join(parts[:n])
        for layer in layers:
            if path in layer.origin:
                return str(layer.origin[path])
    return ".".join(parts) or "settings"


def _clean_message(err: Mapping[str, Any]) -> str:
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if err.get("type") in (
        "float_parsing",
        "int_parsing",
        "literal_error",
        "less_than_equal",
        "greater_than_equal",
        "greater_than",
        "less_than",
        "int_from_float",
        "finite_number",
    ):
        got = err.get("input")
        # pydantic's own "got ..." clause (int_from_float: "got a number with a fractional
        # part") is dropped: one "got <value>" says it, with the value.
        msg = msg.split(", got ", 1)[0]
        msg = f"{msg}, got {quoted(got) if isinstance(got, str) else repr(got)}"
    return msg


def _error_problem(err: Mapping[str, Any], layers: list[_Layer]) -> Problem:
    """A pydantic error as a :class:`Problem`: an unexpected key is ``unknown``; a validator's
    :class:`UnknownName` carries its suggestion through pydantic's error context."""
    kind: ProblemKind = "unknown" if err.get("type") == "extra_forbidden" else "invalid"
    cause = (err.get("ctx") or {}).get("error")
    return Problem(
        _error_label(err["loc"], layers),
        _clean_message(err),
        kind,
        getattr(cause, "suggestion", None),
    )


def _validate(layers: list[_Layer]) -> Settings:
    """Validate the merged layers (highest precedence first) and record each value's source.

    Raises :class:`SettingsError` with one entry per pydantic error.
    """
    token = _ACTIVE_SOURCES.set(tuple(layers))
    try:
        settings = Settings()
    except ValidationError as exc:
        raise SettingsError([_error_problem(e, layers) for e in exc.errors()]) from None
    finally:
        _ACTIVE_SOURCES.reset(token)
    merged: dict[str, Source] = {}
    for layer in reversed(layers):  # lowest precedence first, so higher ones overwrite
        merged.update(layer.origin)
    settings._sources = merged
    return settings


def collect_problems(
    *,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config: str | Path | None = None,
) -> tuple[Settings | None, list[Problem]]:
    """Every problem of a configuration at once, for ``mlaunch doctor``.

    The same sources and model as :func:`load_settings`, but where that stops at the first
    group of problems (source problems, then validation, then cross-field checks), this runs
    every stage and returns all of them, with the settings when validation itself succeeded
    (None otherwise). No problems means :func:`load_settings` would succeed.
    """
    environ = os.environ if environ is None else environ
    env_src = EnvSource(Settings, environ)
    layers: list[_Layer] = [FlagSource(Settings, flags or {}), env_src]
    problems: list[Problem] = list(env_src.problems) + _preempt_signals_problems(environ)
    if config is not None:
        file_src = FileSource(Settings, Path(config))
        problems += file_src.problems
        layers.append(file_src)
    try:
        settings = _validate(layers)
    except SettingsError as exc:
        return None, problems + exc.problems
    return settings, problems + settings.cross_field_problems()


def _preempt_signals_problems(environ: Mapping[str, str]) -> list[Problem]:
    """``MLAUNCH_PREEMPT_SIGNALS`` checked before launch (the trainer would refuse it only after
    torchrun started), reported under the variable's own name."""
    from mlaunch.envcontract import PREEMPT_SIGNALS
    from mlaunch.trainer.args import preempt_signals

    if not environ.get(PREEMPT_SIGNALS, "").strip():
        return []
    try:
        preempt_signals(None, dict(environ))
    except ValueError as exc:
        return [Problem(PREEMPT_SIGNALS, str(exc))]
    return []


def load_settings(
    *,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config: str | Path | None = None,
    check_cross_fields: bool = True,
) -> Settings:
    """Merge flags > environment > config file > defaults into validated :class:`Settings`.

    ``flags`` maps dotted paths (``"telemetry.span_groups"``) to values (None = not given).
    Raises :class:`SettingsError` listing every problem found.
    """
    environ = os.environ if environ is None else environ
    problems: list[Problem] = []
    flag_src = FlagSource(Settings, flags or {})
    env_src = EnvSource(Settings, environ)
    problems += env_src.problems
    problems += _preempt_signals_problems(environ)
    layers: list[_Layer] = [flag_src, env_src]
    if config is not None:
        file_src = FileSource(Settings, Path(config))
        problems += file_src.problems
        layers.append(file_src)
    if problems:
        raise SettingsError(problems)
    settings = _validate(layers)
    if check_cross_fields:
        cross = settings.cross_field_problems()
        if cross:
            raise SettingsError(cross)
    return settings


def load_telemetry_settings(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> TelemetrySettings:
    """Telemetry settings as a worker sees them: its environment, with its own ``--otel-*``
    flags (``overrides``, keyed by TelemetrySettings field) on top. No config file."""
    flags = {f"telemetry.{k}": v for k, v in (overrides or {}).items()}
    return load_settings(flags=flags, environ=environ, check_cross_fields=False).telemetry


def new_run_id() -> str:
    """A fresh 12-hex-digit run id."""
    return secrets.token_hex(6)


def choose_run_id(settings: TelemetrySettings, environ: Mapping[str, str] | None = None) -> str:
    """The run id, chosen once: the RUN_ID setting, else SLURM_JOB_ID, else a fresh id."""
    environ = os.environ if environ is None else environ
    if settings.run_id:
        return settings.run_id
    slurm = environ.get("SLURM_JOB_ID", "").strip()
    return slurm if slurm else new_run_id()


def redact(name: str, value: str) -> str:
    """The value to show for variable ``name``: secrets are replaced by a marker."""
    return "<redacted>" if name in SECRET_ENV and value else value


def redact_shown(name: str, value: str) -> str:
    """:func:`redact`, and credentials in an endpoint URL (``user:pass@host``) as ``***@host``:
    for messages only (the worker environment and ``--print-env`` keep the URL usable)."""
    if "endpoint" in name.lower() and "@" in value:
        from mlaunch.endpoints import redact as redact_url

        return redact_url(value)
    return redact(name, value)
