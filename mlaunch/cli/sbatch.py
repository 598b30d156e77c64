"""``mlaunch sbatch``: parse, call :mod:`mlaunch.slurm.batch` (the script) and
:mod:`mlaunch.slurm.client` (the submission), render.

Takes every ``mlaunch train`` setting flag (the same generated parameters, validated the same
way) plus the SLURM options.
"""

from __future__ import annotations

import os
import shlex
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

_SLURM_PANEL = "SLURM (sbatch)"


def _own_parameters() -> list[tuple[str, Any, Any]]:
    """The command's own options (before the setting flags), as (name, annotation, default)."""
    from mlaunch.slurm.batch import DEFAULT_SIGNAL_GRACE_S

    p = _SLURM_PANEL
    return [
        ("config", str | None, typer.Option(
            None, "--config", metavar="FILE|NAME",
            help="TOML config file, or the name of a shipped one (as mlaunch train). Default: tiny.",
        )),
        ("dry_run", bool, typer.Option(
            False, "--dry-run", help="Print the batch script; submit and create nothing.",
        )),
        ("nodes", int, typer.Option(
            1, "--nodes", min=1, rich_help_panel=p, help="Nodes; one mlaunch train per node.",
        )),
        ("gpus_per_node", int | None, typer.Option(
            None, "--gpus-per-node", min=0, rich_help_panel=p,
            help="GPUs per node; also the workers per node unless --nproc-per-node is given.",
        )),
        ("time", str | None, typer.Option(
            None, "--time", metavar="TIME", rich_help_panel=p,
            help="Time limit (minutes, HH:MM:SS, D-HH:MM:SS).",
        )),
        ("partition", str | None, typer.Option(None, "--partition", rich_help_panel=p)),
        ("account", str | None, typer.Option(None, "--account", rich_help_panel=p)),
        ("qos", str | None, typer.Option(None, "--qos", rich_help_panel=p)),
        ("sbatch_arg", list[str] | None, typer.Option(
            None, "--sbatch-arg", metavar="ARG", rich_help_panel=p,
            help="One more #SBATCH option, e.g. --sbatch-arg=--mail-type=END (repeatable).",
        )),
        ("signal_grace", int, typer.Option(
            DEFAULT_SIGNAL_GRACE_S, "--signal-grace", metavar="SECONDS", rich_help_panel=p,
            help="SLURM's warning this long before the time limit: the workers save and stop.",
        )),
        ("requeue", bool, typer.Option(
            True, "--requeue/--no-requeue", rich_help_panel=p,
            help="After the warning (or a preemption) the job requeues and resumes from its"
            " checkpoint in the same run directory.",
        )),
        ("exclusive", bool, typer.Option(
            True, "--exclusive/--no-exclusive", rich_help_panel=p,
            help="Ask for whole nodes (torchrun's workers share the node).",
        )),
        passthrough_parameter(),
    ]  # fmt: skip


def run_sbatch(
    *, flags: dict[str, Any], config: str | None, passthrough: list[str], options: Any,
    dry_run: bool,
) -> int:  # fmt: skip
    """The command's work: validate, write, submit. Returns the exit code."""
    from mlaunch.settings import SettingsError
    from mlaunch.slurm.batch import plan_job, render_script

    try:
        job = plan_job(
            flags=flags, config=config, passthrough=passthrough, environ=dict(os.environ),
            cwd=Path.cwd(), options=options,
        )  # fmt: skip
    except SettingsError as exc:
        print_problems(exc.problems)
        return USAGE_ERROR
    script = render_script(job)
    if dry_run:
        typer.echo(script, nl=False)
        return 0
    from mlaunch.slurm import client as slurm

    try:
        sub = slurm.submit(job, script, dict(os.environ))
    except slurm.SlurmError as exc:
        typer.echo(str(exc), err=True)
        return RUN_FAILED
    for note in job.notes:
        typer.echo(f"note: {note}")
    from mlaunch.rundir import layout as lay

    rd = shlex.quote(str(sub.run_dir))
    o = job.options
    typer.echo(
        f"submitted job {sub.job_id}: {o.nodes} node(s) x {job.workers_per_node} worker(s)"
        + (" (held: scontrol release " + sub.job_id + ")" if sub.held else "")
    )
    typer.echo(f"run dir: {sub.run_dir}")
    typer.echo(f"script:  {sub.run_dir / lay.JOB_SCRIPT_FILE}")
    typer.echo("follow it:")
    typer.echo(f"  mlaunch status {sub.job_id}")
    typer.echo(f"  tail -f {rd}/{lay.SLURM_OUTPUT_TEMPLATE.replace('%j', sub.job_id)}")
    typer.echo(f"  mlaunch trace summary {rd}")
    typer.echo(f"  scancel {sub.job_id}")
    return 0


def register(app: typer.Typer) -> None:
    """Add the ``sbatch`` command to the root app."""
    from mlaunch.slurm.batch import SbatchOptions

    def sbatch(**kwargs: Any) -> None:
        """Validate as mlaunch train does, write a readable job.sbatch into the run directory
        and submit it: one mlaunch train per node, a warning signal before the time limit,
        requeue into the same run directory."""
        flags = given_settings(kwargs)
        apply_negative_flags(kwargs, flags)  # --no-X as train takes it (it was ignored)
        options = SbatchOptions(
            nodes=kwargs["nodes"],
            gpus_per_node=kwargs["gpus_per_node"],
            time=kwargs["time"],
            partition=kwargs["partition"],
            account=kwargs["account"],
            qos=kwargs["qos"],
            sbatch_args=tuple(kwargs.get("sbatch_arg") or ()),
            signal_grace_s=kwargs["signal_grace"],
            requeue=kwargs["requeue"],
            exclusive=kwargs["exclusive"],
        )
        code = run_sbatch(
            flags=flags,
            config=kwargs["config"],
            passthrough=list(kwargs.get("args") or []),
            options=options,
            dry_run=kwargs["dry_run"],
        )
        raise typer.Exit(code)

    register_command(app, "sbatch", sbatch, _own_parameters())
