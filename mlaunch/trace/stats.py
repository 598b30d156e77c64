"""Small numeric helpers shared by the trace commands (pure, standard library only)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already-sorted values, by linear interpolation between
    the closest ranks (numpy's default, ``statistics.quantiles(method='inclusive')``).

    For ``[10, 20, 30, 40]``: p50 = 25, p95 = 38.5. An empty sequence gives 0.0.
    """
    n = len(sorted_values)
    if n == 0:
        return 0.0
    lo, hi, frac = closest_ranks(n, q)
    return interpolate(sorted_values[lo], sorted_values[hi], frac)


def closest_ranks(n: int, q: float) -> tuple[int, int, float]:
    """The indices (0-based) of the two sorted values the ``q``-th percentile of ``n >= 1``
    values lies between, and how far between: what :func:`percentile` reads. The span store
    fetches just these two values of each group (docs/trace.md), then :func:`interpolate`, so
    its percentiles are these, to the last bit."""
    if n == 1:
        return 0, 0, 0.0
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    return lo, min(lo + 1, n - 1), pos - lo


def interpolate(lo_value: float, hi_value: float, frac: float) -> float:
    """The value ``frac`` of the way from ``lo_value`` to ``hi_value``, as :func:`percentile`
    computes it (``lo + (hi - lo) * frac``: another form, such as ``lo * (1 - frac) + hi * frac``,
    can differ in the last bit, enough to turn a rounded 176 ms into 175)."""
    return float(lo_value) + (float(hi_value) - float(lo_value)) * frac


def median(values: Sequence[float]) -> float:
    """The median (p50 by :func:`percentile`) of unsorted values."""
    return percentile(sorted(values), 50.0)


Interval = tuple[int, int]


def merge(intervals: list[Interval]) -> list[Interval]:
    """Union of half-open intervals as a sorted list of disjoint ones (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` minus ``b``; both merged (sorted, disjoint). Linear two-pointer sweep."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            bs, be = b[k]
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def clip(a: list[Interval], lo: int, hi: int) -> list[Interval]:
    """Merged intervals restricted to ``[lo, hi)``."""
    return [(max(s, lo), min(e, hi)) for s, e in a if e > lo and s < hi]


def total(a: list[Interval]) -> int:
    """Summed length of disjoint intervals."""
    return sum(e - s for s, e in a)
