"""One shape for every user error: a plain ``field: message`` line per problem on stderr, exit 2.

Plain lines (no Rich wrapping or boxes) so a long value or path stays whole and greppable, and
so Click's own usage errors (an unknown option, a value of the wrong type) read like the
settings layer's. A problem that no single field names (the trace commands' bad input, where
the message itself names the file and line or the flag, and says the fix) is ``error:
message``: the same line with ``error`` in the field's place, through the same helper.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

#: The exit code of every user error.
USAGE_ERROR = 2
#: The exit code of a command that ran but could not finish its work (a replay whose requests
#: failed, a submission SLURM refused); what is left can be retried unchanged.
RUN_FAILED = 1


def print_problems(problems: Iterable[tuple[str, str]]) -> None:
    """One ``field: message`` line per problem, on stderr."""
    for field, message in problems:
        typer.echo(f"{field}: {message}", err=True)


def fail(problems: Iterable[tuple[str, str]], code: int = USAGE_ERROR) -> typer.Exit:
    """Print the problems; the caller raises the returned ``typer.Exit`` (2 unless ``code``)."""
    print_problems(problems)
    return typer.Exit(code)


def error(message: str, code: int = USAGE_ERROR) -> typer.Exit:
    """Print ``error: message`` (a problem the message names itself, e.g. ``PATH:LINE: ...``
    and its fix); the caller raises the returned ``typer.Exit`` (2 unless ``code``)."""
    return fail([("error", message)], code)


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
    if isinstance(exc, click.MissingParameter) and exc.param is not None:
        # Click leaves .message empty here and builds its text in format_message; say it plainly.
        if exc.param.param_type_name == "argument":
            # As the help names it (RUN_DIR|JOB_ID), not by the Python parameter behind it
            # (target).
            missing = f"a required argument is missing; see {command} --help"
            return _argument_name(exc.param), missing
        name = "/".join(getattr(exc.param, "opts", []) or [str(exc.param.name)])
        return name, f"a required option is missing; see {command} --help"
    if isinstance(exc, click.BadParameter) and exc.param is not None:
        return "/".join(getattr(exc.param, "opts", []) or [str(exc.param.name)]), exc.message
    return command, exc.format_message()


def _argument_name(param: Any) -> str:
    """A positional argument's name as its help panel shows it: its metavar, else its name."""
    return str(param.metavar or param.name)


