"""The worker side: nemo-lens's own configuration loader, run under the worker's interpreter on
the environment and arguments mlaunch would hand a ``--script`` worker."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlaunch.doctor.process import ProbeProcess, last_line
from mlaunch.doctor.results import CheckResult, fail, ok, warn
from mlaunch.envcontract import FALLBACK_PREFIX, PRIMARY_PREFIX
from mlaunch.model.groups import ALL_GROUPS as ALL_SPAN_GROUPS
from mlaunch.model.strategies import format_ranks
from mlaunch.rundir import layout as lay
from mlaunch.settings import Settings

#: Seconds the worker interpreter may take to import nemo-lens and resolve its configuration.
WORKER_TIMEOUT_S = 20.0
#: Ranks the probe asks the export strategy about (a larger world is compared on these).
WORKER_PROBE_RANKS = 4096

#: Runs under the WORKER's interpreter (not mlaunch's: it may be another Python, without mlaunch),
#: in the environment mlaunch would hand the workers, with Megatron-LM's --otel-* arguments. It
#: does what Megatron-LM's ``_set_telemetry`` and nemo-lens's ``setup_telemetry`` do up to the
#: point of exporting, and prints one JSON object: what nemo-lens resolved, or what it raised.
_LENS_PROBE = r"""
import json, os, sys
spec = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0]}
try:
    import nemo.lens
except ImportError as exc:
    out.update(importable=False, error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(out))
    sys.exit(0)
out.update(importable=True, version=str(getattr(nemo.lens, "__version__", "?")))
try:
    from nemo.lens import NemoLensConfig
    from nemo.lens.groups import SpanGroup
    from nemo.lens.strategies import get_export_strategy
except Exception as exc:  # a nemo.lens without the API Megatron-LM uses (another version)
    out.update(error=f"{type(exc).__name__}: {exc}", stage="import")
    print(json.dumps(out))
    sys.exit(0)
try:
    from megatron.core.telemetry.span_groups import MegatronSpanGroup as groups_cls
    out["span_group_class"] = "Megatron-LM's MegatronSpanGroup"
except Exception:
    groups_cls = type("MegatronSpanGroup", (SpanGroup,), {
        "ALL_GROUPS": frozenset(spec["groups"]),
        "_PRESETS": {k: frozenset(v) for k, v in spec["presets"].items()},
    })
    out["span_group_class"] = "an equivalent of Megatron-LM's MegatronSpanGroup"
args = spec["args"]
def flag(name):
    for i, a in enumerate(args):
        if a == name:
            return True if name == spec["enabled_arg"] else (args[i + 1] if i + 1 < len(args) else None)
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
stage = "NemoLensConfig.from_env"
try:
    config = NemoLensConfig.from_env(
        prefix=spec["prefix"], fallback_prefix=spec["fallback_prefix"], span_group_cls=groups_cls
    )
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
        config.service_name = spec["default_service_name"]
    if flag(spec["enabled_arg"]):
        config.enabled = True
    if flag(spec["service_name_arg"]):
        config.service_name = flag(spec["service_name_arg"])
    if flag(spec["span_groups_arg"]):
        config.span_groups = flag(spec["span_groups_arg"])
    out.update(enabled=config.enabled, service_name=config.service_name,
               exporter=config.exporter, export_strategy=config.export_strategy,
               span_spec=config.span_groups, sampler_enabled=config.sampler_enabled,
               export_sample_rate=config.export_sample_rate, span_groups=[],
               exporting_ranks=[])
    stage = "export strategy lookup"
    strategy = get_export_strategy(config.export_strategy)
    ranks = []
    for rank in range(spec["ranks"]):
        os.environ["LOCAL_RANK"] = str(rank % spec["nproc_per_node"])
        if strategy(config, rank, spec["world"]):
            ranks.append(rank)
    if config.enabled:
        out["exporting_ranks"] = ranks
    if config.enabled and ranks:
        from nemo.lens import providers
        stage = "exporter"
        if config.traces_enabled:
            providers._build_span_exporter(config).shutdown()
        if config.metrics_enabled:
            providers._build_metric_exporter(config).shutdown()
        out["protocol"] = providers._resolve_otlp_protocol("traces")
        stage = "span groups"
        out["span_groups"] = sorted(config.resolved_span_groups)
        if config.sampler_enabled and config.traces_enabled:
            from nemo.lens.sampling import RankAwareSampler
            out["sampled_ranks"] = [
                r for r in ranks
                if RankAwareSampler(r, spec["world"], config.export_sample_rate)._should_sample
            ]
except Exception as exc:
    out.update(error=f"{type(exc).__name__}: {exc}", stage=stage)
