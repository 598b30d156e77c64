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
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo]) + (float(sorted_values[hi]) - float(sorted_values[lo])) * frac


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
