"""The workers' output in a run directory: which attempts there were, which log files each rank
of an attempt wrote, their tails, and following them as a run goes on (``mlaunch logs``).

torchrun writes each worker's output to ``logs/node<N>/<rdzv id>_<random>/attempt_<K>/<local
rank>/{stdout,stderr}.log`` (``--log-dir logs/node<N> --redirects 3``): one ``<rdzv id>_<random>``
folder per ``mlaunch train`` on that node (a *launch*: the first run, each resume into the same
run directory, each SLURM incarnation of a requeued job), one ``attempt_<K>`` per torchrun
restart within it.

**Attempt numbering.** A run's attempts are numbered 0, 1, 2 ... over its whole life, in the
order they started: each torchrun restart and each later launch adds one. With a single launch
attempt N is torchrun's ``attempt_N`` (the ``attempt`` ``mlaunch status`` shows). Every node of
a launch restarts together, so a node's i-th launch and its K-th restart are the same attempt
on every node. Launches are ordered by when their first attempt's folder was made (its
modification time), torchrun restarts by K: a copy that did not keep modification times (``cp
-r`` rather than ``cp -a`` or ``rsync -a``) keeps each launch's restarts in order but may order
its launches by name.

A worker's global rank is what mlaunch's worker wrapper wrote beside its output as it started
(``rank``: torchrun's rendezvous may number a node's ranks otherwise than its node rank says),
else ``node * nproc_per_node + local rank`` from the run's resolved settings (``resolved.json``). Nothing here needs a live process or an absolute path: a run
directory copied elsewhere reads the same. Standard library only (the run-directory layer).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mlaunch.rundir.layout import (
    LOGS_DIR,
    NODE_LOG_DIR,
    RESOLVED_JSON_FILE,
    TORCHRUN_ATTEMPT_DIR,
    WORKER_RANK_FILE,
    WORKER_STREAMS,
)
from mlaunch.rundir.records import read_json_object


@dataclass(frozen=True, slots=True)
class RankLog:
    """One worker of one attempt: its global rank, where it ran and its log folder."""

    rank: int
    node: int
    local_rank: int
    folder: Path

    def files(self) -> list[Path]:
        """Its output files that exist (stdout, then stderr)."""
        return [self.folder / s for s in WORKER_STREAMS if (self.folder / s).is_file()]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of the run (see the module docstring for the numbering)."""

    number: int
    #: Which launch into the run directory it belongs to (0: the first ``mlaunch train``).
    launch: int
    #: torchrun's restart count within that launch (its ``attempt_<K>`` folder).
    restart: int
    #: When its folder was made (epoch seconds; the earliest over the nodes).
    started: float
    ranks: tuple[RankLog, ...] = ()

    def describe(self, launches: int) -> str:
        """``attempt 2 (launch 2 of 2, torchrun restart 0)``."""
        return (
            f"attempt {self.number} (launch {self.launch + 1} of {launches},"
            f" torchrun restart {self.restart})"
        )


