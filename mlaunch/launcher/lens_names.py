"""What a ``--script``/``--module`` worker receives: the one translation table.

An external entry point (Megatron-LM's ``pretrain_gpt.py``, or any script that configures telemetry
as Megatron-LM does) reads its settings through nemo-lens's ``NemoLensConfig`` (0.1.0 and 0.2.0
resolve configuration alike: :data:`KNOWN_LENS_VERSIONS`), which knows
less than mlaunch: no ``file``/``none`` exporter, no ``-group`` exclusions or ``goodput``
preset, strategies only by registered name, no ``RANK_STRATEGY``/``SAMPLING_STRATEGY``, and an
empty value means "unset". Every telemetry setting has one :class:`Rule` here saying whether it
reaches such a worker as it is (``passed``), rewritten into the reference's language
(``translated``), or is refused before launch with the reason and what to use instead
(``refused``). The launch plan, the summary, ``mlaunch doctor`` and the table in docs/train.md all
derive from :data:`RULES`; mlaunch's own trainer keeps every extension and never comes here.

Standard library and :mod:`mlaunch.settings` only (no torch, no OpenTelemetry).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import CATALOGUE
from mlaunch.model.spec import format_groups
from mlaunch.model.strategies import ExportStrategy
from mlaunch.rundir import layout as lay
from mlaunch.settings import OTEL_ENV, TELEMETRY_KEYS, Settings, flag_name

P = ec.PRIMARY_PREFIX

#: The nemo-lens versions this table was checked against. 0.2.0 is what Megatron-LM pins (its
#: ``pyproject.toml`` takes NVIDIA-NeMo/Lens at git tag v0.2.0; Python >= 3.12); 0.1.0 is the
#: ``nemo-lens`` package on PyPI (Python >= 3.13). Config fields, variables, groups, presets,
#: strategies and the sampler are the same in both.
KNOWN_LENS_VERSIONS: tuple[str, ...] = ("0.1.0", "0.2.0")
#: The version Megatron-LM pins, which the advice names first.
PINNED_LENS_VERSION = "0.2.0"


def lens_install_advice() -> str:
    """How to give a worker interpreter a nemo-lens Megatron-LM works with, in one line."""
    return (
        f"install nemo-lens {PINNED_LENS_VERSION} (what Megatron-LM pins, Python >= 3.12) with"
        " `pip install -e .[otel]` in the Megatron-LM checkout or `pip install 'nemo-lens[sdk] @"
        f" git+https://github.com/NVIDIA-NeMo/Lens@v{PINNED_LENS_VERSION}'`, or nemo-lens 0.1.0"
        " from PyPI on Python >= 3.13 (`pip install 'nemo-lens[sdk]==0.1.0'`); name the workers'"
        " interpreter with --worker-python PATH"
    )


#: The exporters nemo-lens builds (``providers._VALID_EXPORTERS``, 0.1.0 and 0.2.0).
REFERENCE_EXPORTERS: tuple[str, ...] = ("otlp", "console")
#: Trace samplers a rank-aware sampler can replace without dropping anything they would keep.
_KEEP_ALL_SAMPLERS = frozenset({"always_on", "parentbased_always_on"})
#: nemo-lens flushes at shutdown with this fixed timeout (``TelemetryHandle.shutdown``).
REFERENCE_SHUTDOWN_TIMEOUT_S = 5.0
#: Megatron-LM's only telemetry arguments (``megatron/training/arguments.py``).
OTEL_ENABLED_ARG = "--otel-enabled"
OTEL_SERVICE_NAME_ARG = "--otel-service-name"
OTEL_SPAN_GROUPS_ARG = "--otel-span-groups"
REFERENCE_OTEL_ARGS: tuple[str, ...] = (
    OTEL_ENABLED_ARG,
    OTEL_SERVICE_NAME_ARG,
    OTEL_SPAN_GROUPS_ARG,
)


class Handling(StrEnum):
    """How a setting reaches an external worker."""

    PASSED = "passed"
    TRANSLATED = "translated"
    REFUSED = "refused"


def env_text(value: Any) -> str:
    """A setting as the variable text a worker parses back to the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        q = urllib.parse.quote
        return ",".join(f"{q(str(k), safe='')}={q(str(v), safe='')}" for k, v in value.items())
    return str(value)


