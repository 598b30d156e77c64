"""``mlaunch doctor``: checks of the machine and the configuration before a run.

Every check is a function returning :class:`~mlaunch.doctor.results.CheckResult` values (pass /
warn / fail, a message and a one-line fix); :func:`run_doctor` runs them all and never raises. The
CLI (``mlaunch.cli.doctor``) only renders. One module per concern:

- ``results``: the verdict type and what is derived from a list of them (counts, JSON, exit code);
- ``packages``: the running Python and the installed distributions against mlaunch's ranges;
- ``torch_probe``: torch, CUDA, NCCL and gloo (and ``--deep`` all-reduces) in subprocesses;
- ``configuration``: every telemetry variable and the config file through mlaunch's settings;
- ``otlp``: the OTLP endpoint, with a real export and a diagnosis when it fails;
- ``host``: host name, rendezvous port, run directory and disk space, SLURM, Kubernetes;
- ``worker_side``: nemo-lens's own configuration loader under the worker's interpreter;
- ``hang_stacks``: whether the hang watchdog can read the workers' stacks (py-spy, ptrace);
- ``process``: the killable subprocesses the probes run in.

The configuration is validated by :func:`mlaunch.settings.collect_problems`, the same sources
and model as ``mlaunch train``. torch is never imported here: it is probed in a subprocess with a
timeout (started first, collected last), so the command answers in seconds even when importing
torch is slow. grpc and the OTLP protobufs are imported only by the OTLP probe.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlaunch.doctor.configuration import check_configuration
from mlaunch.doctor.hang_stacks import check_hang_stacks
from mlaunch.doctor.host import (
    check_hostname,
    check_kubernetes,
    check_rendezvous,
    check_run_dir,
    check_slurm,
)
from mlaunch.doctor.otlp import check_otlp
from mlaunch.doctor.packages import check_packages, check_python
from mlaunch.doctor.results import NET_TIMEOUT_S, CheckResult, fail
from mlaunch.doctor.torch_probe import TORCH_TIMEOUT_S, TorchProbe
from mlaunch.doctor.worker_side import WORKER_TIMEOUT_S, check_worker_side
from mlaunch.settings import Settings, load_settings


def _guard(name: str, fn: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    """Run one check; a bug in it becomes a failed result, never a traceback."""
    try:
        return fn()
    except Exception as exc:  # doctor must always answer
        return [
            fail(
                name,
                f"the check itself crashed: {type(exc).__name__}: {exc}",
                "report this as an mlaunch bug",
            )
        ]


def run_doctor(
    *,
    config: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    deep: bool = False,
    cwd: Path | None = None,
    net_timeout_s: float = NET_TIMEOUT_S,
    torch_timeout_s: float = TORCH_TIMEOUT_S,
    python: Sequence[str] = (sys.executable,),
    worker_python: str | None = None,
    worker_timeout_s: float = WORKER_TIMEOUT_S,
    flags: Mapping[str, Any] | None = None,
) -> list[CheckResult]:
    """Run every check, in a stable order; never raises.

    ``environ`` is the environment the configuration is read from (default: this process's);
    ``python`` is the interpreter command the torch probes run with; ``worker_python`` the one
    a ``--script`` worker runs with (default: this one), for the worker-side check; ``flags``
    the settings given as ``mlaunch train`` flags (``launch.script``/``launch.module``: a
    script run's checks differ from mlaunch's trainer's; ``launch.rdzv_endpoint`` and the node
    count and rank: the rendezvous to check).
    """
    environ = os.environ if environ is None else environ
    config_path = Path(config) if config is not None else None
    probe: TorchProbe | None = None
    try:
        probe = TorchProbe(python, torch_timeout_s, deep)  # runs while the other checks do
        results = _guard("python", check_python)
        results += _guard("packages", check_packages)
        torch_at = len(results)
        state: dict[str, Settings] = {}

        def config_checks() -> list[CheckResult]:
            found, state["settings"] = check_configuration(environ, config_path, flags)
            return found

        results += _guard("configuration", config_checks)
        settings = state.get("settings") or load_settings(environ={}, check_cross_fields=False)
        results += _guard(
            "worker telemetry",
            lambda: check_worker_side(
                settings, environ, worker_python=worker_python, timeout_s=worker_timeout_s
            ),
        )
        results += _guard("otlp endpoint", lambda: check_otlp(settings, net_timeout_s))
        results += _guard("hostname", check_hostname)
        results += _guard(
            "rendezvous port", lambda: check_rendezvous(settings, net_timeout_s, environ)
        )
        results += _guard("run directory", lambda: check_run_dir(settings, cwd))
        results += _guard("hang stacks", lambda: check_hang_stacks(settings))
        results += _guard("slurm", lambda: check_slurm(environ, settings))
        results += _guard("kubernetes", lambda: check_kubernetes(environ))
        device = settings.launch.device
        results[torch_at:torch_at] = _guard("torch import", lambda: probe.results(device))  # type: ignore[union-attr]
        return results
    finally:
        if probe is not None:
            probe.kill()