@dataclass(frozen=True, slots=True)
class WorkerLogs:
    """Every attempt of a run directory, oldest first, and the run's shape."""

    run_dir: Path
    attempts: tuple[Attempt, ...]
    launches: int
    #: The nodes with a log folder (``logs/node<N>``).
    nodes: tuple[int, ...]
    #: Every rank of the run (the resolved world size), else the ranks seen in the logs.
    ranks: tuple[int, ...]

    @property
    def latest(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _shape(run_dir: Path) -> tuple[int | None, int | None]:
    """(nproc per node, world size) from the resolved settings; None where unknown."""
    body = read_json_object(run_dir / RESOLVED_JSON_FILE) or {}
    settings = body.get("settings") if isinstance(body.get("settings"), dict) else {}
    entry = settings.get("launch.nproc_per_node") if settings else None
    nproc = entry.get("value") if isinstance(entry, dict) else None
    world = body.get("world_size")
    return (
        nproc if isinstance(nproc, int) and nproc > 0 else None,
        world if isinstance(world, int) and world > 0 else None,
    )


def _launch_folders(node_dir: Path) -> list[tuple[float, str, dict[int, Path]]]:
    """A node's launches, oldest first: (start, folder name, restart -> attempt folder)."""
    out = []
    try:
        entries = list(os.scandir(node_dir))
    except OSError:
        return []
    for entry in entries:
        if not entry.is_dir():
            continue
        attempts: dict[int, Path] = {}
        try:
            for sub in os.scandir(entry.path):
                k = TORCHRUN_ATTEMPT_DIR.parse(sub.name)
                if k is not None and sub.is_dir():
                    attempts[k] = Path(sub.path)
        except OSError:
            continue
        if not attempts:
            continue
        first = attempts[min(attempts)]
        out.append((_mtime(first) or 0.0, entry.name, attempts))
    return sorted(out, key=lambda t: (t[0], t[1]))


def launch_attempts(node_log_dir: Path, since: float) -> dict[int, tuple[Path, float]]:
    """The torchrun attempt folders of one node's launch that started at ``since`` (epoch
    seconds; folders made before it are an earlier launch's into the same run directory), by
    restart number: (folder, when it was made). What the launcher follows while it runs."""
    found: dict[int, tuple[Path, float]] = {}
    try:
        launches = [e.path for e in os.scandir(node_log_dir) if e.is_dir()]
    except OSError:
        return found
    for launch in launches:
        try:
            subs = list(os.scandir(launch))
        except OSError:
            continue
        for sub in subs:
            k = TORCHRUN_ATTEMPT_DIR.parse(sub.name)
            made = _mtime(Path(sub.path)) if k is not None and sub.is_dir() else None
            if k is not None and made is not None and made >= since - 1:
                found[k] = (Path(sub.path), made)
    return found


def find(run_dir: str | Path) -> WorkerLogs:
    """Every attempt of ``run_dir`` and the files of each of its ranks (an empty result for a
    run whose workers have not started)."""
    run_dir = Path(run_dir)
    nproc, world = _shape(run_dir)
    per_node: dict[int, list[tuple[float, str, dict[int, Path]]]] = {}
    logs = run_dir / LOGS_DIR
    for folder in logs.glob(NODE_LOG_DIR.glob) if logs.is_dir() else ():
        node = NODE_LOG_DIR.parse(folder.name)
        if node is not None and folder.is_dir():
            per_node[node] = _launch_folders(folder)
    # (launch, restart) -> node -> attempt folder; its start the earliest over the nodes.
    keyed: dict[tuple[int, int], dict[int, Path]] = {}
    starts: dict[tuple[int, int], float] = {}
    for node, launches in per_node.items():
        for i, (_, _, attempts) in enumerate(launches):
            for k, folder in attempts.items():
                keyed.setdefault((i, k), {})[node] = folder
                t = _mtime(folder) or 0.0
                starts[(i, k)] = min(starts.get((i, k), t), t)
    locals_seen = [
        int(p.name)
        for by_node in keyed.values()
        for folder in by_node.values()
        for p in _rank_folders(folder)
    ]
    if nproc is None:  # no resolved settings: as many per node as the logs show
        nproc = max(locals_seen, default=-1) + 1 or 1
    attempts = []
    for number, key in enumerate(sorted(keyed)):
        ranks = [
            RankLog(_global_rank(p, node * nproc + int(p.name)), node, int(p.name), p)
            for node, folder in sorted(keyed[key].items())
            for p in _rank_folders(folder)
        ]
        attempts.append(
            Attempt(number, key[0], key[1], starts[key], tuple(sorted(ranks, key=lambda r: r.rank)))
        )
    seen = {r.rank for a in attempts for r in a.ranks}
    every = set(range(world)) if world is not None else seen
    return WorkerLogs(
        run_dir,
        tuple(attempts),
        max((len(v) for v in per_node.values()), default=0),
        tuple(sorted(per_node)),
        tuple(sorted(every | seen)),
    )


def written_rank(folder: Path) -> int | None:
    """The global rank the worker of local-rank folder ``folder`` was: what its wrapper wrote
    there as it started (:data:`~.layout.WORKER_RANK_FILE`), before it could print; None when
    there is no such file (yet)."""
    try:
        text = (folder / WORKER_RANK_FILE).read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None


def _global_rank(folder: Path, planned: int) -> int:
    """The rank the worker of ``folder`` was (:func:`written_rank`), else ``planned`` (node x
    workers per node + local rank)."""
    rank = written_rank(folder)
    return planned if rank is None else rank


def _rank_folders(attempt_folder: Path) -> list[Path]:
    try:
        return sorted(
            (Path(e.path) for e in os.scandir(attempt_folder) if e.name.isdigit() and e.is_dir()),
            key=lambda p: int(p.name),
        )
    except OSError:
        return []


# --------------------------------------------------------------------------------------------
# Reading


def tail_lines(
    path: Path, n: int | None, end: int | None = None, block: int = 64 << 10
) -> list[str]:
    """The last ``n`` lines of ``path`` before byte ``end`` (None: its end; every line when
    ``n`` is None), reading back from there in blocks (a log of gigabytes costs what its last
    lines cost)."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2) if end is None else end
            if n is None:
                fh.seek(0)
                data = fh.read(size)
            else:
                data, pos = b"", size
                while pos > 0 and data.count(b"\n") <= n:
                    step = min(block, pos)
                    pos -= step
                    fh.seek(pos)
                    data = fh.read(step) + data
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines if n is None else lines[-n:] if n > 0 else []


@dataclass
class _Followed:
    offset: int = 0
    partial: bytes = b""


@dataclass
class Follower:
    """The new complete lines of a set of ranks' files since the last :meth:`poll` (a line still
    being written waits for its newline, until :meth:`poll` is told the writer is done)."""

    ranks: list[RankLog]
    _files: dict[Path, _Followed] = field(default_factory=dict)

    def skip_to(self, path: Path, offset: int) -> None:
        """Start ``path`` at ``offset`` (what was already shown of it)."""
        self._files[path] = _Followed(offset)

    def poll(self, final: bool = False) -> list[tuple[RankLog, str]]:
        out: list[tuple[RankLog, str]] = []
        for r in self.ranks:
            for path in r.files():
                state = self._files.setdefault(path, _Followed())
                try:
                    with path.open("rb") as fh:
                        fh.seek(state.offset)
                        data = fh.read()
                except OSError:
                    continue
                state.offset += len(data)
                data = state.partial + data
                cut = data.rfind(b"\n") + 1
                whole, state.partial = data[:cut], data[cut:]
                if final and state.partial:
                    whole, state.partial = whole + state.partial + b"\n", b""
                out += [(r, ln) for ln in whole.decode("utf-8", "replace").splitlines()]
        return out


def select(
    attempt: Attempt, ranks: Iterable[int] | None = None, node: int | None = None
) -> list[RankLog]:
    """The attempt's ranks that ``ranks`` (None: all) and ``node`` (None: all) name."""
    wanted = set(ranks) if ranks is not None else None
    return [
        r
        for r in attempt.ranks
        if (wanted is None or r.rank in wanted) and (node is None or r.node == node)
    ]


