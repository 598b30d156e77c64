"""Every ``mlaunch ... --help`` page, rendered exactly as the command line renders it, for the
tests that pin the help (``tests/unit/test_cli_surface.py``) and read it at 80 columns
(``tests/unit/test_help_messages.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import typer

from mlaunch.cli import build_app


def command_paths() -> list[tuple[str, ...]]:
    """Every command and sub-command, from the app itself (a new one is pinned automatically)."""
    root = typer.main.get_command(build_app())
    paths: list[tuple[str, ...]] = [()]

    def walk(cmd: Any, prefix: tuple[str, ...]) -> None:
        if hasattr(cmd, "commands"):  # a group (typer vendors its own click)
            for name, sub in sorted(cmd.commands.items()):
                if sub.hidden:
                    continue
                paths.append((*prefix, name))
                walk(sub, (*prefix, name))

    walk(root, ())
    return paths


#: Prints every ``mlaunch PATH --help`` page of the paths given as JSON on stdin, each exactly as
#: the command line would (``mlaunch.cli.main`` with that argv), in one process: forty process
#: starts cost more than the rest of the unit tests together.
HELP_PAGES = """
import contextlib, io, json, sys
from mlaunch.cli import main
# As ``python -m mlaunch`` (click names the program from the __main__ module and argv[0]).
sys.modules["__main__"].__package__ = "mlaunch"
pages = []
for path in json.load(sys.stdin):
    sys.argv = ["__main__.py", *path, "--help"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    pages.append({"path": path, "code": code, "out": out.getvalue(), "err": err.getvalue()})
json.dump(pages, sys.__stdout__)
"""


def help_pages(env: dict[str, str]) -> dict[tuple[str, ...], str]:
    """Every command path's ``--help`` page (each must exit 0) under ``env`` (its COLUMNS sets
    the width), from one process."""
    proc = subprocess.run(
        [sys.executable, "-c", HELP_PAGES], input=json.dumps(command_paths()),
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pages: dict[tuple[str, ...], str] = {}
    for page in json.loads(proc.stdout):
        assert page["code"] == 0, (page["path"], page["err"])
        pages[tuple(page["path"])] = page["out"]
    return pages
