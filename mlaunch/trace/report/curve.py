"""One training curve (a value per iteration) in memory bounded at any run length.

Up to :data:`MAX_CURVE_POINTS` distinct iterations a :class:`Curve` keeps every point, the last
value of each iteration (a resumed run's repeats count once), and draws them all: a short run's
report is what it always was. Past that it folds the points into buckets of a power-of-two
width of iterations (doubled, buckets merged in pairs, whenever there would be more than the
limit), each keeping its count, sum, min and max: the chart draws the mean as the line and
min-max as a band, so a one-iteration spike still shows, and neither the page nor the memory
behind it grows with the run (a 10^6-iteration run would otherwise be 5 x 10^6 points in the
HTML, and the records behind them a few hundred bytes an iteration).
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: Past this many distinct iterations a curve is drawn decimated (at most this many buckets).
MAX_CURVE_POINTS = 4000


class Points(NamedTuple):
    """What a chart draws of a curve: ``ys`` at ``xs``; ``lo``/``hi`` (the band of each bucket)
    and ``width`` (iterations a bucket) only when decimated (``width`` 0: every point)."""

    xs: list[int]
    ys: list[float]
    lo: list[float] | None = None
    hi: list[float] | None = None
    width: int = 0
    iterations: int = 0  # the values folded into the buckets (when decimated)


class Curve:
    """A value per iteration; :meth:`points` gives what to draw."""

    __slots__ = ("_limit", "_exact", "_buckets", "_width")

    def __init__(self, limit: int | None = None) -> None:
        # read here, not as a default argument: a test lowers the module's limit
        self._limit = max(1, MAX_CURVE_POINTS if limit is None else limit)
        #: iteration -> the raw value (None: none), while exact; None once decimated
        self._exact: dict[int, Any] | None = {}
        #: bucket (iteration // width) -> [count, sum, min, max, sum of iterations]
        self._buckets: dict[int, list[Any]] = {}
        self._width = 1

    def add(self, iteration: int, value: Any) -> None:
        """The value of ``iteration`` (None: it has none). While exact, a later value of the
        same iteration replaces the earlier one, as the last record of an iteration counts; the
        value is turned into a float only when drawn, as it always was."""
        exact = self._exact
        if exact is not None:
            exact[iteration] = value
            if len(exact) > self._limit:
                self._decimate()
        elif value is not None:
            self._fold(iteration, value)

    def _decimate(self) -> None:
        exact, self._exact = self._exact or {}, None
        for it, v in exact.items():
            if v is not None:
                self._fold(it, v)

    def _fold(self, it: int, value: Any) -> None:
        try:
            v = float(value)
        except (TypeError, ValueError):  # not a number: no point (exact mode raises at drawing)
            return
        b = it // self._width
        acc = self._buckets.get(b)
        if acc is None:
            self._buckets[b] = [1, v, v, v, it]
            if len(self._buckets) > self._limit:
                self._coarsen()
            return
        acc[0] += 1
        acc[1] += v
        if v < acc[2]:  # comparisons, not min(): a NaN never becomes the band's edge
            acc[2] = v
        if v > acc[3]:
            acc[3] = v
        acc[4] += it

    def _coarsen(self) -> None:
        while len(self._buckets) > self._limit:
            self._width *= 2
            merged: dict[int, list[Any]] = {}
            for b, acc in self._buckets.items():
                m = merged.get(b // 2)
                if m is None:
                    merged[b // 2] = acc
                else:
                    m[0] += acc[0]
                    m[1] += acc[1]
                    m[2] = acc[2] if acc[2] < m[2] else m[2]
                    m[3] = acc[3] if acc[3] > m[3] else m[3]
                    m[4] += acc[4]
            self._buckets = merged

    def points(self) -> Points:
        """The points to draw, by iteration: every one, or each bucket's mean (at its mean
        iteration) with its min and max."""
        if self._exact is not None:
            pts = [(it, float(v)) for it, v in sorted(self._exact.items()) if v is not None]
            return Points([p[0] for p in pts], [p[1] for p in pts])
        accs = [self._buckets[b] for b in sorted(self._buckets)]
        return Points(
            [round(a[4] / a[0]) for a in accs], [a[1] / a[0] for a in accs],
            [a[2] for a in accs], [a[3] for a in accs], self._width, sum(a[0] for a in accs),
        )  # fmt: skip
