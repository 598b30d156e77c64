"""``mlaunch trace`` through the real CLI app in-process, for the trace, receiver and fault tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner


def invoke_trace(*args: str | Path) -> Any:
    """``mlaunch trace ARGS`` (a wide terminal, so tables are not wrapped); the click Result."""
    from mlaunch.cli import app

    return CliRunner().invoke(app, ["trace", *map(str, args)], env={"COLUMNS": "200"})


def trace_cli(*args: str | Path) -> tuple[int, str]:
    """``mlaunch trace ARGS``: its exit code and output."""
    r = invoke_trace(*args)
    return r.exit_code, r.output


def user_error(result: Any, *needles: str) -> str:
    """A clear user error: exit 2, no traceback, every needle in the output; returns the output."""
    text = result.output
    assert result.exit_code == 2, text
    assert "Traceback" not in text
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    for n in needles:
        assert n in text, f"{n!r} not in {text!r}"
    return text