def _key(field: str) -> str:
    """The ``MEGATRON_OTEL_<KEY>`` variable of a telemetry field."""
    return P + next(k for k, f in TELEMETRY_KEYS.items() if f == field)


def _set_by_user(settings: Settings, path: str) -> bool:
    return settings.source(path).kind in ("flag", "env", "file")


def label(settings: Settings, path: str) -> str:
    """What the user typed for ``path`` (flag, variable or file key), else its flag."""
    source = settings.source(path)
    return source.name if source.kind in ("flag", "env", "file") else flag_name(path)


def resolved_list(settings: Settings) -> str:
    """The span-group spec in the reference's language: the resolved groups, comma separated."""
    return format_groups(settings.telemetry.groups)


def embedded_receiver(settings: Settings) -> bool:
    """Whether an external run's workers send to the launcher's embedded OTLP receiver: telemetry
    on and either the ``file`` exporter (the default without an endpoint), which nemo-lens does
    not have, or ``otlp`` with no endpoint configured (which would otherwise mean the SDK's
    localhost:4317, where nothing may listen). The launcher fills in the receiver's endpoint and
    protocol when it starts it."""
    t = settings.telemetry
    if not t.enabled or t.otel.sdk_disabled:
        return False
    return t.exporter == "file" or (t.exporter == "otlp" and not t.otel.endpoint_configured)


def reference_exporter(settings: Settings) -> str:
    """The exporter name an external worker gets (``otlp`` or ``console``)."""
    return "console" if settings.telemetry.exporter == "console" else "otlp"


def reference_span_names(groups: Iterable[SpanGroup]) -> list[str]:
    """The span names a Megatron-LM worker emits for these groups: the catalogue's entries that
    are not mlaunch extras, in catalogue order."""
    enabled = frozenset(groups)
    return [d.name for d in CATALOGUE if not d.extra and d.group in enabled]


# --------------------------------------------------------------------------------------------
# The rules


def _nothing(settings: Settings, run_id: str) -> dict[str, str]:
    return {}


def _no_args(settings: Settings) -> list[str]:
    return []


def _never(settings: Settings) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class Rule:
    """One setting (or a group of settings that travel alike) and its fate for external workers."""

    setting: str
    """As users name it (variables and flags)."""
    handling: Handling
    """What normally happens to it."""
    worker: str
    """What the worker receives (the docs table's column)."""
    refused: str = ""
    """When it is refused, why, and what to use instead ("" = never refused)."""
    paths: tuple[str, ...] = ()
    """The settings paths this row covers."""
    write: Callable[[Settings, str], dict[str, str]] = _nothing
    """The variables it contributes to the worker environment ``(settings, run_id)``."""
    args: Callable[[Settings], list[str]] = _no_args
    """The Megatron-LM arguments it contributes (only with ``megatron_args``)."""
    refuse: Callable[[Settings], str | None] = _never
    """The refusal message for these settings, or None."""
    applied: Callable[[Settings], str | None] = _never
    """A line for the summary when it rewrote something for these settings, or None."""


def _write_field(
    field: str, *, skip_empty: bool = False
) -> Callable[[Settings, str], dict[str, str]]:
    def write(settings: Settings, run_id: str) -> dict[str, str]:
        value = getattr(settings.telemetry, field)
        if skip_empty and value in ("", None):
            return {}  # nemo-lens reads an empty value as unset: write nothing rather than ""
        return {_key(field): env_text(value)}

    return write


def _spec_write(settings: Settings, run_id: str) -> dict[str, str]:
    groups = resolved_list(settings)
    return {_key("span_groups"): groups} if groups else {}


