"""Every configuration source -> one validated :class:`Settings` object.

Precedence, highest first:

1. flags (``mlaunch train`` options, or the trainer's own ``--otel-*`` flags),
2. the environment: ``MEGATRON_OTEL_<KEY>``, else ``NEMO_LENS_<KEY>`` (a non-empty, stripped
   value wins), and the standard ``OTEL_*`` variables,
3. a TOML config file with ``[launch]``, ``[telemetry]`` (+ ``[telemetry.otel]``), ``[model]``,
   ``[training]`` and ``[parallelism]`` sections,
4. defaults.

The package is split by concern: :mod:`.schema` defines every setting once (the sections, and
:mod:`.checks` the checks between them), with :mod:`.args` the metadata saying how a training setting reaches a
training script; :mod:`.names` is what the user types for each (flags, variables);
:mod:`.sources` reads flags, environment and file; :mod:`.loading` merges and validates them and
records, for every field, where its value came from (:class:`Source`); :mod:`.run_id` chooses
the run id for every caller. Problems are collected,
not raised one by one: :class:`SettingsError` carries one :class:`Problem` per problem, whose
``field`` names what the user typed (a flag, a variable, a file key).

``from mlaunch.settings import X`` is the public path for every name below. The package imports
only pydantic; it never imports torch or the OpenTelemetry SDK.
"""

from __future__ import annotations

from mlaunch.settings.loading import (
    ENDPOINT_PATHS,
    collect_problems,
    load_settings,
    load_telemetry_settings,
    recorded_off_reason,
    telemetry_off_reason,
)
from mlaunch.settings.names import (
    ALIAS_KEYS,
    OTEL_ENV,
    SECRET_ENV,
    TELEMETRY_KEYS,
    env_names,
    flag_name,
    redact,
    redact_shown,
)
from mlaunch.settings.problems import Problem, ProblemKind, SettingsError, UnknownName, as_problem
from mlaunch.settings.run_id import RUN_ID_PATTERN, choose_run_id, is_run_id, new_run_id
from mlaunch.settings.schema import (
    CHOICES,
    DEFAULT_GRPC_ENDPOINT,
    DEFAULT_HTTP_ENDPOINT,
    EXPORTERS,
    INT64_MAX,
    INT64_MIN,
    MAX_WORLD_SIZE,
    OTLP_PROTOCOLS,
    RATIO_SAMPLERS,
    SECTIONS,
    TRACE_SAMPLERS,
    LaunchSettings,
    ModelSettings,
    OtelSettings,
    ParallelSettings,
    Protocol,
    Settings,
    Source,
    TelemetrySettings,
    TrainingSettings,
)
from mlaunch.settings.values import (
    LONG_OTLP_TIMEOUT_S,
    Bool,
    otlp_timeout_warning,
    parse_bool,
    parse_key_values,
)

__all__ = [
    "ENDPOINT_PATHS",
    "ALIAS_KEYS",
    "CHOICES",
    "DEFAULT_GRPC_ENDPOINT",
    "DEFAULT_HTTP_ENDPOINT",
    "EXPORTERS",
    "INT64_MAX",
    "INT64_MIN",
    "LONG_OTLP_TIMEOUT_S",
    "MAX_WORLD_SIZE",
    "OTEL_ENV",
    "OTLP_PROTOCOLS",
    "RATIO_SAMPLERS",
    "RUN_ID_PATTERN",
    "SECRET_ENV",
    "SECTIONS",
    "TELEMETRY_KEYS",
    "TRACE_SAMPLERS",
    "Bool",
    "LaunchSettings",
    "ModelSettings",
    "OtelSettings",
    "ParallelSettings",
    "Problem",
    "ProblemKind",
    "Protocol",
    "Settings",
    "SettingsError",
    "Source",
    "TelemetrySettings",
    "TrainingSettings",
    "UnknownName",
    "as_problem",
    "choose_run_id",
    "collect_problems",
    "env_names",
    "flag_name",
    "is_run_id",
    "load_settings",
    "load_telemetry_settings",
    "new_run_id",
    "otlp_timeout_warning",
    "parse_bool",
    "parse_key_values",
    "recorded_off_reason",
    "redact",
    "redact_shown",
    "telemetry_off_reason",
]
