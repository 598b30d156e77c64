"""``status``, ``logs`` and ``stop`` of a TrainJob (``trainjob/NAME``, or the run directory
``mlaunch trainjob`` wrote): parse, call :mod:`mlaunch.kube.jobs`, render. Light: a plain
``mlaunch status RUN_DIR`` asks :func:`is_trainjob` without loading the settings layer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from mlaunch.cli.errors import RUN_FAILED, USAGE_ERROR, print_problems


def is_trainjob(target: str) -> bool:
    """Whether ``logs``/``stop``/``status`` should take ``target`` as a TrainJob
    (``trainjob/NAME``, or a run directory ``mlaunch trainjob`` wrote)."""
    from mlaunch.kube.jobs import TrainJobInputError, resolve_trainjob

    try:
        return resolve_trainjob(target, Path.cwd()) is not None
    except TrainJobInputError:
        return True  # trainjob/<bad name>: the command says what is wrong


def _ref_or_code(target: str) -> Any:
    """The TrainJob ``target`` names, or the exit code after saying why it names none."""
    from mlaunch.kube.jobs import TrainJobInputError, resolve_trainjob

    try:
        ref = resolve_trainjob(target, Path.cwd())
    except TrainJobInputError as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    if ref is None:
        typer.echo(f"error: {target!r} names no TrainJob", err=True)
        return USAGE_ERROR
    return ref


def _job_and_api(target: str, namespace: str | None) -> tuple[str, Any] | int:
    """The TrainJob's name and a connection to its namespace (``namespace``, else the one its
    run directory recorded), or the exit code after saying why there is none."""
    from mlaunch.kube import client as kube

    ref = _ref_or_code(target)
    if isinstance(ref, int):
        return ref
    try:
        return ref.name, kube.connect(namespace or ref.namespace)
    except kube.KubeSetupError as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR


def _api_failure(exc: Exception) -> int:
    """Say why a call to the API failed; the exit code: 2 for what the user can fix (no such
    TrainJob, no credentials), 1 for the API's own failure."""
    from mlaunch.kube import client as kube

    typer.echo(f"error: {exc}", err=True)
    return RUN_FAILED if isinstance(exc, kube.KubeApiError) else USAGE_ERROR


def trainjob_logs_command(
    target: str, *, namespace: str | None, node: int | None, tail: int | None, follow: bool,
    rank: int | None = None, attempt: int | None = None,
) -> int:  # fmt: skip
    """``mlaunch logs trainjob/NAME``: each pod's output, ``[node R]`` before each line when
    several pods are shown. Returns the exit code."""

    from mlaunch.kube import client as kube
    from mlaunch.kube.jobs import TrainJobInputError, trainjob_logs

    problems = []
    if rank is not None:
        problems.append(("--rank", "not for a TrainJob: a pod's log is its launcher's console"))
    if attempt is not None:
        problems.append(("--attempt", "not for a TrainJob: its pods' logs are the current ones"))
    if tail is not None and tail < 0:
        problems.append(("--tail", f"{tail}: give a number of lines, 0 or more"))
    if node is not None and node < 0:
        problems.append(("--node", f"{node}: numbers start at 0"))
    if problems:
        print_problems(problems)
        return USAGE_ERROR
    found = _job_and_api(target, namespace)
    if isinstance(found, int):
        return found
    name, api = found
    try:
        for line in trainjob_logs(api, name, node=node, tail=tail, follow=follow):
            sys.stdout.write(line + "\n")
            if follow:
                sys.stdout.flush()
    except (TrainJobInputError, kube.KubeSetupError, kube.KubeApiError) as exc:
        return _api_failure(exc)
    except KeyboardInterrupt:
        typer.echo("stopped following (the job goes on)", err=True)
    sys.stdout.flush()
    return 0


def trainjob_stop_command(
    target: str, *, namespace: str | None, now: bool, timeout_s: float
) -> int:
    """``mlaunch stop trainjob/NAME``: suspend it (``now``: delete it), then wait until its
    pods are gone and say the state as ``status`` does. Returns the exit code."""
    from mlaunch.kube import client as kube
    from mlaunch.kube.jobs import (
        TrainJobInputError,
        stop_trainjob,
        trainjob_status,
        wait_pods_gone,
    )
    from mlaunch.slurm.status import status_text

    found = _job_and_api(target, namespace)
    if isinstance(found, int):
        return found
    name, api = found
    try:
        typer.echo(stop_trainjob(api, name, now=now))
        left = wait_pods_gone(api, name, timeout_s=timeout_s)
        if left:
            typer.echo(
                f"error: TrainJob {name} has not ended after {timeout_s:g} s (pods still there:"
                f" {', '.join(left)}); they may still be saving: see mlaunch status {target}",
                err=True,
            )
            return RUN_FAILED
        typer.echo(f"TrainJob {name} has ended")
        if not now:
            typer.echo(status_text(trainjob_status(api, name, log_lines=False)))
    except (TrainJobInputError, kube.KubeSetupError, kube.KubeApiError) as exc:
        return _api_failure(exc)
    return 0


def trainjob_status_command(target: str, namespace: str | None, as_json: bool) -> int:
    """``status trainjob/NAME`` (or its run directory): the TrainJob and its pods, through the
    API."""
    from mlaunch.kube import client as kube
    from mlaunch.kube.jobs import TrainJobInputError, trainjob_status
    from mlaunch.slurm.status import status_text

    found = _job_and_api(target, namespace)
    if isinstance(found, int):
        return found
    name, api = found
    try:
        st = trainjob_status(api, name)
    except (TrainJobInputError, kube.KubeSetupError, kube.KubeApiError) as exc:
        return _api_failure(exc)
    if as_json:
        typer.echo(json.dumps(st.as_json(), indent=2))
    else:
        typer.echo(status_text(st))
    return 0
