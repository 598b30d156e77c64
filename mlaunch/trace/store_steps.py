"""Each rank's steps and collective ends, sorted, for the windowed ``stragglers`` of
:mod:`mlaunch.trace.stragglers`: read once in any order (:class:`Spool`), sorted a rank
at a time into a :class:`Blob` (in memory, or a file of the store's scratch directory), then
found by what stays small (:class:`SortedSteps`, :class:`SortedEnds`: the first key of every
:data:`BLOCK`-th row) and handed to the rules a window's run at a time (:class:`WindowSteps`,
:class:`WindowEnds`), which raise :class:`Widen` where the run is not
the whole trace."""

from __future__ import annotations

import os
import shutil
import tempfile
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Widen(Exception):
    """A window's analysis reached spans the window does not hold: it needs a wider one."""


#: Rows of a block of a rank's sorted steps (or ends): a search reads one block, and of every
#: block only its first key (and the steps' largest end) stays in memory, 16 bytes.
BLOCK = 256
#: Steps and ends read (all ranks together) between two writes of them, unsorted, to disk.
SPOOL_ROWS = 1 << 20


class Steps:
    """A run of a rank's steps in order, read as the rules read a list of (start, end, iteration)
    tuples (indexing, slices, ``bisect``), kept as three int64 arrays: 24 bytes a step, where a
    list of tuples costs about 150."""

    __slots__ = ("start", "end", "it")

    def __init__(self, start: array[int], end: array[int], it: array[int]) -> None:
        self.start, self.end, self.it = start, end, it

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(zip(self.start[i], self.end[i], self.it[i], strict=True))
        return (self.start[i], self.end[i], self.it[i])

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.start, self.end, self.it, strict=True)

    def run(self, a: int, c: int) -> Steps:
        return Steps(self.start[a:c], self.end[a:c], self.it[a:c])

    def bisect(self, t: int) -> int:
        """``bisect_right(steps, (t, 2^62, 0))`` of the tuples, on the starts."""
        i = bisect_right(self.start, t)
        while i and self.start[i - 1] == t and (self.end[i - 1], self.it[i - 1]) > (1 << 62, 0):
            i -= 1  # a step starting at t sorts after the key when its end is past 2^62
        return i


class WindowSteps(Steps):
    """The steps a window holds of a rank: the run ``[first, first + len)`` of its sorted steps
    around what the window loaded. A lookup answers as on every step, or raises
    :class:`Widen` when the answer is a step the run lacks (the run's
    edge is not the trace's): the rules never see an answer the whole trace would not give."""

    __slots__ = ("first", "total")

    def __init__(self, steps: Steps | SortedSteps, a: int, c: int) -> None:
        run = steps.run(a, c)
        super().__init__(run.start, run.end, run.it)
        self.first, self.total = a, len(steps)

    def bisect(self, t: int) -> int:
        i = super().bisect(t)
        if (i == 0 and self.first > 0) or (i == len(self) and self.first + i < self.total):
            raise Widen  # the step before t is outside the run
        return i


class WindowEnds:
    """The collective ends a window holds of a rank, as :class:`WindowSteps` holds its steps:
    the run ``[first, first + len)`` of the sorted ends; :meth:`before` answers as on every
    end, or raises :class:`Widen`."""

    __slots__ = ("ends", "first", "total")

    def __init__(self, ends: SortedEnds, a: int, c: int) -> None:
        self.ends, self.first, self.total = ends.run(a, c), a, len(ends)

    def before(self, t: int) -> int | None:
        """The last end at or before ``t`` (None: none in the whole trace)."""
        i = bisect_right(self.ends, t)
        if (i == 0 and self.first > 0) or (i == len(self.ends) and self.first + i < self.total):
            raise Widen  # the end before t is outside the run
        return self.ends[i - 1] if i else None