print(json.dumps(out))
"""


def worker_probe(
    python: str, env: Mapping[str, str], args: Sequence[str], settings: Settings, timeout_s: float
) -> dict[str, Any]:
    """Run :data:`_LENS_PROBE` under ``python`` in ``env``; its JSON, or ``{"failed": why}``."""
    from mlaunch.launcher import lens_names
    from mlaunch.model.groups import PRESETS, REFERENCE_PRESETS
    from mlaunch.settings import TelemetrySettings

    spec = {
        "args": list(args),
        # What Megatron-LM's _set_telemetry hands nemo-lens (both prefixes, without the
        # trailing underscore) and applies over what it read from the environment: a default
        # service name when OTEL_SERVICE_NAME is unset (mlaunch's is the same) and the
        # --otel-* arguments.
        "prefix": PRIMARY_PREFIX.rstrip("_"),
        "fallback_prefix": FALLBACK_PREFIX.rstrip("_"),
        "default_service_name": TelemetrySettings.model_fields["service_name"].default,
        "enabled_arg": lens_names.OTEL_ENABLED_ARG,
        "service_name_arg": lens_names.OTEL_SERVICE_NAME_ARG,
        "span_groups_arg": lens_names.OTEL_SPAN_GROUPS_ARG,
        "world": settings.world_size,
        "ranks": min(settings.world_size, WORKER_PROBE_RANKS),
        "nproc_per_node": settings.launch.nproc_per_node,
        # Megatron-LM's group class, for a worker Python without Megatron-LM installed: its
        # groups and reference presets are mlaunch's (pinned equal by the model's tests).
        "groups": sorted(g.value for g in ALL_SPAN_GROUPS),
        "presets": {k: sorted(g.value for g in PRESETS[k]) for k in sorted(REFERENCE_PRESETS)},
    }
    proc = ProbeProcess([python, "-c", _LENS_PROBE, json.dumps(spec)], env)
    code, out, err = proc.wait(timeout_s)
    if code is None:
        return {"failed": f"{python} did not answer within {timeout_s:g} s"}
    try:
        return dict(json.loads(last_line(out)))
    except (ValueError, TypeError):
        return {"failed": f"{python} exited {code}: {last_line(err) or last_line(out) or '?'}"}


def _compare(found: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    """``key: worker X, mlaunch Y`` for every value the worker resolves differently."""
    return [
        f"{key}: worker {found.get(key)!r}, mlaunch {want!r}"
        for key, want in plan.items()
        if found.get(key) != want
    ]


def _worker_launch(
    settings: Settings, environ: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """The environment and the ``--otel-*`` arguments mlaunch would hand a script worker."""
    from mlaunch.launcher.worker_args import otel_flags, resolve_megatron_args
    from mlaunch.launcher.worker_env import worker_environment

    run_id = settings.telemetry.run_id or "doctor"
    env, removed, _ = worker_environment(
        settings, run_id, lay.default_run_dir(run_id, Path.cwd()), environ, external=True
    )
    child = {k: v for k, v in environ.items() if k not in removed}
    child.update(env)
    args = otel_flags(settings) if resolve_megatron_args(settings, Path.cwd())[0] else []
    return child, args


def _plan(settings: Settings, view: Mapping[str, Any]) -> dict[str, Any]:
    """What mlaunch's plan says the worker should resolve, keyed as the probe reports it
    (``view``: the reference translation of these settings)."""
    t = settings.telemetry
    try:
        ranks = settings.exporting_ranks(min(settings.world_size, WORKER_PROBE_RANKS))
    except Exception:  # a custom strategy: refused above, nothing to compare
        ranks = []
    ranks = [r for r in ranks if r < settings.world_size] if t.enabled else []
    return {
        "enabled": t.enabled,
        "exporter": view["exporter"],
        "export_strategy": t.export_strategy,
        "service_name": t.service_name,
        "sampler_enabled": t.sampler_enabled,
        "exporting_ranks": ranks,
        "span_groups": view["span_groups"] if t.enabled and ranks else [],
    }


def _describe(found: Mapping[str, Any]) -> str:
    """What the worker resolved, in one line."""
    return (
        f"enabled {found.get('enabled')}, groups {','.join(found.get('span_groups') or []) or '-'},"
        f" exporter {found.get('exporter')}"
        + (f" ({found['protocol']})" if found.get("protocol") else "")
        + f", strategy {found.get('export_strategy')}, exporting ranks"
        f" {format_ranks(found.get('exporting_ranks') or []) or 'none'}"
        + (
            f", rank-aware sampler keeps ranks {format_ranks(found['sampled_ranks']) or 'none'}"
            if "sampled_ranks" in found
            else ""
        )
    )


def check_worker_side(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    worker_python: str | None = None,
    timeout_s: float = WORKER_TIMEOUT_S,
) -> list[CheckResult]:
    """What a ``--script``/``--module`` worker (Megatron-LM through nemo-lens) would resolve from
    the environment and arguments mlaunch hands it, side by side with mlaunch's plan.

    Runs nemo-lens's real configuration loader under the worker interpreter (``worker_python``,
    default this one) in a subprocess with a timeout. A run of mlaunch's own trainer needs no
    nemo-lens: then an interpreter without it is a note, not a warning.
    """
    from mlaunch.launcher import lens_names

    name = "worker telemetry"
    external = not settings.uses_builtin_trainer or worker_python is not None
    python = worker_python or sys.executable
    results: list[CheckResult] = []
    if external:
        for field, message in lens_names.refusals(settings):
            results.append(
                fail("script worker", f"{field}: {message}", f"change {field} as the message says")
            )
    child, args = _worker_launch(settings, environ)
    found = worker_probe(python, child, args, settings, timeout_s)
    if "failed" in found:
        return [*results, warn(name, f"could not run the worker probe: {found['failed']}",
                               "check --worker-python (a Python that can import nemo.lens)")]  # fmt: skip
    if not found.get("importable"):
        return [*results, _without_nemo_lens(name, python, found, settings, external)]
    version = str(found.get("version"))
    # A local version label (``0.2.0+b85578f``: nemo-lens installed from a git checkout) is
    # that release.
    known = version.partition("+")[0] in lens_names.KNOWN_LENS_VERSIONS
    who = f"nemo-lens {version} under {python} ({found.get('span_group_class')})"
    if not known:
        who = (
            f"nemo-lens {version} under {python} (not a version mlaunch was checked against:"
            f" {' or '.join(lens_names.KNOWN_LENS_VERSIONS)})"
        )
    if "error" in found:
        if not known:  # another API: nothing to conclude about the settings, only the version
            return [
                *results,
                warn(
                    name,
                    f"{who}: its configuration loader could not be run ({found.get('stage')}:"
                    f" {found['error']})",
                    lens_names.lens_install_advice(),
                ),
            ]
        return [
            *results,
            fail(
                name,
                f"{who} raises at {found.get('stage')}: {found['error']} -- a Megatron-LM worker"
                " would stop at start-up",
                "fix the setting it names (see the configuration checks above)",
            ),
        ]
    view = lens_names.reference_view(settings)
    resolved = _describe(found)
    diffs = _compare(found, _plan(settings, view))
    if diffs:
        return [
            *results,
            (fail if known else warn)(
                name,
                f"{who} resolves {resolved}; it differs from mlaunch's plan: {'; '.join(diffs)}",
                "report this as an mlaunch bug (the translation table is wrong for this setting)",
            ),
        ]
    # The receiver refuses anyone without the launch's token (mlaunch/receiver/core.py): say so,
    # a user on a shared node wants to know that nobody else can write into the job's traces.
    receiver = (
        " (endpoint: the launcher's embedded receiver, which authenticates: it admits only this"
        " launch's workers, by a fresh per-launch token)"
        if view["embedded_receiver"]
        else ""
    )
    message = f"{who} resolves {resolved}{receiver}; matches mlaunch's plan"
    if not known:
        return [*results, warn(name, message, lens_names.lens_install_advice())]
    return [*results, ok(name, message)]


def _without_nemo_lens(
    name: str, python: str, found: Mapping[str, Any], settings: Settings, external: bool
) -> CheckResult:
    """The worker interpreter cannot import nemo.lens. Megatron-LM then runs with telemetry off
    and says nothing: a failure when this run's telemetry is on, a warning when it is off (a
    later ``--otel-enabled`` would change nothing). mlaunch's own trainer does not use
    nemo-lens: then it is only a note about script workers."""
    from mlaunch.launcher import lens_names

    versions = " or ".join(lens_names.KNOWN_LENS_VERSIONS)
    where = f"{python} (Python {found.get('python')}) cannot import nemo.lens ({versions})"
    advice = lens_names.lens_install_advice()
    if not external:
        return ok(
            name,
            f"{where}; mlaunch's trainer does not need it (a --script Megatron-LM worker does:"
            " check its interpreter with --worker-python PATH)",
            advice,
        )
    message = f"{where}: a Megatron-LM worker run by it would silently run with telemetry off"
    if settings.telemetry.enabled:
        return fail(name, message + ", though this run's telemetry is on", advice)
    return warn(name, message, advice)
