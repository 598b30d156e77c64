"""``mlaunch train``: parse, call the launcher, render. The logic lives in
:mod:`mlaunch.launcher.plan` (what to do) and :mod:`mlaunch.launcher.run` (doing it).

Every setting gets a flag, generated from the settings model so a new field is one edit in
``settings.py``; flags are taken as text and converted by the settings layer, so a bad value is
reported like every other problem (``--num-layers: ...``, exit 2) rather than by Click.
"""

from __future__ import annotations

import inspect
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import typer
from pydantic_core import PydanticUndefined

from mlaunch.cli.errors import USAGE_ERROR, PlainErrorsCommand, fail, print_problems
from mlaunch.settings import CHOICES, SECTIONS, flag_name

_PANELS = {
    "launch": "Launch (torchrun)",
    "telemetry": "Telemetry (MEGATRON_OTEL_*)",
    "telemetry.otel": "OpenTelemetry (OTEL_*)",
    "model": "Model",
    "training": "Training",
    "parallelism": "Parallelism",
}


def _fields(prefix: str, model: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            out += _fields(f"{prefix}.{name}", ann)
        else:
            out.append((f"{prefix}.{name}", info))
    return out


def setting_paths() -> list[tuple[str, Any]]:
    """Every settings path with its pydantic field, in section order."""
    out: list[tuple[str, Any]] = []
    for section, model in SECTIONS.items():
        out += _fields(section, model)
    return out


def _leaf_types(ann: Any) -> list[Any]:
    if typing.get_origin(ann) is typing.Annotated:
        return _leaf_types(typing.get_args(ann)[0])
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(ann) for t in _leaf_types(a) if t is not type(None)]
    return [ann]


def _metavar(ann: Any) -> tuple[bool, str]:
    """(is a boolean flag, metavar) for a field annotation."""
    leaves = _leaf_types(ann)
    if bool in leaves:
        return True, ""
    leaf = leaves[0] if leaves else str
    if typing.get_origin(leaf) is Literal:
        # The names go in the help text: a wide metavar column cut option names at 80 columns.
        return False, "NAME"
    if typing.get_origin(leaf) is dict or leaf is dict:
        return False, "K=V,..."
    return False, {int: "INT", float: "FLOAT"}.get(leaf, "TEXT")


def _literal_choices(ann: Any) -> tuple[str, ...]:
    """The names a Literal field takes (empty for other fields)."""
    leaves = _leaf_types(ann)
    if leaves and typing.get_origin(leaves[0]) is Literal:
        return tuple(map(str, typing.get_args(leaves[0])))
    return ()


def _param_name(path: str) -> str:
    return "s__" + path.replace(".", "__")


def _default_text(info: Any) -> str:
    """`` (default: X)`` (not ``[...]``: Rich markup would eat it) for a field with a default worth showing ('' for unset ones)."""
    default = info.default
    if default is None or default is PydanticUndefined or callable(default):
        return ""
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    if isinstance(default, str | int | float):
        return f" (default: {default})" if str(default) != "" else ""
    if isinstance(default, frozenset | set | tuple | list) and default:
        return f" (default: {','.join(sorted(map(str, default)))})"
    return ""


def _setting_parameters() -> list[inspect.Parameter]:
    params = []
    for path, info in setting_paths():
        is_bool, metavar = _metavar(info.annotation)
        flag = flag_name(path)
        panel = _PANELS[
            "telemetry.otel" if path.startswith("telemetry.otel.") else path.split(".")[0]
        ]
        # Field docstrings use reST ``literals`` and hard line breaks; --help shows flowing text.
        help_text = " ".join((info.description or "").replace("``", "").split())
        if choices := CHOICES.get(path) or _literal_choices(info.annotation):
            help_text += f" One of: {', '.join(choices)}."
        help_text += _default_text(info)
        if is_bool:
            # One visible name per flag: a second column of --no-... names left too little
            # room at 80 columns and Rich cut option names (--otlp-traces-sa...). The negative
            # form still works, hidden, and the help says so.
            negative = f"--no-{flag.removeprefix('--')}"
            option = typer.Option(
                None, flag, help=f"{help_text} ({negative} turns it off.)",
                rich_help_panel=panel, show_default=False,
            )  # fmt: skip
            params.append(
                inspect.Parameter(
                    _negative_name(path),
                    inspect.Parameter.KEYWORD_ONLY,
                    default=typer.Option(None, negative, hidden=True),
                    annotation=bool | None,
                )  # fmt: skip
            )
            ann: Any = bool | None
        else:
            option = typer.Option(
                None, flag, help=help_text, metavar=metavar, rich_help_panel=panel,
                show_default=False,
            )  # fmt: skip
            ann = str | None
        params.append(
            inspect.Parameter(
                _param_name(path), inspect.Parameter.KEYWORD_ONLY, default=option, annotation=ann
            )
        )
    return params


def _negative_name(path: str) -> str:
    return "n__" + path.replace(".", "__")


def _command_parameters() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    own = [
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
        ("args", list[str] | None, typer.Argument(
            None, metavar="[-- ARGS]", help="Passed unchanged to the entry point.", show_default=False,
        )),
    ]  # fmt: skip
    return [inspect.Parameter(name, kw, default=d, annotation=a) for name, a, d in own]


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
            cwd=Path.cwd(),
        )  # fmt: skip
    except SettingsError as exc:
        print_problems(exc.problems)
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
        displays.append(
            view.BarDisplay(shown, plan.settings.training.train_iters)
            if shown.is_terminal
            else view.PlainDisplay(shown, plan.settings.training.log_interval)
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


def _node_console(plan: Any, console: Any) -> Any:
    """Where this node's summary, progress view and result go: the terminal on node 0 (or a
    single node); on the other nodes of a multi-node run their ``launcher.log``, so a job's
    output (all nodes' stdout in one SLURM file) shows one progress view, not several
    interleaved."""
    from rich.console import Console

    from mlaunch import envcontract as ec

    launch = plan.settings.launch  # the run directory exists: called once torchrun runs
    if launch.nnodes == 1 or launch.node_rank == 0:
        return console
    log = (plan.log_dir / ec.LAUNCHER_LOG).open("a", encoding="utf-8")
    return Console(file=log, width=120, force_terminal=False)


def _write_report(plan: Any) -> Path | None:
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
    settings_params = _setting_parameters()
    paths = {_param_name(path): path for path, _ in setting_paths()}

    def train(**kwargs: Any) -> None:
        """Validate, plan and launch a training run on torchrun (default: --config tiny, CPU,
        telemetry on, traces written to the run directory)."""
        flags = {paths[k]: v for k, v in kwargs.items() if k in paths}
        for path in paths.values():
            if kwargs.get(_negative_name(path)):
                if flags.get(path):
                    name = flag_name(path)
                    raise fail([(name, f"{name} and --no-{name[2:]} exclude each other")])
                flags[path] = False
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

    train.__signature__ = inspect.Signature(_command_parameters() + settings_params)  # type: ignore[attr-defined]
    app.command(
        "train", cls=PlainErrorsCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )(train)
