"""Every telemetry variable and the config file through mlaunch's settings (the checks of
``mlaunch train``), plus what the settings accept but a user probably did not mean."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.doctor.results import CheckResult, fail, ok, warn
from mlaunch.envcontract import FALLBACK_PREFIX, PRIMARY_PREFIX
from mlaunch.model.spec import closest_word
from mlaunch.model.strategies import format_ranks, is_custom_strategy
from mlaunch.settings import (
    ALIAS_KEYS,
    OTEL_ENV,
    RATIO_SAMPLERS,
    SECRET_ENV,
    TELEMETRY_KEYS,
    TRACE_SAMPLERS,
    Problem,
    Settings,
    collect_problems,
    env_names,
    flag_name,
    load_settings,
    otlp_timeout_warning,
    parse_bool,
    redact_shown,
    telemetry_off_reason,
)


def _telemetry_vars(environ: Mapping[str, str]) -> list[str]:
    names = [n for n in environ if n.startswith((PRIMARY_PREFIX, FALLBACK_PREFIX))]
    names += [n for n in OTEL_ENV if n in environ]
    names += [n for n in SECRET_ENV if n in environ and n not in OTEL_ENV]
    return sorted(set(names))


_BOOL_KEYS = frozenset(k for k, f in TELEMETRY_KEYS.items() if f.endswith("enabled")) | {
    "SAMPLING_STRATEGY"
}


def _normalized(key: str, value: str) -> str:
    v = value.strip()
    if key == "SAMPLING_STRATEGY":
        return "true" if v.lower() == "rank_aware" else "false"
    if key in _BOOL_KEYS:
        try:
            return str(parse_bool(v)).lower()
        except ValueError:
            return v.lower()
    return v.lower() if key in ("EXPORT_STRATEGY", "RANK_STRATEGY", "EXPORTER") else v


def _effective(environ: Mapping[str, str], prefix: str, field: str) -> tuple[str, str] | None:
    """The variable (key or alias) and value a prefix contributes for the telemetry ``field``,
    in the settings' own precedence (:func:`mlaunch.settings.env_names`)."""
    for name in env_names(field):
        value = environ.get(name, "").strip()
        if value and name.startswith(prefix):
            return name, value
    return None


_SAMPLER_VARS = (ec.OTEL_TRACES_SAMPLER, ec.OTEL_TRACES_SAMPLER_ARG)


def _is_variable(field: str) -> bool:
    """Whether a problem's field is an environment variable (not a flag or a file key)."""
    return field.isupper() and "_" in field


def _problem_result(problem: Problem) -> CheckResult:
    """A settings problem as a failed check with a concrete fix: a rename when the settings
    suggest the name meant, else what to change where the value was given."""
    field, suggestion = problem.field, problem.suggestion
    if problem.kind == "unknown" and _is_variable(field):
        if suggestion:
            return fail(
                "unknown variable",
                f"{field} is not a telemetry variable (did you mean {suggestion}?)",
                f"rename {field} to {suggestion}",
            )
        # The settings' message goes on to list the valid keys: keep that part.
        valid = problem.message.partition("; ")[2]
        return fail(
            "unknown variable", f"{field} is not a telemetry variable; {valid}", f"unset {field}"
        )
    if field in _SAMPLER_VARS:
        fix = (
            f"set {field} to a ratio in [0, 1], e.g. 0.1"
            if field.endswith("_ARG")
            else f"set {field} to one of: {', '.join(TRACE_SAMPLERS)}"
        )
        return fail("sampler", str(problem), fix)
    if _is_variable(field):
        return fail("config", str(problem), f"fix or unset {field}")
    if field.startswith("--"):
        return fail("config", str(problem), f"fix the value of {field}")
    if " [" in field:  # "FILE [section] key"
        return fail("config", str(problem), "fix this key in the config file")
    section, _, key = field.partition(".")
    return fail("config", str(problem), f"set {key or field} in [{section}] of --config FILE")


