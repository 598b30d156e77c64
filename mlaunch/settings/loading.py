"""Every source -> one validated :class:`Settings`: merge by precedence, validate, name each
problem by what the user typed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mlaunch.model.spec import quoted
from mlaunch.settings.checks import cross_field_problems
from mlaunch.settings.problems import Problem, ProblemKind, SettingsError
from mlaunch.settings.schema import Settings, Source, TelemetrySettings
from mlaunch.settings.sources import EnvSource, FileSource, FlagSource, Layer


def _error_label(loc: tuple[Any, ...], layers: list[Layer]) -> str:
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


def _error_problem(err: Mapping[str, Any], layers: list[Layer]) -> Problem:
    """A pydantic error as a :class:`Problem`: an unexpected key is ``unknown``; a validator's
    error with a ``suggestion`` (:class:`UnknownName`, a span-spec or export-strategy error)
    carries it through pydantic's error context."""
    kind: ProblemKind = "unknown" if err.get("type") == "extra_forbidden" else "invalid"
    cause = (err.get("ctx") or {}).get("error")
    return Problem(
        _error_label(err["loc"], layers),
        _clean_message(err),
        kind,
        getattr(cause, "suggestion", None),
    )


def _merge(lower: dict[str, Any], higher: dict[str, Any]) -> dict[str, Any]:
    """``lower`` updated by ``higher``, table by table: a mapping given by two sources (a file's
    ``[telemetry.otel.headers]`` and a flag's) keeps the keys of both, the higher one's winning."""
    out = dict(lower)
    for key, value in higher.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


#: The endpoint settings (``--otlp-endpoint`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` and the
#: per-signal ones): a user who names one asks for OTLP export there.
ENDPOINT_PATHS: tuple[str, ...] = (
    "telemetry.otel.base_endpoint",
    "telemetry.otel.traces_endpoint",
    "telemetry.otel.metrics_endpoint_override",
)


def _endpoint_over_shipped_exporter(layers: list[Layer]) -> Layer | None:
    """A layer choosing OTLP export when the user named an endpoint (flag or variable) and the
    only exporter given is a shipped config's (None otherwise).

    A shipped config's value is mlaunch's default, not the user's choice: tiny.toml's
    ``exporter = "file"`` would otherwise send the spans of the seed's own env-only
    configuration (``OTEL_EXPORTER_OTLP_ENDPOINT=...``, nothing else) to files. An exporter the
    user chose (a flag, ``MEGATRON_OTEL_EXPORTER``, their own config file) stands.
    """
    files = [la for la in layers if isinstance(la, FileSource)]
    if not files or not files[0].shipped:
        return None
    shipped = files[0].values.get("telemetry.exporter")
    user = [la for la in layers if not isinstance(la, FileSource)]
    if shipped in (None, "otlp") or any("telemetry.exporter" in la.values for la in user):
        return None
    named = [la.origin[p] for la in user for p in ENDPOINT_PATHS if p in la.values]
    if not named:
        return None
    derived = Layer()
    why = f"{named[0]} over {files[0].path.name}'s exporter = {shipped!r}"
    derived.set("telemetry.exporter", "otlp", Source("derived", why))
    return derived


def _validate(layers: list[Layer]) -> Settings:
    """Validate the merged layers (highest precedence first) and record each value's source.

    Raises :class:`SettingsError` with one entry per pydantic error.
    """
    if (derived := _endpoint_over_shipped_exporter(layers)) is not None:
        layers = [derived, *layers]
    tree: dict[str, Any] = {}
    for layer in reversed(layers):  # lowest precedence first, so higher ones overwrite
        tree = _merge(tree, layer.tree())
    try:
        settings = Settings.model_validate(tree)
    except ValidationError as exc:
        raise SettingsError([_error_problem(e, layers) for e in exc.errors()]) from None
    merged: dict[str, Source] = {}
    for layer in reversed(layers):  # lowest precedence first, so higher ones overwrite
        merged.update(layer.origin)
    settings._sources = merged
    _sdk_switch(settings)
    return settings


