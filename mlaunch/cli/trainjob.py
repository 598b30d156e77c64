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
    from mlaunch.kube.names import DEFAULT_RUNTIME

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
    from mlaunch.kube.jobs import trainjob_record

    record = trainjob_record(job.name, api.namespace, api.server, job.run_id)
    try:  # the TrainJob exists: a record that cannot be written only costs `status RUN_DIR`
        atomic.write_json(job.local_run_dir / lay.TRAINJOB_RECORD_FILE, record, indent=1)
    except OSError as exc:
        typer.echo(f"note: cannot write {lay.TRAINJOB_RECORD_FILE} ({exc})", err=True)
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
    typer.echo(f"  mlaunch logs trainjob/{job.name} -n {api.namespace} --follow")
    typer.echo(f"  mlaunch stop trainjob/{job.name} -n {api.namespace}")
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