def _spec_args(settings: Settings) -> list[str]:
    groups = resolved_list(settings)
    # One argv item: a list can never start with '-' (argparse would take it for an option), but
    # the '=' form keeps that true for any value.
    return [f"{OTEL_SPAN_GROUPS_ARG}={groups}"] if groups else []


def _spec_refuse(settings: Settings) -> str | None:
    if settings.telemetry.enabled and not settings.telemetry.groups:
        return (
            f"{settings.telemetry.span_groups!r} resolves to no span group, which a Megatron-LM"
            " worker cannot be told: it reads an empty spec as 'default'. For no spans use"
            f" {flag_name('telemetry.traces_enabled').replace('--', '--no-', 1)} (metrics"
            f" stay), or {flag_name('telemetry.enabled').replace('--', '--no-', 1)}"
        )
    return None


def _spec_applied(settings: Settings) -> str | None:
    spec, groups = settings.telemetry.span_groups, resolved_list(settings)
    if not groups or spec.strip().lower() == groups:
        return None
    extension = "-" in spec or "goodput" in spec.lower()
    why = (
        "nemo-lens knows no '-group' or 'goodput'" if extension else "the same groups, spelled out"
    )
    return f"span groups {spec!r} -> {groups} ({why})"


def _strategy_refuse(settings: Settings) -> str | None:
    name = settings.telemetry.export_strategy
    if name in ExportStrategy._value2member_map_:
        return None
    return (
        f"custom strategy {name!r}: nemo-lens looks strategies up by registered name only and"
        " raises on every rank, even with telemetry off. Use single_rank, all_ranks, sampled or"
        " first_rank_per_node (custom 'module:function' strategies work with mlaunch's own trainer)"
    )


def _alias_applied(
    alias: str, target_path: str, target_key: str
) -> Callable[[Settings], str | None]:
    def applied(settings: Settings) -> str | None:
        source = settings.source(target_path)
        if source.kind == "env" and source.name.endswith(alias):
            value = env_text(getattr(settings.telemetry, target_path.split(".")[-1]))
            return f"{source.name} -> {P}{target_key}={value} (nemo-lens never reads {alias})"
        return None

    return applied


def _sampler_refuse(settings: Settings) -> str | None:
    t = settings.telemetry
    name = t.otel.traces_sampler
    if t.enabled and t.sampler_enabled and name is not None and name not in _KEEP_ALL_SAMPLERS:
        return (
            f"with the rank-aware sampler on, nemo-lens installs it as the tracer's sampler, which"
            f" replaces OTEL_TRACES_SAMPLER={name}: the two do not compose in a Megatron-LM worker."
            " Keep one: unset OTEL_TRACES_SAMPLER, or turn SAMPLER_ENABLED off (mlaunch's own"
            " trainer composes them)"
        )
    return None


def _logs_refuse(settings: Settings) -> str | None:
    t = settings.telemetry
    if (
        t.enabled
        and t.logs_enabled
        and t.exporter == "otlp"
        and t.otel.endpoint_configured
        and t.otel.protocol != "grpc"
    ):
        return (
            f"nemo-lens (0.1.0 and 0.2.0) sends logs over OTLP/gRPC whatever the protocol, so with"
            f" {t.otel.protocol} to {t.otel.endpoint} every log export would fail. Use"
            " OTEL_EXPORTER_OTLP_PROTOCOL=grpc, or turn LOGS_ENABLED off"
        )
    return None


def _exporter_write(settings: Settings, run_id: str) -> dict[str, str]:
    return {_key("exporter"): reference_exporter(settings)}


def _exporter_refuse(settings: Settings) -> str | None:
    if settings.telemetry.enabled and settings.telemetry.exporter == "none":
        return (
            "nemo-lens has no 'none' exporter (it raises \"Unknown exporter type\" on the exporting"
            f" ranks). Use {flag_name('telemetry.enabled').replace('--', '--no-', 1)} for a run"
            f" without telemetry, or {flag_name('telemetry.exporter')} file (the default: the"
            " launcher's embedded receiver)"
        )
    return None


