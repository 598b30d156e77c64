"""``mlaunch trainjob``: parse, call :mod:`mlaunch.kube.manifest` (the TrainJob) and
:mod:`mlaunch.kube.client` (its creation), render.

Takes every ``mlaunch train`` setting flag (the same generated parameters, validated the same
way) plus the Kubernetes options, as ``mlaunch sbatch`` does for SLURM.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from mlaunch.cli.errors import RUN_FAILED, USAGE_ERROR, print_problems
from mlaunch.cli.setting_flags import (
    apply_negative_flags,
    given_settings,
    passthrough_parameter,
    register_command,
)

_KUBE_PANEL = "Kubernetes (Kubeflow Trainer v2)"


def _own_parameters() -> list[tuple[str, Any, Any]]:
    """The command's own options (before the setting flags), as (name, annotation, default)."""
    from mlaunch.kube.manifest import DEFAULT_RUNTIME

    p = _KUBE_PANEL
    return [
        ("config", str | None, typer.Option(
            None, "--config", metavar="FILE|NAME",
            help="TOML config file, or the name of a shipped one (as mlaunch train). Default: tiny.",
        )),
        ("dry_run", bool, typer.Option(
            False, "--dry-run", help="Print the TrainJob; write and create nothing.",
        )),
        ("nodes", int, typer.Option(
            1, "--nodes", min=1, rich_help_panel=p, help="Pods; one mlaunch train per pod.",
        )),
        ("image", str, typer.Option(
            ..., "--image", metavar="IMAGE", rich_help_panel=p,
            help="Container image with mlaunch installed (and the script, if any).",
        )),
        ("namespace", str | None, typer.Option(
            None, "--namespace", "-n", metavar="NS", rich_help_panel=p,
            help="Namespace. Default: the kubeconfig context's.",
        )),
        ("gpus_per_node", int | None, typer.Option(
            None, "--gpus-per-node", min=1, rich_help_panel=p,
            help="nvidia.com/gpu per pod; also the workers per pod unless --nproc-per-node is"
            " given.",
        )),
        ("runtime", str, typer.Option(
            DEFAULT_RUNTIME, "--runtime", metavar="NAME", rich_help_panel=p,
            help="The ClusterTrainingRuntime (it sets PET_* in each pod).",
        )),
        ("queue", str | None, typer.Option(
            None, "--queue", metavar="Q", rich_help_panel=p,
            help="Kueue LocalQueue (the kueue.x-k8s.io/queue-name label).",
        )),
        ("volume", str | None, typer.Option(
            None, "--volume", metavar="CLAIM:MOUNT", rich_help_panel=p,
            help="PersistentVolumeClaim mounted at MOUNT in every pod; the run directory is"
            " MOUNT/runs/<run id> (traces, checkpoints, resume).",
        )),
        passthrough_parameter(),
    ]  # fmt: skip


def run_trainjob(
    *, flags: dict[str, Any], config: str | None, passthrough: list[str], options: Any,
    dry_run: bool,
) -> int:  # fmt: skip
    """The command's work: validate, connect, write, create. Returns the exit code."""
    from mlaunch.kube.manifest import manifest, plan_trainjob, render_yaml
    from mlaunch.settings import SettingsError

    try:
        job = plan_trainjob(
            flags=flags, config=config, passthrough=passthrough, environ=dict(os.environ),
            cwd=Path.cwd(), options=options,
        )  # fmt: skip
    except SettingsError as exc:
        print_problems(exc.problems)
        return USAGE_ERROR
    text = render_yaml(job)
    if dry_run:
        typer.echo(text, nl=False)
        return 0
    from mlaunch.kube import client as kube
    from mlaunch.rundir import atomic
    from mlaunch.rundir import layout as lay

    try:  # before anything is written: the client, the credentials, the server, the Trainer
        api = kube.connect(options.namespace)
        kube.check_trainer_api(api)
    except kube.KubeSetupError as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    except kube.KubeApiError as exc:
        typer.echo(f"error: {exc}", err=True)
        return RUN_FAILED
    path = job.local_run_dir / lay.TRAINJOB_FILE
    try:
        atomic.write_atomic(path, text)
    except OSError as exc:
        typer.echo(f"error: cannot write {path} ({exc}); nothing created", err=True)
        return RUN_FAILED
    body = manifest(job)
    body["metadata"].setdefault("namespace", api.namespace)
    try:
        kube.create_trainjob(api, body)
    except (kube.KubeSetupError, kube.KubeApiError) as exc:
        typer.echo(f"error: {exc}", err=True)
        return RUN_FAILED
    for note in job.notes:
        typer.echo(f"note: {note}")
    typer.echo(
        f"created trainjob {job.name} in namespace {api.namespace}: {options.nodes} pod(s) x"
        f" {job.workers_per_node} worker(s), run id {job.run_id}"
    )
    typer.echo(f"manifest: {path}")
    if job.pod_run_dir:
        typer.echo(f"run dir:  {job.pod_run_dir} on claim {job.claim}")
    typer.echo("follow it:")
    typer.echo(f"  mlaunch status trainjob/{job.name} -n {api.namespace}")
    typer.echo(f"  kubectl logs -n {api.namespace} -f -l jobset.sigs.k8s.io/jobset-name={job.name}")
    typer.echo(f"  kubectl delete trainjob -n {api.namespace} {job.name}")
    return 0