def fit_help_tables() -> None:
    """Make Typer's Rich help tables narrow-terminal safe (idempotent; called only when help is
    shown, so no other command pays for importing Rich).

    Rich shrinks every column of an over-wide table and cuts what does not fit with "…": at 80
    columns ``train --help`` showed ``--otlp-traces-sa…``. Here every column but the last
    (option names, types) keeps its width and the last (the help text) wraps at spaces. A name
    is never split: where the help column would be narrower than its longest word (an
    environment variable's name: ``OTEL_EXPORTER_OTLP_TRACES_E⏎NDPOINT`` at 80 columns), the
    panel lists each option on a line of its own with its help indented under it.
    A flag shows no value type (Typer wrote ``<bool>`` beside every flag, as if it took one),
    nor does an argument whose name says what it takes (``RUN_DIR|JOB_ID``, ``[-- ARGS]``).
    """
    import copy
    import dataclasses

    import typer.rich_utils as rich_utils
    from rich.columns import Columns
    from rich.console import Console, ConsoleOptions, Group, RenderResult
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text
    from typer.core import TyperArgument, TyperOption

    if getattr(rich_utils.Table, "_mlaunch_fits", False):
        return

    def _text(cell: Any) -> str:
        return (cell.plain if isinstance(cell, Text) else str(cell)).strip()

    class FittingTable(Table):
        _mlaunch_fits = True

        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            cells = list(renderables)
            last = cells[-1] if cells else None
            if isinstance(last, Columns) and all(isinstance(r, Text) for r in last.renderables):
                # Typer lays out help + "[default: ...]" as Columns, which cuts with "…";
                # one Text wraps instead.
                cells[-1] = Text(" ").join(last.renderables)
            super().add_row(*cells, **kwargs)
            for column in self.columns[:-1]:
                column.no_wrap = True
                column.overflow = "fold"

        def _fits(self, console: Console, options: ConsoleOptions) -> bool:
            """Whether every column but the last keeps its width and the last still holds its
            longest word."""
            wide = options.update_width(1 << 16)
            need = self._extra_width
            for i, column in enumerate(self.columns):
                m = self._measure_column(console, wide, column)
                need += m.minimum if i == len(self.columns) - 1 else m.maximum
            return need <= options.max_width

        def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
            kept = [c for c in self.columns if any(_text(cell) for cell in c._cells)]
            if 0 < len(kept) < len(self.columns):
                # Typer gives every panel columns for short and negative names; empty, they
                # still took their padding from the help text.
                table = copy.copy(self)
                table.columns = [dataclasses.replace(c, _index=i) for i, c in enumerate(kept)]
                yield from table.__rich_console__(console, options)
                return
            if not self.columns or self._fits(console, options):
                yield from super().__rich_console__(console, options)
                return
            rows: list[Any] = []
            for r in range(self.row_count):
                cells = [column._cells[r] for column in self.columns]
                names = [c if isinstance(c, Text) else Text(str(c)) for c in cells[:-1]]
                rows.append(Text("  ").join(n for n in names if _text(n)))
                rows.append(Padding(cells[-1], (0, 0, 0, 4)))
            yield from console.render(Group(*rows), options)

    option_type, argument_type = TyperOption.display_type_rich, TyperArgument.display_type_rich

    def flag_has_no_type(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else option_type(self, ctx)

    def named_argument_has_no_type(self: TyperArgument, ctx: Any) -> str | None:
        # RUN_DIR|JOB_ID, [-- ARGS]: the name says what it takes (<list[str]> said less)
        return None if self.metavar else argument_type(self, ctx)

    TyperOption.display_type_rich = flag_has_no_type  # type: ignore[method-assign]
    TyperArgument.display_type_rich = named_argument_has_no_type  # type: ignore[method-assign]
    rich_utils.Table = FittingTable  # type: ignore[misc]


def reflow(text: str | None) -> str | None:
    """``text`` (a docstring) with each paragraph's hard line breaks turned into spaces, so Rich
    wraps it at the terminal's width (kept: blank lines, and lines of lists or indented blocks)."""
    if not text:
        return text
    out: list[str] = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.splitlines()
        if any(
            ln.startswith((" ", "-", "*", "\b")) or ln[:2].rstrip(".").isdigit() for ln in lines
        ):
            out.append(paragraph)
        else:
            out.append(" ".join(ln.strip() for ln in lines))
    return "\n\n".join(out)


def _prepare_help(command: Any) -> None:
    fit_help_tables()
    command.help = reflow(command.help)


class PlainErrorsCommand(TyperCommand):
    """A command whose Click usage errors become one ``field: message`` line and exit 2."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)  # Click's parser consumes the list
        try:
            return super().parse_args(ctx, args)
        except _click().UsageError as exc:
            field, message = usage_problem(exc, ctx.command_path)
            token = self._dash_value(exc, given)
            if token is not None:
                # `groups resolve -layer`: Click reads a value that starts with '-' as short
                # options (-l...); say how to pass it.
                message += (
                    f"; a value that starts with '-' goes after '--': {ctx.command_path} -- {token}"
                )
            raise fail([(field, message)]) from None

    def _dash_value(self, exc: Any, args: list[str]) -> str | None:
        """The single-dash word an unknown short option came from, when this command takes a
        positional value it may have been meant as (else None)."""
        if not isinstance(exc, _click().NoSuchOption) or exc.option_name.startswith("--"):
            return None
        if not any(p.param_type_name == "argument" for p in self.params):
            return None
        for arg in args:
            if arg == "--":
                break
            if arg.startswith(exc.option_name) and not arg.startswith("--") and len(arg) > 2:
                return arg
        return None

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Help that never cuts an option name (see :func:`fit_help_tables`) and flows."""
        _prepare_help(self)
        super().format_help(ctx, formatter)


class PlainErrorsGroup(TyperGroup):
    """A command group whose usage errors (an unknown command) are one plain line, exit 2, like
    every other error (Typer would draw a Rich box)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except _click().UsageError as exc:
            raise fail([usage_problem(exc, ctx.command_path)]) from None

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """The subcommand; an unknown name is one ``command: message`` line with a did-you-mean."""
        try:
            return super().resolve_command(ctx, args)
        except _click().UsageError:
            from mlaunch.model.spec import closest_word

            name = args[0] if args else ""
            known = sorted(self.list_commands(ctx))
            close = closest_word(name, known)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise fail(
                [
                    (
                        ctx.command_path,
                        f"no such command {name!r}{hint}; commands: {', '.join(known)}",
                    )
                ]
            ) from None

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Help that never cuts a name (see :func:`fit_help_tables`) and flows: the commands'
        one-line summaries too (their docstrings' line breaks split sentences mid-line)."""
        _prepare_help(self)
        for command in self.commands.values():
            command.help = reflow(command.help)
        super().format_help(ctx, formatter)