def _exporter_applied(settings: Settings) -> str | None:
    if embedded_receiver(settings):
        return (
            "exporter 'file' -> 'otlp' to the launcher's embedded OTLP receiver on loopback,"
            f" which writes {lay.TELEMETRY_DIR}/ in the run directory (nemo-lens has no file"
            " exporter)"
        )
    return None


#: The flight recorder's settings (mlaunch.telemetry's recorder; nemo-lens has none).
RECORDER_PATHS: tuple[str, ...] = (
    "telemetry.recorder_groups",
    "telemetry.recorder_iters",
    "telemetry.recorder_max_mib",
    "telemetry.recorder_slow_factor",
)


def _recorder_write(settings: Settings, run_id: str) -> dict[str, str]:
    """All four when the recorder is on, the groups resolved (the reference's language); a
    ``mlaunch.telemetry`` script reads them, nemo-lens ignores keys it does not know."""
    t = settings.telemetry
    if not t.recorder_group_set:
        return {}
    env = {
        _key(p.rpartition(".")[2]): env_text(getattr(t, p.rpartition(".")[2]))
        for p in RECORDER_PATHS
    }
    env[_key("recorder_groups")] = format_groups(t.recorder_group_set)
    return env


def _recorder_applied(settings: Settings) -> str | None:
    t = settings.telemetry
    if not (t.enabled and t.recorder_group_set):
        return None
    return (
        f"flight recorder {t.recorder_groups!r}: kept by --script workers that use"
        " mlaunch.telemetry; a nemo-lens (Megatron-LM) worker has no flight recorder and ignores"
        f" {P}RECORDER_*"
    )


def _run_id_write(settings: Settings, run_id: str) -> dict[str, str]:
    return {ec.RUN_ID: run_id}


def _mlaunch_only(path: str, why: str, default: Any = None) -> Callable[[Settings], str | None]:
    def refuse(settings: Settings) -> str | None:
        value = getattr(settings.telemetry, path.rpartition(".")[2])
        if _set_by_user(settings, path) and value != default:
            return why
        return None

    return refuse


def _service_write(settings: Settings, run_id: str) -> dict[str, str]:
    return {ec.OTEL_SERVICE_NAME: settings.telemetry.service_name}


def _service_args(settings: Settings) -> list[str]:
    return [f"{OTEL_SERVICE_NAME_ARG}={settings.telemetry.service_name}"]


def _fallback_applied(settings: Settings) -> str | None:
    names = sorted(
        s.name for s in settings.sources().values() if s.name.startswith(ec.FALLBACK_PREFIX)
    )
    if not names:
        return None
    return f"{', '.join(names)} -> written as {P}* (the {ec.FALLBACK_PREFIX}* variables removed)"