def _sdk_switch(settings: Settings) -> None:
    """``OTEL_SDK_DISABLED=true`` is the OpenTelemetry SDK's own off switch: every signal is a
    no-op whatever else asks for telemetry, so the settings say telemetry is off and name the
    variable as the reason (the summary, resolved.json, doctor and status read this one value)."""
    t = settings.telemetry
    if t.otel.sdk_disabled:  # the reason even when enabled is false too: it is the last word
        t.enabled = False
        settings._sources["telemetry.enabled"] = settings.source("telemetry.otel.sdk_disabled")


def telemetry_off_reason(source: str, *, sdk_disabled: bool) -> str:
    """Why telemetry is off and how to turn it on, from ``telemetry.enabled``'s source (as
    :class:`Source` prints it; a run directory's resolved.json keeps the same text) and whether
    ``OTEL_SDK_DISABLED`` turned it off."""
    sep = "=" if source.isupper() else " = "  # a variable, or a config file's key
    if sdk_disabled:
        return (
            f"{source}{sep}true, the OpenTelemetry SDK's own switch: unset it to turn telemetry on"
        )
    said = "" if source in ("", "default") or source.startswith("--") else f"{source}{sep}false; "
    return f"{said}--otel-enabled to turn it on"


def recorded_off_reason(table: Mapping[str, Any]) -> str | None:
    """:func:`telemetry_off_reason` of a finished or running run, from the settings table of its
    resolved.json (``{path: {"value", "source"}}``); None when its telemetry was on or the table
    does not say."""
    entry, sdk = table.get("telemetry.enabled"), table.get("telemetry.otel.sdk_disabled")
    if not isinstance(entry, dict) or entry.get("value") is not False:
        return None
    sdk_disabled = isinstance(sdk, dict) and sdk.get("value") is True
    return telemetry_off_reason(str(entry.get("source", "")), sdk_disabled=sdk_disabled)


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
    env_src = EnvSource(environ)
    layers: list[Layer] = [FlagSource(flags or {}), env_src]
    problems: list[Problem] = list(env_src.problems) + _preempt_signals_problems(environ)
    if config is not None:
        file_src = FileSource(Path(config))
        problems += file_src.problems
        layers.append(file_src)
    settings, found = check_layers(*layers)
    return settings, problems + found


def check_layers(*layers: Layer) -> tuple[Settings | None, list[Problem]]:
    """Validate ``layers`` (highest precedence first) and, when that succeeds, run the checks
    between sections: ``(the settings or None, every problem)``, each problem named by the
    layer's own label for the value (mlaunch's trainer checks its parsed arguments this way)."""
    try:
        settings = _validate(list(layers))
    except SettingsError as exc:
        return None, exc.problems
    return settings, cross_field_problems(settings)


def _preempt_signals_problems(environ: Mapping[str, str]) -> list[Problem]:
    """``MLAUNCH_PREEMPT_SIGNALS`` checked before launch (the trainer would refuse it only after
    torchrun started), reported under the variable's own name."""
    from mlaunch.envcontract import PREEMPT_SIGNALS
    from mlaunch.settings.values import preempt_signals

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
    cluster: Mapping[str, tuple[Any, str]] | None = None,
) -> Settings:
    """Merge flags > environment > config file > defaults into validated :class:`Settings`.

    A shipped config (``CONFIGS_DIR``) is a default: an endpoint the user set (a flag or a
    variable) wins over its exporter (:func:`_endpoint_over_shipped_exporter`).

    ``cluster`` holds what a scheduler's variables determine, ``{path: (value, variable)}``
    (the launcher's ``cluster_env``: SLURM's, the Kubeflow torch runtime's), each value's
    source its variable, so an error names it. It ranks below the variables and above the
    config file: the caller leaves out what a flag or the user's own config file gives, and a
    shipped config's value is a default the scheduler's wins over.
    """
    environ = os.environ if environ is None else environ
    problems: list[Problem] = []
    flag_src = FlagSource(flags or {})
    env_src = EnvSource(environ)
    problems += env_src.problems
    problems += _preempt_signals_problems(environ)
    layers: list[Layer] = [flag_src, env_src]
    if cluster:
        scheduler = Layer()
        for path, (value, variable) in cluster.items():
            scheduler.set(path, value, Source("env", variable))
        layers.append(scheduler)
    if config is not None:
        file_src = FileSource(Path(config))
        problems += file_src.problems
        layers.append(file_src)
    if problems:
        raise SettingsError(problems)
    settings = _validate(layers)
    if check_cross_fields:
        cross = cross_field_problems(settings)
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