def register(app: typer.Typer) -> None:
    """Add the ``trainjob`` command to the root app."""
    from mlaunch.kube.manifest import TrainJobOptions

    def trainjob(**kwargs: Any) -> None:
        """Validate as mlaunch train does, write a readable Kubeflow Trainer v2 TrainJob into
        the run directory (trainjob.yaml) and create it: one mlaunch train per pod, the
        run directory on a volume, resumed from there when the job restarts."""
        flags = given_settings(kwargs)
        apply_negative_flags(kwargs, flags)
        options = TrainJobOptions(
            image=kwargs["image"],
            nodes=kwargs["nodes"],
            namespace=kwargs["namespace"],
            gpus_per_node=kwargs["gpus_per_node"],
            runtime=kwargs["runtime"],
            queue=kwargs["queue"],
            volume=kwargs["volume"],
        )
        code = run_trainjob(
            flags=flags,
            config=kwargs["config"],
            passthrough=list(kwargs.get("args") or []),
            options=options,
            dry_run=kwargs["dry_run"],
        )
        raise typer.Exit(code)

    register_command(app, "trainjob", trainjob, _own_parameters())


# --------------------------------------------------------------------------------------------
# logs and stop for trainjob/NAME: what `mlaunch logs` and `mlaunch stop` call for such a target


def _connect_or_code(namespace: str | None) -> Any:
    """The connection, or the exit code after saying why there is none."""
    from mlaunch.kube import client as kube

    try:
        return kube.connect(namespace)
    except kube.KubeSetupError as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR


def trainjob_logs_command(
    target: str, *, namespace: str | None, node: int | None, tail: int | None, follow: bool,
    rank: int | None = None, attempt: int | None = None,
) -> int:  # fmt: skip
    """``mlaunch logs trainjob/NAME``: each pod's output, ``[node R]`` before each line when
    several pods are shown. Returns the exit code."""
    import sys

    from mlaunch.kube import client as kube
    from mlaunch.kube.jobs import TrainJobInputError, trainjob_logs, trainjob_target

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
    try:
        name = trainjob_target(target)
    except TrainJobInputError as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    api = _connect_or_code(namespace)
    if isinstance(api, int):
        return api
    try:
        for line in trainjob_logs(api, name, node=node, tail=tail, follow=follow):
            sys.stdout.write(line + "\n")
            if follow:
                sys.stdout.flush()
    except (TrainJobInputError, kube.KubeSetupError) as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    except kube.KubeApiError as exc:
        typer.echo(f"error: {exc}", err=True)
        return RUN_FAILED
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
        trainjob_target,
        wait_pods_gone,
    )
    from mlaunch.slurm.status import status_text

    try:
        name = trainjob_target(target)
    except TrainJobInputError as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    api = _connect_or_code(namespace)
    if isinstance(api, int):
        return api
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
    except (TrainJobInputError, kube.KubeSetupError) as exc:
        typer.echo(f"error: {exc}", err=True)
        return USAGE_ERROR
    except kube.KubeApiError as exc:
        typer.echo(f"error: {exc}", err=True)
        return RUN_FAILED
    return 0
