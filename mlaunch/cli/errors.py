"""One shape for every user error: a plain ``field: message`` line per problem on stderr, exit 2.

Plain lines (no Rich wrapping or boxes) so a long value or path stays whole and greppable, and
so Click's own usage errors (an unknown option, a value of the wrong type) read like the
settings layer's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import typer
from typer.core import TyperCommand

#: The exit code of every user error.
USAGE_ERROR = 2


def print_problems(problems: Iterable[tuple[str, str]]) -> None:
    """One ``field: message`` line per problem, on stderr."""
    for field, message in problems:
        typer.echo(f"{field}: {message}", err=True)


def fail(problems: Iterable[tuple[str, str]]) -> typer.Exit:
    """Print the problems; the caller raises the returned ``typer.Exit(2)``."""
    print_problems(problems)
    return typer.Exit(USAGE_ERROR)


def _click() -> Any:
    """Click's exception module as Typer uses it (Typer 0.2x vendors its own copy of Click)."""
    return sys.modules[typer.BadParameter.__module__]


def usage_problem(exc: Any, command: str) -> tuple[str, str]:
    """A Click usage error as one ``field: message`` problem."""
    click = _click()
    if isinstance(exc, click.NoSuchOption):
        close = ", ".join(exc.possibilities or [])
        return exc.option_name, "no such option" + (f" (did you mean {close}?)" if close else "")
    if isinstance(exc, click.BadOptionUsage):
        return exc.option_name, exc.message
    if isinstance(exc, click.BadParameter) and exc.param is not None:
        return "/".join(getattr(exc.param, "opts", []) or [str(exc.param.name)]), exc.message
    return command, exc.format_message()


class PlainErrorsCommand(TyperCommand):
    """A command whose Click usage errors become one ``field: message`` line and exit 2."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except _click().UsageError as exc:
            raise fail([usage_problem(exc, ctx.command_path)]) from None