def _best_effort_settings(
    environ: Mapping[str, str],
    config: Path | None,
    problems: list[Problem],
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Settings for the checks that need them when the configuration has problems: without the
    offending variables (and flags), then without the config file, then the defaults."""
    bad = {p.field for p in problems}
    cleaned = {k: v for k, v in environ.items() if k not in bad}
    kept = {k: v for k, v in (flags or {}).items() if flag_name(k) not in bad}
    for cfg in (config, None):
        settings, _ = collect_problems(flags=kept, environ=cleaned, config=cfg)
        if settings is not None:
            return settings
    return load_settings(environ={}, check_cross_fields=False)


def _train_default_note(environ: Mapping[str, str], enabled: bool, exporter: str | None) -> str:
    """What plain ``mlaunch train`` (its default config) does with telemetry, when that differs
    from what doctor checked without a config ('' when the same or unknown)."""
    from mlaunch.launcher.configs import DEFAULT_CONFIG, resolve_config

    try:
        path = resolve_config(None, Path.cwd())
    except Exception:  # noqa: BLE001 - a note only; the configuration check reports problems
        return ""
    train_settings, _ = collect_problems(environ=environ, config=path)
    if train_settings is None:
        return ""
    tt = train_settings.telemetry
    if (tt.enabled, tt.exporter) == (enabled, exporter):
        return ""
    return (
        f"plain `mlaunch train` uses config {DEFAULT_CONFIG!r}: telemetry"
        f" {'enabled' if tt.enabled else 'disabled'}, exporter {tt.exporter};"
        f" check that with `mlaunch doctor --config {DEFAULT_CONFIG}`"
    )


def check_configuration(
    environ: Mapping[str, str],
    config: Path | None = None,
    flags: Mapping[str, Any] | None = None,
) -> tuple[list[CheckResult], Settings]:
    """Every telemetry variable through mlaunch's settings, plus what the settings accept but a
    user probably did not mean. ``flags``: settings given as ``mlaunch train`` flags (doctor's
    ``--script``/``--module``, ``--rdzv-endpoint``, ``--nnodes``, ``--node-rank``). Returns the
    results and the (best-effort) settings."""
    settings, problems = collect_problems(flags=flags, environ=environ, config=config)
    results = [_problem_result(p) for p in problems]
    if settings is None:
        settings = _best_effort_settings(environ, config, problems, flags)
    names = _telemetry_vars(environ)
    shown = ", ".join(f"{n}={redact_shown(n, environ[n])}" for n in names)
    where = f" and {config}" if config else ""
    if not problems:
        results.insert(
            0,
            ok(
                "configuration",
                f"valid (the checks of mlaunch train): {len(names)} variable(s){where}"
                + (f": {shown}" if shown else "; defaults apply"),
            ),
        )
    results += _otel_typos(environ)
    results += _prefix_conflicts(environ)
    results += _alias_notes(environ)
    t = settings.telemetry
    checked = (
        f"with {config.name}" if config else "environment over the built-in defaults, no config"
    )
    note = "" if t.enabled else f"set {PRIMARY_PREFIX}ENABLED=true to export telemetry"
    state = "enabled" if t.enabled else "disabled"
    if t.otel.sdk_disabled:  # ENABLED=true would not cure it: say what does
        why = telemetry_off_reason(str(settings.source("telemetry.enabled")), sdk_disabled=True)
        state, _, note = f"disabled by {why}".partition(": ")
    elif config is None:
        # Plain `mlaunch train` reads its default config (tiny: telemetry on), so a plain
        # doctor must not let "disabled" stand for what train will do.
        note = _train_default_note(environ, t.enabled, t.exporter) or note
    results.append(
        ok(
            "telemetry",
            f"{state} ({checked}); exporter {t.exporter}; span"
            f" groups {t.span_groups!r} ({len(t.groups)} groups); strategy {t.export_strategy}",
            note,
        )
    )
    if t.otel.sdk_disabled and _asked_for_telemetry(environ, config, flags):
        results.append(
            warn(
                "sdk disabled",
                f"{ec.OTEL_SDK_DISABLED}=true turns off the telemetry the configuration enables"
                " (the OpenTelemetry SDK's own switch: every signal is a no-op)",
                f"unset {ec.OTEL_SDK_DISABLED} (or set {PRIMARY_PREFIX}ENABLED=false)",
            )
        )
    if not any(p.field in _SAMPLER_VARS for p in problems):
        results.append(_sampler_result(settings))
    results += _timeout_results(environ)
    results.append(_exporting_ranks_result(settings))
    return results, settings


def _asked_for_telemetry(
    environ: Mapping[str, str], config: Path | None, flags: Mapping[str, Any] | None
) -> bool:
    """Whether the configuration turns telemetry on apart from ``OTEL_SDK_DISABLED`` (which the
    settings resolve as telemetry off, naming the variable)."""
    rest = {k: v for k, v in environ.items() if k != ec.OTEL_SDK_DISABLED}
    asked, _ = collect_problems(flags=flags, environ=rest, config=config)
    return asked is not None and asked.telemetry.enabled


#: Standard OTel variables besides the ones mlaunch validates (OTEL_ENV), for typo detection.
KNOWN_OTEL_ENV: frozenset[str] = frozenset(
    {*OTEL_ENV, *SECRET_ENV}
    | {ec.otlp_var(o, signal) for signal in ec.OTLP_SIGNAL_WORDS for o in ec.OTLP_OPTIONS}
    | set(ec.OTEL_SDK_ONLY_VARS)
)


def _otel_typos(environ: Mapping[str, str]) -> list[CheckResult]:
    """``OTEL_*`` names that are not standard but are one typo away from one mlaunch reads.

    A warning, not a failure: OTel has more variables than this list, so only near-misses of
    known names are reported (the SDK would silently ignore the typo).
    """
    out = []
    for name in sorted(environ):
        if not name.startswith(ec.OTEL_PREFIX) or name in KNOWN_OTEL_ENV:
            continue
        # Stricter than closest_word's default: this list is not all of OTel's variables, so
        # only a near-certain typo is worth a warning.
        close = closest_word(name, sorted(KNOWN_OTEL_ENV), cutoff=0.85)
        if close:
            out.append(
                warn(
                    "unknown variable",
                    f"{name} is not an OpenTelemetry variable (did you mean {close}?);"
                    " the SDK ignores it",
                    f"rename {name} to {close}",
                )
            )
    return out


def _prefix_conflicts(environ: Mapping[str, str]) -> list[CheckResult]:
    """Telemetry settings given under both prefixes with different values (the primary wins)."""
    out = []
    for field in TELEMETRY_KEYS.values():
        primary = _effective(environ, PRIMARY_PREFIX, field)
        fallback = _effective(environ, FALLBACK_PREFIX, field)
        if not primary or not fallback:
            continue
        (pv, pval), (fv, fval) = primary, fallback
        if _normalized(pv.removeprefix(PRIMARY_PREFIX), pval) != _normalized(
            fv.removeprefix(FALLBACK_PREFIX), fval
        ):
            out.append(
                warn(
                    "prefix conflict",
                    f"{pv}={pval!r} and {fv}={fval!r} differ; {pv} wins",
                    f"unset {fv} (or give both the same value)",
                )
            )
    return out


def _alias_notes(environ: Mapping[str, str]) -> list[CheckResult]:
    """Megatron-LM's alias names that mlaunch honours but nemo-lens ignores."""
    out = []
    for prefix in (PRIMARY_PREFIX, FALLBACK_PREFIX):
        for alias, target in ALIAS_KEYS.items():
            value = environ.get(prefix + alias, "").strip()
            if value:
                out.append(
                    ok(
                        "alias",
                        f"{prefix}{alias}={value} is honoured as {prefix}{target}; Megatron-LM's"
                        f" reference (nemo-lens) ignores {alias}",
                        f"for runs outside mlaunch, set {prefix}{target} instead",
                    )
                )
    return out


def _sampler_result(settings: Settings) -> CheckResult:
    t, o = settings.telemetry, settings.telemetry.otel
    sampler = o.traces_sampler or "parentbased_always_on (SDK default)"
    rank = (
        f"rank-aware sampler keeps ranks under {t.export_sample_rate:g}"
        if t.sampler_enabled
        else "rank-aware sampler off"
    )
    if o.traces_sampler_arg is not None and o.traces_sampler not in RATIO_SAMPLERS:
        return warn(
            "sampler",
            f"{ec.OTEL_TRACES_SAMPLER_ARG}={o.traces_sampler_arg:g} is ignored by sampler"
            f" {sampler}",
            f"set {ec.OTEL_TRACES_SAMPLER}=parentbased_traceidratio, or unset"
            f" {ec.OTEL_TRACES_SAMPLER_ARG}",
        )
    if o.traces_sampler in RATIO_SAMPLERS:
        ratio = 1.0 if o.traces_sampler_arg is None else o.traces_sampler_arg
        kept = ratio * (t.export_sample_rate if t.sampler_enabled else 1.0)
        return ok(
            "sampler",
            f"{o.traces_sampler} ratio {ratio:g}; {rank}; about {kept:.3g} of traces kept",
            ""
            if o.traces_sampler_arg is not None
            else f"{ec.OTEL_TRACES_SAMPLER_ARG} unset: ratio 1.0",
        )
    return ok("sampler", f"{sampler}; {rank}")


def _timeout_results(environ: Mapping[str, str]) -> list[CheckResult]:
    out = []
    for var in (ec.OTLP_TIMEOUT, ec.OTLP_TRACES_TIMEOUT):
        raw = environ.get(var, "").strip()
        try:
            value = float(raw)
        except ValueError:
            continue  # unset, or already reported by the settings
        if (long := otlp_timeout_warning(var, value)) is not None:
            out.append(warn("otlp timeout", *long))
        else:
            out.append(ok("otlp timeout", f"{var}={raw} s"))
    return out


def _exporting_ranks_result(settings: Settings) -> CheckResult:
    t, launch = settings.telemetry, settings.launch
    world = settings.world_size
    layout = f"world size {world} ({launch.nnodes} node(s) x {launch.nproc_per_node})"
    if not t.enabled:
        return ok("exporting ranks", f"telemetry disabled: no rank exports ({layout})")
    if is_custom_strategy(t.export_strategy):  # user code: imported and checked, never called
        return ok(
            "exporting ranks",
            f"custom strategy {t.export_strategy!r} imports and is callable; each worker calls"
            f" it ({layout})",
        )
    ranks = settings.exporting_ranks()
    if not ranks:
        return warn(
            "exporting ranks",
            f"no rank exports: {t.export_strategy} at rate {t.export_sample_rate:g}, {layout}",
            f"raise {PRIMARY_PREFIX}EXPORT_SAMPLE_RATE or use {PRIMARY_PREFIX}EXPORT_STRATEGY="
            "single_rank",
        )
    return ok(
        "exporting ranks",
        f"{t.export_strategy}: rank(s) {format_ranks(ranks)} of {layout} export",
    )
