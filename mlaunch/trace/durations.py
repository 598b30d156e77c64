"""The one formatter of durations for people: milliseconds as three significant digits, in the
unit that keeps the number short.

It has two styles because two views show durations differently and each keeps its look:

- ``aligned`` (the terminal tables of ``mlaunch trace summary`` and ``goodput``): a fixed number
  of decimals for the size (``1.50ms``, ``15.0ms``, ``150ms``) so a column of them lines up, and
  seconds as the largest unit (``1,234s``);
- ``compact`` (the HTML report, :func:`mlaunch.trace.report.style.fmt_ms`): trailing zeros
  dropped (``1.5ms``) and minutes past 60 s.
"""

from __future__ import annotations

from typing import Literal

#: How :func:`format_ms` writes a duration (see the module docstring).
DurationStyle = Literal["aligned", "compact"]


def format_ms(ms: float, style: DurationStyle = "aligned") -> str:
    """``ms`` milliseconds as three significant digits in µs / ms / s (``aligned``) or
    µs / ms / s / min (``compact``); zero is ``0`` in both."""
    if ms == 0:
        return "0"
    if style == "compact":
        a = abs(ms)
        if a < 1:
            return f"{ms * 1e3:.3g}µs"
        if a < 1e3:
            return f"{ms:.3g}ms"
        if a < 6e4:
            return f"{ms / 1e3:.3g}s"
        return f"{ms / 6e4:.3g}min"
    # A unit is kept while the number rounds below 1,000 in it; seconds take any size.
    for scale, unit in ((1e-3, "µs"), (1.0, "ms"), (1e3, "s")):
        x = ms / scale
        if x < 999.5 or unit == "s":
            break
    if x < 9.995:
        return f"{x:.2f}{unit}"
    if x < 99.95:
        return f"{x:.1f}{unit}"
    return f"{x:,.0f}{unit}"
