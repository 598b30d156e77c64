"""``mlaunch train``: parse, call the launcher, render. The logic lives in
:mod:`mlaunch.launcher.plan` (what to do) and :mod:`mlaunch.launcher.run` (doing it), the views
in :mod:`mlaunch.cli.train_view`.

Every setting gets a flag, generated from the settings model (:mod:`mlaunch.cli.setting_flags`),
so a new field is one edit in the settings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mlaunch.cli.errors import USAGE_ERROR, print_problems
from mlaunch.cli.setting_flags import (
    apply_negative_flags,
    given_settings,
    passthrough_parameter,
    register_command,
)
from mlaunch.settings import flag_name

if TYPE_CHECKING:  # the launcher loads only when a command launches (fast --help)
    from mlaunch.launcher.plan import LaunchPlan


def _own_parameters() -> list[tuple[str, Any, Any]]:
    """The command's own options (before the setting flags), as (name, annotation, default)."""
    return [
        ("config", str | None, typer.Option(
            None, "--config", metavar="FILE|NAME",
            help="TOML config file, or the name of a shipped one (tiny, pp2, dp2pp2, profiling,"
            " megatron, gpu8). Default: tiny.",
        )),
        ("dry_run", bool, typer.Option(
            False, "--dry-run", help="Print the command and environment; start and create nothing.",
        )),
        ("print_env", bool, typer.Option(
            False, "--print-env", help="Print the worker environment as `export K=V` lines and exit.",
        )),
        ("show_secrets", bool, typer.Option(
            False, "--show-secrets",
            help="Write/print secrets (OTEL_EXPORTER_OTLP_HEADERS) instead of redacting them.",
        )),
        ("report", bool, typer.Option(
            False, "--report",
            help="After the run, write report.html (timeline, span breakdown, curves, goodput)"
            " into the run directory.",
        )),
        passthrough_parameter(),
    ]  # fmt: skip


def _train_argv(argv: list[str]) -> list[str] | None:
    """The words after ``train`` in ``mlaunch ... train ARGS`` (the command as the user gave it,
    for the resume command); None when this process was not started that way."""
    words = argv[1:]
    first = next((i for i, a in enumerate(words) if not a.startswith("-")), None)
    if first is None or words[first] != "train":
        return None
    return words[first + 1 :]


def run_train(
    *,
    flags: dict[str, Any],
    config: str | None,
    passthrough: list[str],
    dry_run: bool,
    print_env: bool,
    show_secrets: bool,
    report: bool = False,
) -> int:
    """The command's work: plan, then print or launch. Returns the exit code."""
    from rich.console import Console

    from mlaunch.cli import train_view as view
    from mlaunch.launcher.plan import build_plan
    from mlaunch.launcher.run import RunDirBusy, execute
    from mlaunch.settings import SettingsError

    try:
        plan = build_plan(
            flags=flags, config=config, passthrough=passthrough, environ=dict(os.environ),
            cwd=Path.cwd(), argv=_train_argv(sys.argv),
        )  # fmt: skip
    except SettingsError as exc:
        print_problems(exc.problems)
        return USAGE_ERROR
    if not (print_env or dry_run):
        problems = [p for p in (_device_problem(plan), _rendezvous_problem(plan)) if p]
        if problems:
            print_problems(problems)
            return USAGE_ERROR
    if print_env:
        # unset lines too: a stale alias left in the user's shell would conflict in the workers.
        unset = [f"unset {name}" for name in plan.removed_env]
        typer.echo("\n".join(plan.env_lines(show_secrets) + unset))
        return 0
    console = Console()
    if dry_run:
        console.print(view.summary(plan))
        typer.echo(view.dry_run_text(plan, show_secrets))
        return 0
    displays: list[Any] = []
    shown = console  # this node's view: replaced by its launcher.log on nodes other than 0

    def started() -> Any:
        # Called once torchrun is running: the summary prints while the workers import torch.
        nonlocal shown
        shown = _node_console(plan, console)
        if shown is not console:
            typer.echo(
                f"node {plan.settings.launch.node_rank} of {plan.settings.launch.nnodes}: the"
                f" progress view is node 0's; this node's is in {shown.file.name}"
            )
        shown.print(view.summary(plan))
        shown.print(view.starting_text(plan), highlight=False, soft_wrap=True)
        displays.append(
            view.BarDisplay(shown, plan.settings.training.train_iters, plan)
            if shown.is_terminal
            else view.PlainDisplay(shown, plan.settings.training.log_interval, plan, console)
        )
        return displays[0]

    try:
        result = execute(plan, started, show_secrets=show_secrets)
    except RunDirBusy as exc:
        print_problems([(flag_name("launch.run_dir"), str(exc))])
        return USAGE_ERROR
    except OSError as exc:
        print_problems([(flag_name("launch.run_dir"), f"cannot create the run directory ({exc})")])
        return USAGE_ERROR
    finally:
        for display in displays:
            display.close()
    made = _write_report(plan) if report else None
    view.print_result(shown, plan, result, made)
    if shown is not console:
        if result.exit_code != 0 and result.interrupted is None:  # a failure: shown here too
            view.print_result(console, plan, result, made)
        shown.file.close()
    return result.exit_code


