"""``mlaunch doctor``: render the checks of the :mod:`mlaunch.doctor` package.

Exit codes: 0 when nothing fails, 1 when a check fails, 2 for a bad invocation (a ``--config``
path that is not a readable file). A config file that exists but does not validate is a failed
check (exit 1), not a crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mlaunch.cli.errors import PlainErrorsCommand

if TYPE_CHECKING:
    from mlaunch.doctor.results import CheckResult

_STYLE = {"pass": ("PASS", "green"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "bold red")}


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to the root app."""

    @app.command("doctor", cls=PlainErrorsCommand)
    def doctor(
        config: str | None = typer.Option(
            None,
            "--config",
            metavar="FILE|NAME",
            help="The run config to check, as `mlaunch train --config` takes it (a TOML file"
            " or a shipped config's name). Default: tiny, the one plain `mlaunch train` runs.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
        deep: bool = typer.Option(
            False, "--deep", help="Also run real 2-process all-reduces (gloo; NCCL with GPUs)."
        ),
        script: str | None = typer.Option(
            None,
            "--script",
            metavar="PATH",
            help="The script `mlaunch train --script` would launch (e.g. Megatron-LM's"
            " pretrain_gpt.py): checked as train checks it, with the settings of a script run.",
        ),
        module: str | None = typer.Option(
            None,
            "--module",
            metavar="NAME",
            help="The module `mlaunch train --module` would launch, checked as train checks it.",
        ),
        worker_python: str | None = typer.Option(
            None,
            "--worker-python",
            metavar="PATH",
            help="The Python a --script worker runs with (e.g. Megatron-LM's), when not this one:"
            " doctor runs nemo-lens's own configuration loader under it on the environment"
            " mlaunch would hand the workers.",
        ),
        rdzv_endpoint: str | None = typer.Option(
            None,
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            help="The rendezvous to check, as `mlaunch train` takes it: the host resolves, and on"
            " node 0 the port is free (elsewhere: reachable).",
        ),
        nnodes: str | None = typer.Option(
            None, "--nnodes", metavar="N", help="Number of nodes, as `mlaunch train` takes it."
        ),
        node_rank: str | None = typer.Option(
            None, "--node-rank", metavar="N", help="This node's rank, as `mlaunch train` takes it."
        ),
    ) -> None:
        """Check the machine and the configuration before a run: each check passes, warns or
        fails with a one-line fix. Exit 0 when nothing fails."""
        given = {
            "launch.script": script, "launch.module": module,
            "launch.rdzv_endpoint": rdzv_endpoint, "launch.nnodes": nnodes,
            "launch.node_rank": node_rank,
        }  # fmt: skip
        flags = {path: value for path, value in given.items() if value is not None}
        raise typer.Exit(
            run(config, as_json=as_json, deep=deep, worker_python=worker_python, flags=flags)
        )


_RENDEZVOUS_FLAGS = ("launch.rdzv_endpoint", "launch.nnodes", "launch.node_rank")


def run(
    config: str | None,
    *,
    as_json: bool,
    deep: bool,
    worker_python: str | None = None,
    flags: dict[str, str] | None = None,
) -> int:
    """Run the checks, print them, and return the exit code (2 for a bad flag value: the
    invocation is wrong, not the machine). ``flags``: the settings doctor was given as
    ``mlaunch train`` flags (the entry point, the rendezvous)."""
    if worker_python is not None:
        import shutil

        found = shutil.which(worker_python)
        if found is None:
            from mlaunch.cli.errors import print_problems

            print_problems([("--worker-python", f"{worker_python!r} is not an executable file")])
            return 2
        worker_python = found
    # The same lookup as `mlaunch train --config` (paths and names), and the same default
    # (tiny): plain doctor checks what plain train would run, not the schema's bare defaults.
    from mlaunch.cli.errors import print_problems
    from mlaunch.launcher.configs import resolve_config
    from mlaunch.settings import SettingsError

    try:
        config_path = resolve_config(config, Path.cwd())
    except SettingsError as exc:
        print_problems(exc.problems)
        return 2
    # A malformed rendezvous flag is a wrong invocation (exit 2, as train refuses it); a missing
    # --script or --module is what doctor is there to report (a failed check).
    if rendezvous := {p: v for p, v in (flags or {}).items() if p in _RENDEZVOUS_FLAGS}:
        from mlaunch.settings import collect_problems, flag_name

        _, found = collect_problems(flags=rendezvous, environ=os.environ, config=config_path)
        typed = {flag_name(path) for path in rendezvous}
        if bad := [p for p in found if p.field in typed]:
            print_problems(bad)
            return 2
    from mlaunch.doctor import run_doctor
    from mlaunch.doctor.results import exit_code, to_json

    try:
        results = run_doctor(
            config=config_path, environ=os.environ, deep=deep, worker_python=worker_python,
            flags=flags,
        )  # fmt: skip
    except Exception as exc:  # each check is guarded; this is the last line of defence
        typer.echo(f"mlaunch doctor: internal error: {type(exc).__name__}: {exc}", err=True)
        return 1
    if as_json:
        typer.echo(json.dumps(to_json(results), indent=2))
    else:
        render(results)
    return exit_code(results)


def render(results: list[CheckResult]) -> None:
    """One line per check (status, name, message), the fix under each warning and failure,
    then the counts."""
    from rich.console import Console
    from rich.markup import escape

    from mlaunch.doctor.results import summarize

    console = Console(highlight=False, soft_wrap=True)
    # Long names (package distributions) overflow rather than push every message right.
    width = min(16, max((len(r.name) for r in results), default=0))
    for r in results:
        label, style = _STYLE[r.status]
        console.print(f"[{style}]{label}[/]  {escape(r.name.ljust(width))}  {escape(r.message)}")
        if r.fix and r.status != "pass":
            console.print(f"      {' ' * width}  [dim]fix:[/] {escape(r.fix)}")
        elif r.fix:
            console.print(f"      {' ' * width}  [dim]note:[/] {escape(r.fix)}")
    counts = summarize(results)
    line = f"{counts['pass']} passed, {counts['warn']} warning(s), {counts['fail']} failed"
    console.print(f"\n[{'bold red' if counts['fail'] else 'green'}]{line}[/]")
