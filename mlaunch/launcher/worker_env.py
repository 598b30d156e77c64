"""The workers' environment: every setting in the language of what the workers run (mlaunch's
trainer, or the reference's for a ``--script``/``--module``), one truth per variable."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.launcher import lens_names
from mlaunch.lens_hook import SITE_DIR
from mlaunch.rundir import layout as lay
from mlaunch.settings import OTEL_ENV, TELEMETRY_KEYS, Settings

_env_value = lens_names.env_text


def worker_environment(
    settings: Settings,
    run_id: str,
    run_dir: Path,
    environ: Mapping[str, str],
    *,
    external: bool | None = None,
) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """``(what mlaunch sets, inherited variables it removes, notes)`` for the workers.

    mlaunch's trainer gets every setting in mlaunch's language; a ``--script``/``--module`` worker
    gets the reference's (:mod:`mlaunch.launcher.lens_names`). Inherited ``MEGATRON_OTEL_*`` /
    ``NEMO_LENS_*`` variables that mlaunch does not set are removed, so workers see one truth.
    ``external`` overrides the entry point's kind (doctor asks for the script side of any config).
    """
    external = not settings.uses_builtin_trainer if external is None else external
    if not external:
        env = _trainer_env(settings, run_id, environ)
        # ``python -m mlaunch.trainer`` would put the current directory first on sys.path: a
        # folder named ``mlaunch`` there (the folder holding a clone) would shadow the installed
        # package, and telemetry set up from it fails. The trainer is mlaunch's own code and needs
        # nothing from the current directory (``python -P``'s variable; a script keeps its own
        # directory: see mlaunch.lens_hook).
        env[ec.SAFE_PATH] = "1"
    else:
        env = lens_names.worker_env(settings, run_id)
    env[ec.RUN_DIR] = str(run_dir)
    embedded = external and lens_names.embedded_receiver(settings)
    for var in sorted(environ):
        # Other standard variables (per-signal headers, SDK knobs) travel as given.
        if (
            var.startswith(ec.OTEL_PREFIX)
            and var not in env
            and environ[var].strip()
            and not (embedded and var in ec.OTLP_TARGET_VARS)
        ):
            env[var] = environ[var]
    if external and lens_hook_wanted(settings):
        env[PYTHONPATH] = os.pathsep.join(
            [str(SITE_DIR), *([environ[PYTHONPATH]] if environ.get(PYTHONPATH) else [])]
        )
    if settings.launch.device == "cuda":
        env[ec.DEVICE] = "cuda"  # the worker refuses to start without it (trainer/parallel.py)
    if settings.launch.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the only way to keep a CUDA-capable worker on CPU
    env.update(nccl_flight_recorder_env(settings, run_dir, environ))
    notes: list[str] = []
    value, note = lens_names.cuda_connections(settings, environ)
    if value is not None:
        env[ec.CUDA_DEVICE_MAX_CONNECTIONS] = value
    if note:
        notes.append(note)
    removed = {
        k
        for k in environ
        if (k.startswith(ec.FALLBACK_PREFIX) or k.startswith(ec.PRIMARY_PREFIX)) and k not in env
    }
    if embedded:
        removed |= {k for k in environ if k in ec.OTLP_TARGET_VARS}
    return env, tuple(sorted(removed)), tuple(notes)


#: Where the live-capture hook for nemo-lens workers goes (first, before the user's entries).
PYTHONPATH = "PYTHONPATH"


def lens_hook_wanted(settings: Settings) -> bool:
    """Whether a ``--script``/``--module`` run's workers get the live-capture hook
    (:mod:`mlaunch.lens_hook`): only when they trace at all. It does nothing in a worker that does
    not set nemo-lens up (a script using ``mlaunch.telemetry`` watches requests itself)."""
    t = settings.telemetry
    return t.enabled and t.traces_enabled and not t.otel.sdk_disabled


def _trainer_env(settings: Settings, run_id: str, environ: Mapping[str, str]) -> dict[str, str]:
    """mlaunch's own trainer: every key in mlaunch's language, the OTEL_* text as given."""
    t = settings.telemetry
    env: dict[str, str] = {}
    for key, fld in TELEMETRY_KEYS.items():
        value = run_id if fld == "run_id" else getattr(t, fld)
        env[ec.PRIMARY_PREFIX + key] = _env_value(value)
    env[ec.OTEL_SERVICE_NAME] = t.service_name
    for var, (section, fld) in OTEL_ENV.items():
        if var == ec.OTEL_SERVICE_NAME:
            continue
        path = f"{section}.{fld}"
        source = settings.source(path)
        if source.kind == "env":
            env[var] = environ[var]  # as given: the worker parses the same text
        elif source.kind in ("flag", "file"):
            obj: Any = t.otel if section == "telemetry.otel" else t
            env[var] = _env_value(getattr(obj, fld))
    return env


#: The NCCL flight recorder's ring (entries per process group): torch's own default size.
NCCL_TRACE_ENTRIES = 2000


def nccl_flight_recorder_env(
    settings: Settings, run_dir: Path, environ: Mapping[str, str]
) -> dict[str, str]:
    """torch's NCCL flight recorder for a job that may use NCCL (``--device`` cuda or auto): a
    ring of the last collectives per process group, dumped to the run directory's ``hang/`` when
    NCCL's own timeout fires or when the hang watchdog writes the dump pipe. A variable the user
    set is left as it is; a CPU job (gloo) gets none."""
    if settings.launch.device == "cpu":
        return {}
    hang = lay.hang_dir(run_dir)
    wanted = {
        ec.NCCL_TRACE_BUFFER_SIZE: str(NCCL_TRACE_ENTRIES),
        ec.NCCL_DUMP_ON_TIMEOUT: "1",
        ec.NCCL_DEBUG_INFO_TEMP_FILE: str(hang / lay.NCCL_TRACE_PREFIX),
        ec.NCCL_DEBUG_INFO_PIPE_FILE: str(hang / lay.NCCL_PIPE_PREFIX),
    }
    return {k: v for k, v in wanted.items() if not environ.get(k, "").strip()}