def _device_problem(plan: LaunchPlan) -> tuple[str, str] | None:
    """``--device cuda`` on a machine whose workers would see no CUDA: refused before the run
    directory exists or torchrun starts (doctor's probe, in a subprocess: the launcher never
    imports torch). Only a real launch asks: ``--dry-run`` and ``mlaunch sbatch`` plan on
    machines (a login node) that are not where the workers run."""
    if plan.settings.launch.device != "cuda":
        return None
    import sys

    from mlaunch.doctor.torch_probe import cuda_missing

    why = cuda_missing([sys.executable], plan.child_env)
    if why is None:
        return None
    return (
        plan.settings.label("launch.device"),
        f"cuda, but the workers would find no CUDA device ({why}); use --device cpu (or"
        " auto), or run where they see a GPU",
    )


def _rendezvous_problem(plan: LaunchPlan) -> tuple[str, str] | None:
    """An ``--rdzv-endpoint`` that cannot work, refused before the run directory exists or
    torchrun starts: a host that does not resolve (torchrun would retry for minutes), or, on
    the node that hosts the store, a port another program holds (torchrun would wait on it).
    Only a real launch asks, as for the device: a dry run or ``mlaunch sbatch`` may plan where
    the job's hosts are not (a login node)."""
    launch = plan.settings.launch
    if launch.rdzv_endpoint is None:
        return None  # --standalone: torchrun binds a free port itself
    from mlaunch.launcher.rendezvous import check_endpoint

    label = plan.settings.label("launch.rdzv_endpoint")
    verdict = check_endpoint(
        launch.rdzv_endpoint, node_rank=launch.node_rank, nnodes=launch.nnodes,
        backend=launch.rdzv_backend, rdzv_id=plan.rdzv_id, label=label,
    )  # fmt: skip
    if verdict.problem is None:
        return None
    return label, f"{verdict.problem}; {verdict.fix}"


def _node_console(plan: LaunchPlan, console: Any) -> Any:
    """Where this node's summary, progress view and result go: the terminal on node 0 (or a
    single node); on the other nodes of a multi-node run their ``launcher.log``, so a job's
    output (all nodes' stdout in one SLURM file) shows one progress view, not several
    interleaved."""
    from rich.console import Console

    from mlaunch.rundir import layout as lay

    launch = plan.settings.launch  # the run directory exists: called once torchrun runs
    if launch.nnodes == 1 or launch.node_rank == 0:
        return console
    log = (plan.log_dir / lay.LAUNCHER_LOG).open("a", encoding="utf-8")
    return Console(file=log, width=120, force_terminal=False)


def _write_report(plan: LaunchPlan) -> Path | None:
    """The HTML report of a finished run, or None (with a note) when it cannot be made."""
    if not (plan.settings.telemetry.enabled and plan.settings.telemetry.exporter == "file"):
        typer.echo("report: skipped (only runs traced with the file exporter have local traces)")
        return None
    from mlaunch.trace.reader import TraceInputError
    from mlaunch.trace.report import write_report

    try:
        return write_report(plan.run_dir)
    except (TraceInputError, OSError) as exc:
        typer.echo(f"report: not written ({exc})", err=True)
        return None


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to the root app."""

    def train(**kwargs: Any) -> None:
        """Validate, plan and launch a training run on torchrun (default: --config tiny, CPU,
        telemetry on, traces written to the run directory)."""
        flags = given_settings(kwargs)
        apply_negative_flags(kwargs, flags)
        code = run_train(
            flags=flags,
            config=kwargs["config"],
            passthrough=list(kwargs.get("args") or []),
            dry_run=kwargs["dry_run"],
            print_env=kwargs["print_env"],
            show_secrets=kwargs["show_secrets"],
            report=kwargs["report"],
        )
        raise typer.Exit(code)

    register_command(app, "train", train, _own_parameters())
