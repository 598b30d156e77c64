"""What the user types for a setting: its flag, its ``MEGATRON_OTEL_*`` / ``NEMO_LENS_*`` key and
aliases, its standard ``OTEL_*`` variable; and which values are secrets."""

from __future__ import annotations

from mlaunch import envcontract as ec
from mlaunch.envcontract import FALLBACK_PREFIX, OTLP_HEADERS_VARS, PRIMARY_PREFIX

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
    "RECORDER_GROUPS": "recorder_groups",
    "RECORDER_ITERS": "recorder_iters",
    "RECORDER_MAX_MIB": "recorder_max_mib",
    "RECORDER_SLOW_FACTOR": "recorder_slow_factor",
}

#: Names Megatron-LM's docs use that nemo-lens ignores; mlaunch honours them as aliases.
ALIAS_KEYS: dict[str, str] = {
    "RANK_STRATEGY": "EXPORT_STRATEGY",
    "SAMPLING_STRATEGY": "SAMPLER_ENABLED",
}

#: Standard OpenTelemetry variable -> (section path, field).
OTEL_ENV: dict[str, tuple[str, str]] = {
    ec.OTEL_SERVICE_NAME: ("telemetry", "service_name"),
    ec.OTEL_TRACES_SAMPLER: ("telemetry.otel", "traces_sampler"),
    ec.OTEL_TRACES_SAMPLER_ARG: ("telemetry.otel", "traces_sampler_arg"),
    ec.OTLP_ENDPOINT: ("telemetry.otel", "base_endpoint"),
    ec.OTLP_TRACES_ENDPOINT: ("telemetry.otel", "traces_endpoint"),
    ec.OTLP_METRICS_ENDPOINT: ("telemetry.otel", "metrics_endpoint_override"),
    ec.OTLP_PROTOCOL: ("telemetry.otel", "base_protocol"),
    ec.OTLP_TRACES_PROTOCOL: ("telemetry.otel", "traces_protocol"),
    ec.OTLP_METRICS_PROTOCOL: ("telemetry.otel", "metrics_protocol_override"),
    ec.OTLP_HEADERS: ("telemetry.otel", "headers"),
    ec.OTLP_TIMEOUT: ("telemetry.otel", "timeout_s"),
    ec.OTLP_CERTIFICATE: ("telemetry.otel", "certificate"),
    ec.OTLP_INSECURE: ("telemetry.otel", "insecure"),
    ec.OTEL_RESOURCE_ATTRIBUTES: ("telemetry.otel", "resource_attributes"),
    ec.OTEL_METRIC_EXPORT_INTERVAL: ("telemetry.otel", "metric_export_interval_ms"),
    ec.OTEL_SDK_DISABLED: ("telemetry.otel", "sdk_disabled"),
}

#: Variables whose values are secrets: never printed, logged or written unredacted.
SECRET_ENV: frozenset[str] = frozenset(OTLP_HEADERS_VARS)

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
