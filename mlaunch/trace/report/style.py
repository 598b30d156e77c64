"""How the report names, orders, colours and formats things (shared by its figures and page)."""

from __future__ import annotations

import html
from typing import Any

from mlaunch.model.groups import GROUPS
from mlaunch.model.spans import span_def
from mlaunch.trace.durations import format_ms

#: The group of spans outside the catalogue (a user script's own names).
OTHER_GROUP = "other"
#: The colour of :data:`OTHER_GROUP`: dark grey, apart from every group's own colour.
OTHER_COLOUR = "#525252"
#: Group name -> colour, in the catalogue's order (the legend's and the header's order), taken
#: from the one group definition so that a new group brings its colour with it.
GROUP_COLOURS: dict[str, str] = {
    **{str(group): info.colour for group, info in GROUPS.items()},
    OTHER_GROUP: OTHER_COLOUR,
}
_GROUP_ORDER = list(GROUP_COLOURS)


def fmt_ms(v: float) -> str:
    """Milliseconds in the report's compact style (``1.5ms``, ``20.6min``; see
    :func:`mlaunch.trace.durations.format_ms`)."""
    return format_ms(v, "compact")


def group_of(name: str) -> str:
    """The span group a span name belongs to (``other`` outside the catalogue)."""
    try:
        return str(span_def(name).group)
    except KeyError:
        return OTHER_GROUP


def group_order(group: str) -> int:
    """Where ``group`` sorts: the catalogue's order, unknown names last."""
    return _GROUP_ORDER.index(group) if group in GROUP_COLOURS else len(_GROUP_ORDER)


def hover_value(v: Any) -> str:
    """An attribute value for a hover label: floats to six digits, long text cut, HTML escaped."""
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    return html.escape(text if len(text) <= 80 else text[:77] + "...")


#: Span times are nanoseconds; the figures' axes are milliseconds.
NS_PER_MS = 1e6