class Blob:
    """Bytes appended once, then read back by offset: in memory (a bytearray), or, for a trace
    of more than :data:`~mlaunch.trace.stragglers.STEPS_IN_MEMORY` steps, in a file of
    the store's scratch directory read with ``os.pread`` (not mapped: the mapped pages a read
    touches would count in the peak RSS)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.fd = None if path is None else os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.buf = bytearray()
        self.size = 0

    def append(self, data: bytes | memoryview) -> int:
        """Append ``data``; its offset."""
        pos = self.size
        if self.fd is None:
            self.buf += data
        else:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
        self.size += len(data)
        return pos

    def read(self, pos: int, n: int) -> bytes | bytearray:
        if self.fd is None:
            return self.buf[pos : pos + n]  # a copy: no view holds the buffer while it grows
        out = os.pread(self.fd, n, pos)
        if len(out) != n:
            raise OSError(f"short read of a straggler scratch file ({len(out)} of {n} bytes)")
        return out

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def discard(self) -> None:
        """Close it and free what it holds (its file, on disk)."""
        self.close()
        self.buf = bytearray()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class Sorted:
    """A rank's sorted column (its steps by start, its collective ends) in a :class:`Blob`,
    found through what stays small: the key of every :data:`BLOCK`-th row. A search reads one
    block."""

    __slots__ = ("blob", "pos", "n", "heads", "dtype")

    def __init__(self, blob: Blob, rows: Any) -> None:
        self.blob, self.n, self.dtype = blob, len(rows), rows.dtype
        self.pos = blob.append(_bytes(rows))
        self.heads = array("q", self._key(rows[::BLOCK]).tobytes())

    @staticmethod
    def _key(rows: Any) -> Any:
        return rows

    def __len__(self) -> int:
        return self.n

    def _read(self, a: int, c: int) -> Any:
        import numpy as np

        size = self.dtype.itemsize
        if c <= a:
            return np.zeros(0, self.dtype)
        return np.frombuffer(self.blob.read(self.pos + a * size, (c - a) * size), self.dtype)

    def _search(self, t: int, side: str) -> int:
        """``bisect_left`` (``side='left'``) or ``bisect_right`` of ``t`` in the keys."""
        import numpy as np

        k = (bisect_left if side == "left" else bisect_right)(self.heads, t) - 1
        if k < 0:
            return 0  # before the first block's first key (or at it, searching left)
        a = k * BLOCK
        keys = self._key(self._read(a, min(self.n, a + BLOCK)))
        return a + int(np.searchsorted(keys, t, side))

    def upper(self, t: int) -> int:
        """How many keys are at or before ``t``."""
        return self._search(t, "right")


class SortedEnds(Sorted):
    """A rank's collective ends, ascending."""

    __slots__ = ()

    def run(self, a: int, c: int) -> array[int]:
        return array("q", self._read(a, c).tobytes())


class SortedSteps(Sorted):
    """A rank's steps, sorted as tuples sort (by start, then end, then iteration), with the
    largest end of each block (a step overlapping a time is in a block whose largest end is
    past it: no reach back by the longest step)."""

    __slots__ = ("tops",)

    def __init__(self, blob: Blob, rows: Any) -> None:
        import numpy as np

        super().__init__(blob, rows)
        ends = rows["end"]
        self.tops = np.maximum.reduceat(ends, np.arange(0, len(rows), BLOCK)) if len(rows) else ends

    @staticmethod
    def _key(rows: Any) -> Any:
        return rows["start"]

    def lower(self, t: int) -> int:
        """How many steps start before ``t``."""
        return self._search(t, "left")

    def run(self, a: int, c: int) -> Steps:
        rows = self._read(a, c)
        return Steps(*(array("q", rows[k].tobytes()) for k in ("start", "end", "it")))

    def bisect(self, t: int) -> int:
        """``bisect_right(steps, (t, 2^62, 0))`` of the tuples, as :meth:`Steps.bisect`."""
        i = self.upper(t)
        while i:
            st, en, it = self.run(i - 1, i)[0]
            if st != t or (en, it) <= (1 << 62, 0):
                break
            i -= 1  # a step starting at t sorts after the key when its end is past 2^62
        return i

    def overlapping(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The steps that overlap ``[lo, hi]`` (ends included), in order."""
        import numpy as np

        b = self.upper(hi)
        blocks = np.flatnonzero(self.tops[: -(-b // BLOCK)] >= lo).tolist()
        out: list[tuple[int, int, int]] = []
        i = 0
        while i < len(blocks):  # a run of consecutive blocks in one read
            j = i
            while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
                j += 1
            rows = self._read(blocks[i] * BLOCK, min(b, (blocks[j] + 1) * BLOCK))
            rows = rows[rows["end"] >= lo]
            out += zip(rows["start"].tolist(), rows["end"].tolist(), rows["it"].tolist(),
                       strict=True)  # fmt: skip
            i = j + 1
        return out


class Spill:
    """Where the steps and collective ends are kept while the analysis runs (:class:`Blob`):
    in memory, or in files of a directory in ``scratch`` (the store's scratch directory, on the
    run's disk), removed at the end."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.dir: Path | None = None
        self.blobs: list[Blob] = []

    def blob(self, on_disk: bool) -> Blob:
        if on_disk and self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix=".stragglers-", dir=self.scratch))
        b = Blob(self.dir / f"{len(self.blobs)}.bin" if on_disk and self.dir else None)
        self.blobs.append(b)
        return b

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc: object) -> None:
        for b in self.blobs:
            b.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


