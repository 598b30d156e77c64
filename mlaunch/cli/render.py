"""Rich renderings shared by several commands: the span tree, group tables, error lists.

Imports only rich and the pure model, so every command can use it cheaply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.table import Table
from rich.tree import Tree

from mlaunch.model.groups import GROUPS, PRESETS, SpanGroup
from mlaunch.model.spans import CATALOGUE, effective_parent, estimate_spans_per_iteration


def span_placement(enabled: frozenset[SpanGroup]) -> dict[str, str | None]:
    """Where each catalogue span is drawn: an enabled span under the nearest enabled ancestor
    (where it will attach at run time), a disabled one under its catalogue parent."""
    return {
        d.name: effective_parent(d.name, enabled) if d.group in enabled else d.parent
        for d in CATALOGUE
    }


def span_tree(enabled: frozenset[SpanGroup], title: str = "span tree") -> Tree:
    """The catalogue's span tree (Megatron-LM's code names, each span under its parent) with each
    span marked on (green) or off (dim), ``G`` where it carries ``is_goodput_span``, ``+`` for an
    mlaunch extra, "Megatron-LM only" for a span mlaunch's trainer does not emit, and the
    documented name an older trace may carry instead."""
    placement = span_placement(enabled)
    tree = Tree(f"[bold]{title}[/]")
    nodes: dict[str | None, Tree] = {None: tree}
    for d in CATALOGUE:  # catalogue order puts every parent before its children
        on = d.group in enabled
        mark = "[green]on [/]" if on else "[dim]off[/]"
        label = f"{mark} {'+' if d.extra else ''}{d.name}  [cyan]{d.group.value}[/]"
        if d.goodput:
            label += " G"
        if d.megatron_only:
            label += "  [dim](Megatron-LM only)[/]"
        if d.alias:
            label += f"  [dim](documented as {d.alias})[/]"
        if d.note:
            label += f"  [dim]({d.note})[/]"
        if on and d.parent is not None and placement[d.name] != d.parent:
            label += f"  [yellow](attaches here: {d.parent} is off)[/]"
        if not on:
            label = f"[dim]{label}[/]"
        nodes[d.name] = nodes[placement[d.name]].add(label)
    return tree


def groups_table(enabled: Iterable[SpanGroup] | None = None, *, compact: bool = False) -> Table:
    """Every group with its description and frequency (and on/off when ``enabled`` is given);
    ``compact`` leaves out the descriptions and presets to fit a narrow terminal."""
    on = frozenset(enabled) if enabled is not None else None
    table = Table(title="span groups", show_lines=False)
    if on is not None:
        table.add_column("")
    # Names a user types are never cut ("…"): the name column keeps its width, and a word
    # too long for its column elsewhere folds onto the next line.
    table.add_column("group", style="cyan", no_wrap=True)
    if not compact:
        table.add_column("covers", overflow="fold")
    table.add_column("frequency", overflow="fold")
    if not compact:
        table.add_column("presets", style="dim", overflow="fold")
    for group, info in GROUPS.items():
        presets = ", ".join(name for name, members in PRESETS.items() if group in members)
        row = (
            [group.value, info.frequency]
            if compact
            else [group.value, info.description, info.frequency, presets]
        )
        if on is not None:
            row.insert(0, "[green]on[/]" if group in on else "[dim]off[/]")
        table.add_row(*row)
    return table


def presets_table() -> Table:
    """Every preset and its groups."""
    table = Table(title="presets")
    table.add_column("preset", style="cyan", no_wrap=True)
    table.add_column("groups", overflow="fold")
    for name, members in PRESETS.items():
        label = (
            "all 16 groups"
            if len(members) == len(GROUPS)
            else ", ".join(g.value for g in SpanGroup if g in members)
        )
        table.add_row(name, label)
    return table


#: What indents a row's numbers under its name when a row does not fit on one line.
_STACK_INDENT = "    "


def name_table(
    headers: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]], width: int | None
) -> list[str]:
    """The lines of a table whose first column is a name and whose other columns are numbers.

    A name is never wrapped or cut (span names are what a user greps for and types into a
    backend's search), and the numbers are right-aligned in columns as wide as their widest
    cell, so they line up whatever the names. One row a line when every row fits in ``width``
    (``None``: no limit, for a pipe or a file, so each row is one greppable line); else each
    name on its own line and its numbers under it, indented, in the same columns."""
    num_w = [len(h) for h in headers[1:]]
    for _, cells in rows:
        num_w = [max(w, len(c)) for w, c in zip(num_w, cells, strict=True)]

    def nums(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, num_w, strict=True))

    name_w = max([len(headers[0]), *(len(n) for n, _ in rows)])
    if width is None or name_w + 2 + len(nums(headers[1:])) <= width:
        lines = [f"{headers[0].ljust(name_w)}  {nums(headers[1:])}"]
        return lines + [f"{n.ljust(name_w)}  {nums(c)}" for n, c in rows]
    lines = [headers[0], _STACK_INDENT + nums(headers[1:])]
    for n, c in rows:
        lines += [n, _STACK_INDENT + nums(c)]
    return lines


def estimate_line(
    enabled: frozenset[SpanGroup], *, microbatches: int, layers: int, pp: int, dp: int = 1
) -> str:
    """One line with the estimated spans per iteration per rank (per stage when pp > 1)."""
    per_stage = estimate_spans_per_iteration(
        enabled, microbatches=microbatches, layers=layers, pp=pp, dp=dp
    )
    shape = (
        f"{microbatches} microbatches, {layers} layers, {pp} pipeline stage(s), "
        f"{dp} data-parallel replica(s)"
    )
    if pp == 1:
        return f"~{per_stage[0]} spans per iteration per exporting rank ({shape})"
    stages = ", ".join(f"stage {i}: {n}" for i, n in enumerate(per_stage))
    return f"~{max(per_stage)} spans per iteration per exporting rank at most ({stages}; {shape})"


__all__ = [
    "estimate_line",
    "groups_table",
    "name_table",
    "presets_table",
    "span_placement",
    "span_tree",
]