def follow(
    run_dir: str | Path,
    emit: Callable[[RankLog, str], None],
    ended: Callable[[], bool],
    *,
    ranks: Iterable[int] | None = None,
    node: int | None = None,
    tail: int | None = None,
    on_attempt: Callable[[Attempt, WorkerLogs], None] | None = None,
    poll_s: float = 0.25,
    ended_every_s: float = 1.0,
) -> None:
    """Emit the selected ranks' output of the newest attempt (its last ``tail`` lines per file
    first, all of it when None) and then every line they write, moving on to each new attempt
    as it starts (a torchrun restart, a resume, a SLURM requeue: ``on_attempt`` says which),
    until ``ended()`` (the run model's verdict: the run is over) - then what is left is read
    once more and it returns."""
    wanted = list(ranks) if ranks is not None else None
    current: Attempt | None = None
    follower = Follower([])
    checked = 0.0
    while True:
        now = time.monotonic()
        done = False
        if now - checked >= ended_every_s:
            # Asked before the files are read: once the run has ended, this read is its last.
            done, checked = ended(), now
        found = find(run_dir)
        latest = found.latest
        if latest is not None and (current is None or latest.number != current.number):
            for r, line in follower.poll(final=True):  # the attempt before, to its end
                emit(r, line)
            first = current is None
            current = latest
            follower = Follower(select(latest, wanted, node))
            if on_attempt is not None:
                on_attempt(latest, found)
            if first and tail is not None:
                for r in follower.ranks:
                    for path in r.files():
                        end = complete_end(path)  # a line being written is followed, not cut
                        for line in tail_lines(path, tail, end):
                            emit(r, line)
                        follower.skip_to(path, end)
        elif latest is not None:
            # The same attempt, read again: torchrun makes an attempt's folder before its
            # ranks' folders, and a worker names its rank as it starts.
            follower.ranks = select(latest, wanted, node)
        for r, line in follower.poll(final=done):
            emit(r, line)
        if done:
            return
        time.sleep(poll_s)


def complete_end(path: Path, block: int = 64 << 10) -> int:
    """The offset just past ``path``'s last newline (0 when it has none in its last block)."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            start = max(0, size - block)
            fh.seek(start)
            data = fh.read(size - start)
    except OSError:
        return 0
    cut = data.rfind(b"\n")
    return start + cut + 1 if cut >= 0 else 0


__all__ = [
    "Attempt",
    "Follower",
    "RankLog",
    "WorkerLogs",
    "complete_end",
    "find",
    "follow",
    "launch_attempts",
    "select",
    "tail_lines",
    "written_rank",
]