def _otel_writer(variables: tuple[str, ...]) -> Callable[[Settings, str], dict[str, str]]:
    def write(settings: Settings, run_id: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for var in variables:
            if embedded_receiver(settings) and var in ec.OTLP_TARGET_VARS:
                continue  # the launcher points the workers at its receiver
            section, fld = OTEL_ENV[var]
            path = f"{section}.{fld}"
            if _set_by_user(settings, path):
                obj: Any = (
                    settings.telemetry.otel if section == "telemetry.otel" else settings.telemetry
                )
                out[var] = env_text(getattr(obj, fld))
        return out

    return write


def _protocol_applied(settings: Settings) -> str | None:
    o = settings.telemetry.otel
    if embedded_receiver(settings) or "http/json" not in (
        o.base_protocol,
        o.traces_protocol,
        o.metrics_protocol_override,
    ):
        return None
    return "http/json: nemo-lens sends OTLP/HTTP protobuf (the Python SDK has no JSON encoder)"


def _trace_sampler_applied(settings: Settings) -> str | None:
    t = settings.telemetry
    if t.enabled and t.sampler_enabled and t.otel.traces_sampler in _KEEP_ALL_SAMPLERS:
        return (
            f"{ec.OTEL_TRACES_SAMPLER}={t.otel.traces_sampler} is replaced by nemo-lens's rank-aware"
            " sampler (it keeps every span of a sampled rank)"
        )
    return None


_ENDPOINT_VARS = (ec.OTLP_ENDPOINT, ec.OTLP_TRACES_ENDPOINT, ec.OTLP_METRICS_ENDPOINT)
_PROTOCOL_VARS = (ec.OTLP_PROTOCOL, ec.OTLP_TRACES_PROTOCOL, ec.OTLP_METRICS_PROTOCOL)
_SAMPLER_VARS = (ec.OTEL_TRACES_SAMPLER, ec.OTEL_TRACES_SAMPLER_ARG)
_OTHER_OTEL_VARS = tuple(
    v
    for v in OTEL_ENV
    if v not in (*_ENDPOINT_VARS, *_PROTOCOL_VARS, *_SAMPLER_VARS, ec.OTEL_SERVICE_NAME)
)


def _paths(variables: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"{OTEL_ENV[v][0]}.{OTEL_ENV[v][1]}" for v in variables)


#: Every telemetry setting, in the order the docs table lists them.
RULES: tuple[Rule, ...] = (
    Rule(
        f"`{P}ENABLED`, `--otel-enabled`",
        Handling.PASSED,
        f"`{P}ENABLED=true|false`; `--otel-enabled` when on",
        paths=("telemetry.enabled",),
        write=_write_field("enabled"),
        args=lambda s: [OTEL_ENABLED_ARG] if s.telemetry.enabled else [],
    ),
    Rule(
        "`OTEL_SERVICE_NAME`, `--otel-service-name`",
        Handling.PASSED,
        "`OTEL_SERVICE_NAME` and one argument `--otel-service-name=<name>`",
        paths=("telemetry.service_name",),
        write=_service_write,
        args=_service_args,
    ),
    Rule(
        f"`{P}SPAN_GROUPS`, `--otel-span-groups`",
        Handling.TRANSLATED,
        "the resolved groups as a comma list (`all,-layer`, `goodput`, `-layer,all` become plain"
        f" group names) in `{P}SPAN_GROUPS` and as one argument `--otel-span-groups=<list>`",
        "when it resolves to no group with telemetry on: Megatron-LM reads an empty spec as"
        " `default`; use `--no-otel-traces-enabled` (metrics only) or `--no-otel-enabled`",
        paths=("telemetry.span_groups",),
        write=_spec_write,
        args=_spec_args,
        refuse=_spec_refuse,
        applied=_spec_applied,
    ),
    Rule(
        f"`{P}EXPORTER`, `--otel-exporter`",
        Handling.TRANSLATED,
        "`console` as it is; `otlp` to your endpoint as it is (through the launcher's relay by"
        " default); `file` (the default without an endpoint), or `otlp` with no endpoint -> `otlp`"
        " to the launcher's embedded OTLP receiver on loopback, which writes the run directory's"
        " `telemetry/`; the launcher sets `OTEL_EXPORTER_OTLP_ENDPOINT`/`_PROTOCOL` to it",
        '`none`: nemo-lens has no such exporter ("Unknown exporter type"); use'
        " `--no-otel-enabled`, or `file`",
        paths=("telemetry.exporter",),
        write=_exporter_write,
        refuse=_exporter_refuse,
        applied=_exporter_applied,
    ),
    Rule(
        f"`{P}EXPORT_STRATEGY`, `--otel-export-strategy`",
        Handling.PASSED,
        f"`{P}EXPORT_STRATEGY=<name>` (lower case) for the four built-in strategies",
        "a custom `module:function`: nemo-lens looks strategies up by registered name and raises"
        " on every rank, even with telemetry off; use a built-in (custom ones work with mlaunch's"
        " trainer)",
        paths=("telemetry.export_strategy",),
        write=_write_field("export_strategy"),
        refuse=_strategy_refuse,
    ),
    Rule(
        f"`{P}RANK_STRATEGY` (alias)",
        Handling.TRANSLATED,
        f"written as `{P}EXPORT_STRATEGY` (nemo-lens never reads RANK_STRATEGY); the alias is"
        " removed from the worker environment",
        applied=_alias_applied("RANK_STRATEGY", "telemetry.export_strategy", "EXPORT_STRATEGY"),
    ),
    Rule(
        f"`{P}EXPORT_RANK`",
        Handling.PASSED,
        f"`{P}EXPORT_RANK`",
        paths=("telemetry.export_rank",),
        write=_write_field("export_rank"),
    ),
    Rule(
        f"`{P}EXPORT_SAMPLE_RATE`",
        Handling.PASSED,
        f"`{P}EXPORT_SAMPLE_RATE` (in [0, 1], checked here)",
        paths=("telemetry.export_sample_rate",),
        write=_write_field("export_sample_rate"),
    ),
    Rule(
        f"`{P}SAMPLER_ENABLED`",
        Handling.PASSED,
        f"`{P}SAMPLER_ENABLED`; nemo-lens's rank-aware sampler then *replaces* OTEL_TRACES_SAMPLER"
        " (the summary says so)",
        "together with an OTEL_TRACES_SAMPLER that drops traces (ratio, always_off,"
        " parentbased_always_off): they would not compose; keep one",
        paths=("telemetry.sampler_enabled",),
        write=_write_field("sampler_enabled"),
        refuse=_sampler_refuse,
    ),
    Rule(
        f"`{P}SAMPLING_STRATEGY` (alias)",
        Handling.TRANSLATED,
        f"`rank_aware` -> `{P}SAMPLER_ENABLED=true`, `none`/`off`/`default` -> `false` (nemo-lens"
        " never reads SAMPLING_STRATEGY); the alias is removed",
        applied=_alias_applied("SAMPLING_STRATEGY", "telemetry.sampler_enabled", "SAMPLER_ENABLED"),
    ),
    Rule(
        f"`{P}TRACES_ENABLED`, `{P}METRICS_ENABLED`",
        Handling.PASSED,
        "as they are",
        paths=("telemetry.traces_enabled", "telemetry.metrics_enabled"),
        write=lambda s, r: {
            **_write_field("traces_enabled")(s, r),
            **_write_field("metrics_enabled")(s, r),
        },
    ),
    Rule(
        f"`{P}LOGS_ENABLED`",
        Handling.PASSED,
        f"`{P}LOGS_ENABLED`",
        "with an http protocol to your endpoint: nemo-lens (0.1.0, 0.2.0) sends logs over OTLP/gRPC"
        " whatever the protocol; use grpc or turn logs off",
        paths=("telemetry.logs_enabled",),
        write=_write_field("logs_enabled"),
        refuse=_logs_refuse,
    ),
    Rule(
        f"`{P}RUN_ID`, `--otel-run-id`",
        Handling.PASSED,
        f"`{P}RUN_ID`: the run id the launcher chose (always written, the same on every rank)",
        paths=("telemetry.run_id",),
        write=_run_id_write,
    ),
    Rule(
        f"`{P}USER_ID`",
        Handling.PASSED,
        f"`{P}USER_ID` when not empty (nemo-lens reads empty as unset: nothing is written)",
        paths=("telemetry.user_id",),
        write=_write_field("user_id", skip_empty=True),
    ),
    Rule(
        f"`{P}SHUTDOWN_TIMEOUT` (mlaunch only)",
        Handling.REFUSED,
        "not written (nemo-lens has no such key)",
        "when set to anything but 5: nemo-lens flushes at shutdown with a fixed 5 s timeout",
        paths=("telemetry.shutdown_timeout_s",),
        refuse=_mlaunch_only(
            "telemetry.shutdown_timeout_s",
            "nemo-lens flushes at shutdown with a fixed 5 s timeout; a Megatron-LM worker cannot"
            " be given another (unset it; mlaunch's own trainer honours it)",
            REFERENCE_SHUTDOWN_TIMEOUT_S,
        ),
    ),
    Rule(
        f"`{P}TRACE_SEGMENT_ITERS` (mlaunch only)",
        Handling.REFUSED,
        "not written (nemo-lens has no such key)",
        "when set: Megatron-LM starts a new `megatron.train` trace every `--save-interval`"
        " iterations; set `--save-interval` instead",
        paths=("telemetry.trace_segment_iters",),
        refuse=_mlaunch_only(
            "telemetry.trace_segment_iters",
            "Megatron-LM starts a new megatron.train trace every --save-interval iterations and"
            " has no such setting: set --save-interval instead (unset this one)",
        ),
    ),
    Rule(
        f"`{P}RECORDER_*` (the flight recorder)",
        Handling.PASSED,
        f"when the recorder is on: `{P}RECORDER_GROUPS` (the resolved groups), `_ITERS`,"
        " `_MAX_MIB`, `_SLOW_FACTOR`; a script that uses `mlaunch.telemetry` records, a nemo-lens"
        " (Megatron-LM) worker has no flight recorder and ignores them (the summary says so)",
        paths=RECORDER_PATHS,
        write=_recorder_write,
        applied=_recorder_applied,
    ),
    Rule(
        f"`{ec.FALLBACK_PREFIX}<KEY>` (fallback prefix)",
        Handling.TRANSLATED,
        f"written as `{P}<KEY>`; every `{ec.FALLBACK_PREFIX}*` variable is removed (one truth)",
        applied=_fallback_applied,
    ),
    Rule(
        "`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`",
        Handling.PASSED,
        "as validated (lower case); the SDK reads them unless the rank-aware sampler replaces them",
        paths=_paths(_SAMPLER_VARS),
        write=_otel_writer(_SAMPLER_VARS),
        applied=_trace_sampler_applied,
    ),
    Rule(
        "`OTEL_EXPORTER_OTLP_ENDPOINT`, `_TRACES_ENDPOINT`, `_METRICS_ENDPOINT` (`--otlp-endpoint` ...)",
        Handling.PASSED,
        "as they are; with the embedded receiver they are not inherited (the launcher points the"
        " workers at its receiver)",
        paths=_paths(_ENDPOINT_VARS),
        write=_otel_writer(_ENDPOINT_VARS),
    ),
    Rule(
        "`OTEL_EXPORTER_OTLP_PROTOCOL`, `_TRACES_PROTOCOL`, `_METRICS_PROTOCOL`",
        Handling.PASSED,
        "`grpc`, `http/protobuf`, `http/json` (nemo-lens sends http/json as OTLP/HTTP protobuf:"
        " the Python SDK has no JSON encoder); with the embedded receiver, set by the launcher",
        paths=_paths(_PROTOCOL_VARS),
        write=_otel_writer(_PROTOCOL_VARS),
        applied=_protocol_applied,
    ),
    Rule(
        ", ".join(f"`{v}`" for v in _OTHER_OTEL_VARS),
        Handling.PASSED,
        "as validated; the SDK reads them (other `OTEL_*` variables travel as given)",
        paths=_paths(_OTHER_OTEL_VARS),
        write=_otel_writer(_OTHER_OTEL_VARS),
    ),
    Rule(
        f"`{ec.CUDA_DEVICE_MAX_CONNECTIONS}` (any entry point)",
        Handling.TRANSLATED,
        "set to `1` when tensor or context parallel size > 1 and you did not set it: Megatron-LM's"
        " argument check requires it before Blackwell",
        # It depends on the inherited environment: launch.plan applies cuda_connections().
    ),
    Rule(
        "`PYTHONPATH` (live capture)",
        Handling.TRANSLATED,
        "with traces on: mlaunch's live-capture hook first (`mlaunch/lens_hook/inject`, a folder"
        " holding only a `sitecustomize.py`, which runs the one it shadows), then yours as it is;"
        " it lets `mlaunch trace capture --seconds` switch nemo-lens's span groups (docs/capture.md),"
        " and keeps a folder named `mlaunch` in the script's directory from shadowing the"
        " installed package",
        # It depends on the inherited environment: worker_env applies it.
    ),
)


# --------------------------------------------------------------------------------------------
# Derived views


def refusals(settings: Settings) -> list[tuple[str, str]]:
    """``(what the user typed, why + what instead)`` for every setting an external worker cannot
    honour; empty when the run can go ahead."""
    out: list[tuple[str, str]] = []
    for rule in RULES:
        message = rule.refuse(settings)
        if message is not None:
            path = next((p for p in rule.paths if _set_by_user(settings, p)), rule.paths[0])
            out.append(
                (label(settings, path), f"a --script/--module worker cannot take this: {message}")
            )
    return out


def worker_env(settings: Settings, run_id: str) -> dict[str, str]:
    """The telemetry environment an external worker gets (no refusal checked here)."""
    env: dict[str, str] = {}
    for rule in RULES:
        env.update(rule.write(settings, run_id))
    return env


def worker_args(settings: Settings) -> list[str]:
    """Megatron-LM's ``--otel-*`` arguments, each one argv item."""
    return [arg for rule in RULES for arg in rule.args(settings)]


def translations(settings: Settings) -> list[str]:
    """What was rewritten for these settings, one line each, for the summary and doctor."""
    return [line for rule in RULES if (line := rule.applied(settings)) is not None]


def cuda_connections(settings: Settings, environ: dict[str, str] | Any) -> tuple[str | None, str]:
    """``(value to set or None, summary line)`` for CUDA_DEVICE_MAX_CONNECTIONS (any entry point)."""
    p = settings.parallelism
    name = ec.CUDA_DEVICE_MAX_CONNECTIONS
    if max(p.tensor_model_parallel_size, p.context_parallel_size) <= 1:
        return None, ""
    given = environ.get(name)
    if given is None:
        return (
            "1",
            f"{name}=1 set (tensor/context parallel > 1: Megatron-LM requires it before Blackwell)",
        )
    if given.strip() == "1":
        return None, f"{name}=1 (yours)"
    return None, (
        f"{name}={given!r} is yours and kept; Megatron-LM's argument check wants 1 with tensor or"
        " context parallel > 1 before Blackwell (FSDP wants it unset)"
    )


def rank_sampler_text(settings: Settings) -> str:
    """The samplers as nemo-lens applies them in an external worker."""
    t = settings.telemetry
    trace = t.otel.traces_sampler or "parentbased_always_on"
    if t.otel.traces_sampler in ("traceidratio", "parentbased_traceidratio"):
        arg = 1.0 if t.otel.traces_sampler_arg is None else t.otel.traces_sampler_arg
        trace += f" (ratio {arg:g})"
    if t.sampler_enabled:
        return (
            f"rank-aware (nemo-lens): keeps every span of ranks under rate {t.export_sample_rate:g}"
            f", drops the others; it replaces the trace sampler ({trace} not applied)"
        )
    where = "from OTEL_TRACES_SAMPLER" if t.otel.traces_sampler else "the SDK's default"
    return f"trace: {trace} ({where}); rank-aware: off"


def reference_view(settings: Settings) -> dict[str, Any]:
    """What an external worker will resolve, as ``resolved.json`` records it."""
    t = settings.telemetry
    return {
        "enabled": t.enabled,
        "span_groups": sorted(g.value for g in t.groups),
        "span_names": reference_span_names(t.groups) if t.enabled else [],
        "exporter": reference_exporter(settings),
        "embedded_receiver": embedded_receiver(settings),
        "export_strategy": t.export_strategy,
        "sampler": rank_sampler_text(settings),
        "service_name": t.service_name,
        "translations": translations(settings),
    }


def markdown_table() -> str:
    """The docs/train.md table: every setting, how an external worker receives it."""
    lines = [
        "| setting | for `--script`/`--module` | the worker receives | refused when (why; instead) |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        cells = [rule.setting, rule.handling.value, rule.worker, rule.refused or "never"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