class Spool:
    """The steps and collective ends as read (in no order), a rank's taken once all are read.
    On disk, whatever was read is written out unsorted every :data:`SPOOL_ROWS` rows (all
    ranks together), so only a rank's own (while it is sorted) is ever whole in memory."""

    def __init__(self, spill: Spill, on_disk: bool) -> None:
        self.steps: dict[int, tuple[array[int], array[int], array[int]]] = {}
        self.ends: dict[int, array[int]] = {}
        self.chunks: dict[int, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
        self.blob = spill.blob(on_disk) if on_disk else None
        self.unwritten = 0

    def add_rank(self, rank: int) -> None:
        self.steps[rank] = (array("q"), array("q"), array("q"))
        self.ends[rank] = array("q")
        self.chunks[rank] = ([], [])

    def read(self, rows: int) -> None:
        """``rows`` more were read: written out past :data:`SPOOL_ROWS`."""
        self.unwritten += rows
        if self.blob is None or self.unwritten < SPOOL_ROWS:
            return
        for rank, cols in self.steps.items():
            steps, ends = self.chunks[rank]
            if len(cols[0]):
                steps.append((self.blob.append(_bytes(step_rows(*cols))), len(cols[0])))
            if len(self.ends[rank]):
                ends.append((self.blob.append(self.ends[rank].tobytes()), len(self.ends[rank])))
            self.add_rank(rank)
            self.chunks[rank] = (steps, ends)
        self.unwritten = 0

    def take(self, rank: int) -> tuple[Any, Any]:
        """The rank's steps (rows of :func:`step_rows`) and ends (int64), all of them."""
        import numpy as np

        steps, ends = self.chunks.pop(rank)
        st, en = [step_rows(*self.steps.pop(rank))], [_int64(self.ends.pop(rank))]
        if self.blob is not None:
            size = step_rows().dtype.itemsize
            st += [np.frombuffer(self.blob.read(pos, n * size), st[0].dtype) for pos, n in steps]
            en += [np.frombuffer(self.blob.read(pos, n * 8), np.int64) for pos, n in ends]
        return np.concatenate(st), np.concatenate(en)

    def close(self) -> None:
        if self.blob is not None:
            self.blob.discard()


def step_rows(start: array[int] | None = None, end: array[int] | None = None,
               it: array[int] | None = None) -> Any:  # fmt: skip
    """Steps as numpy rows of (start, end, iteration), int64 each (none given: no rows)."""
    import numpy as np

    dtype = np.dtype([("start", np.int64), ("end", np.int64), ("it", np.int64)])
    rows = np.empty(0 if start is None else len(start), dtype)
    if len(rows):
        for k, col in (("start", start), ("end", end), ("it", it)):
            rows[k] = _int64(col)
    return rows


def _bytes(rows: Any) -> memoryview:
    """A numpy array's bytes, not copied (a rank's sorted steps can be hundreds of MB)."""
    import numpy as np

    return memoryview(np.ascontiguousarray(rows).view(np.uint8))


def _int64(a: array[int] | None) -> Any:
    """An array of int64 as numpy (no copy)."""
    import numpy as np

    return np.frombuffer(a, np.int64) if a else np.zeros(0, np.int64)


class IterationStarts:
    """Of each iteration (:attr:`keys`, ascending), the earliest and the latest start of its
    steps on any rank, added a rank at a time: a window finds a rank's steps of its iterations
    between the two (24 bytes an iteration, whatever the ranks)."""

    def __init__(self) -> None:
        import numpy as np

        self.keys = np.zeros(0, np.int64)
        self.first = np.zeros(0, np.int64)
        self.last = np.zeros(0, np.int64)

    def add(self, its: Any, starts: Any) -> None:
        import numpy as np

        if not len(its):
            return
        big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
        keys, inv = np.unique(its, return_inverse=True)
        first = np.full(len(keys), big, np.int64)
        last = np.full(len(keys), small, np.int64)
        np.minimum.at(first, inv, starts)
        np.maximum.at(last, inv, starts)
        if not np.array_equal(keys, self.keys):
            merged = np.union1d(self.keys, keys)
            at = np.searchsorted(merged, self.keys)
            lo, hi = np.full(len(merged), big, np.int64), np.full(len(merged), small, np.int64)
            lo[at], hi[at] = self.first, self.last
            self.keys, self.first, self.last = merged, lo, hi
        at = np.searchsorted(self.keys, keys)
        self.first[at] = np.minimum(self.first[at], first)
        self.last[at] = np.maximum(self.last[at], last)
