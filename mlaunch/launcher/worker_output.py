"""The workers' output on the launcher's console (``--tee``, ``--local-ranks-filter``).

torchrun keeps writing every rank's stdout and stderr to its files (``--redirects 3``): a worker
never blocks on a slow terminal, and the per-rank logs stay complete. One thread of the
launcher follows the files of this node's current attempt (and of each attempt after a restart)
and writes their lines to the console, each prefixed ``[rank R]``:

- only complete lines: a partial line waits for its newline (or for the end of the run); a line
  that never ends is shown in pieces of :data:`MAX_LINE` bytes, each ending with
  :data:`CONTINUED`;
- every batch of whole lines goes out in one write, under the console's lock (the display's
  own lines too), so a line is never split or interleaved with another rank's;
- files are read :data:`CHUNK` bytes at a time: memory stays bounded whatever a rank prints; a
  console slower than the workers only delays the lines, which wait in the files and are read
  when their turn comes (nothing is dropped), and the end of the run drains them all.

No torch here, like the rest of the launcher's side: torch runs in the workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlaunch.rundir import layout as lay
from mlaunch.rundir.worker_logs import launch_attempts, written_rank

if TYPE_CHECKING:
    from mlaunch.launcher.plan import LaunchPlan

#: At most this many bytes are read from one file at a time (the memory one file can hold).
CHUNK = 64 * 1024
#: A line longer than this is shown in pieces of this size (one rank writing without newlines
#: must not hold the console's memory, nor its turn, without bound).
MAX_LINE = 64 * 1024
#: The end of a piece of a line longer than :data:`MAX_LINE`: the line goes on in the next one.
CONTINUED = " [mlaunch: line continues]"
#: How often the follower looks for new output when there was none the last time.
POLL_S = 0.05
#: How long the end of the run waits for the console to take the lines still in the files.
DRAIN_S = 120.0
#: torchrun's per-local-rank output files, in the order a rank's new lines are shown.
STREAMS = (lay.WORKER_STDOUT_LOG, lay.WORKER_STDERR_LOG)


class RankMap:
    """The global rank of each of this node's workers.

    On one node it is the local rank. On several, torchrun's c10d rendezvous numbers the nodes
    by host name and process id, not by ``--node-rank``, so the workers say it themselves: the
    wrapper every worker starts through writes its ``RANK`` into its log folder before the
    worker can print (:func:`mlaunch.rundir.worker_logs.written_rank`, which ``mlaunch logs``
    reads too). A folder without one once its workers are gone (a worker that failed to start)
    is numbered ``node_rank * nproc_per_node + local rank``, as the static rendezvous does."""

    def __init__(self, node_rank: int, nproc: int, nnodes: int) -> None:
        self.first, self.nnodes = node_rank * nproc, nnodes

    def rank(self, folder: Path, local: int, *, final: bool = False) -> int | None:
        """The global rank of local rank ``local`` whose log folder is ``folder``, or None while
        it is not known yet. ``final``: its workers are gone, so the static numbering stands in
        for a rank never written."""
        if self.nnodes == 1:
            return local
        rank = written_rank(folder)
        if rank is not None:
            return rank
        return self.first + local if final else None


@dataclass
class _Followed:
    """One worker's stdout or stderr file, read from ``offset`` on once its rank is known."""

    path: Path
    attempt: int
    local: int
    prefix: bytes | None = None
    #: Its rank is one the filter leaves out: never read.
    skip: bool = False
    fd: int | None = None
    offset: int = 0
    partial: bytes = b""

    def read(self, final: bool) -> tuple[bytes, bool]:
        """(the new complete lines, prefixed; whether more is waiting in the file). ``final``:
        the writer is gone, so a last line without a newline is complete."""
        assert self.prefix is not None  # the follower reads a file once its rank is known
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return b"", False  # torchrun has not made it yet
        data = os.pread(self.fd, CHUNK, self.offset)
        self.offset += len(data)
        more = len(data) == CHUNK
        text = self.partial + data
        end = text.rfind(b"\n") + 1
        lines, self.partial = text[:end], text[end:]
        # The prefix before each line by one replace (C speed): a rank printing 10 MB of short
        # lines costs the launcher no per-line Python work.
        nl = b"\n" + self.prefix
        out = [self.prefix + lines[:-1].replace(b"\n", nl) + b"\n"] if lines else []
        while len(self.partial) >= MAX_LINE:
            piece, self.partial = self.partial[:MAX_LINE], self.partial[MAX_LINE:]
            out.append(self.prefix + piece + CONTINUED.encode() + b"\n")
        if final and not more and self.partial:
            out.append(self.prefix + self.partial + b"\n")
            self.partial = b""
        return b"".join(out), more

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class WorkerOutput:
    """Follows this node's workers' output files in ``log_dir`` (``nproc`` local ranks per
    attempt) and hands the lines of the ranks in ``shown`` (global ranks; None: all) to ``write``
    (a batch of whole ``[rank R] ...`` lines, as text). Start it once torchrun runs; :meth:`close`
    when torchrun has exited drains what is left."""

    def __init__(
        self,
        log_dir: Path,
        since: float,
        nproc: int,
        shown: frozenset[int] | None,
        ranks: RankMap,
        write: Callable[[str], None],
    ) -> None:
        self.log_dir, self.since, self.nproc = log_dir, since, nproc
        self.shown, self.ranks, self.write = shown, ranks, write
        self._files: dict[tuple[int, int, str], _Followed] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlaunch-worker-output", daemon=True)
        self._drain_until = float("inf")
        #: Bytes the console never showed: the drain at the end ran out of time.
        self.behind = 0
        #: Why the follower stopped early (the files still hold every line), or None.
        self.error: str | None = None

    def start(self) -> WorkerOutput:
        """Begin following (a daemon thread: it never keeps the launcher alive)."""
        self._thread.start()
        return self

    def close(self, drain_s: float = DRAIN_S) -> None:
        """torchrun has exited: show every line still in the files, then stop. Past ``drain_s``
        (a console far slower than the workers were) the rest stays in the files only, and
        :attr:`behind` says how many bytes that is."""
        if not self._thread.is_alive():
            return
        self._drain_until = time.monotonic() + drain_s
        self._stop.set()
        self._thread.join()

    # ---- the thread ------------------------------------------------------------------------

    def _discover(self) -> None:
        """Add every local rank's files of every attempt folder of this launch."""
        for attempt, (folder, _) in sorted(launch_attempts(self.log_dir, self.since).items()):
            for local in range(self.nproc):
                for stream in STREAMS:
                    key = (attempt, local, stream)
                    if key not in self._files:
                        path = folder / str(local) / stream
                        self._files[key] = _Followed(path, attempt, local)

    def _pass(self, final: bool) -> bool:
        """Read each shown file once (attempts in order, so an attempt's last lines come before
        the next one's first); write what came as one batch. Whether more is waiting."""
        out: list[bytes] = []
        more = False
        latest = max((key[0] for key in self._files), default=0)
        for key in sorted(self._files):
            f = self._files[key]
            done = final or f.attempt < latest  # an earlier attempt's workers are gone
            if f.prefix is None and not f.skip:
                rank = self.ranks.rank(f.path.parent, f.local, final=done)
                if rank is None:
                    continue  # not known yet: the file waits, unread
                f.skip = self.shown is not None and rank not in self.shown
                f.prefix = f"[rank {rank}] ".encode()
            if f.skip:
                continue
            lines, pending = f.read(done)
            if lines:
                out.append(lines)
            more = more or pending
        if out:
            self.write(b"".join(out).decode("utf-8", "replace"))
        return more

    def _run(self) -> None:
        try:
            next_look = 0.0
            while not self._stop.is_set():
                if time.monotonic() >= next_look:  # new attempt folders: at most 5 times a second
                    self._discover()
                    next_look = time.monotonic() + 0.2
                if not self._pass(final=False):
                    self._stop.wait(POLL_S)
            self._discover()
            while self._pass(final=True):
                if time.monotonic() > self._drain_until:
                    self.behind = sum(
                        max(0, _size(f.path) - f.offset) for f in self._files.values() if not f.skip
                    )
                    break
        except Exception as exc:  # never the run's outcome: the files hold every line
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            for f in self._files.values():
                f.close()


@contextlib.contextmanager
def follow(plan: LaunchPlan, since: float, write: Callable[[str], None]) -> Iterator[None]:
    """While inside (torchrun runs), this node's ranks that ``--tee`` /
    ``--local-ranks-filter`` show reach ``write``; on the way out every line left in the files
    is shown, and what the console could not take in time, or a follower that stopped, is said
    (never dropped silently: the per-rank logs hold it all)."""
    launch = plan.settings.launch
    if not launch.tee_on:
        yield
        return
    ranks = RankMap(launch.node_rank, launch.nproc_per_node, launch.nnodes)
    follower = WorkerOutput(
        plan.log_dir, since, launch.nproc_per_node, launch.shown_ranks, ranks, write
    ).start()
    try:
        yield
    finally:
        follower.close()
        logs = plan.log_dir
        notes = []
        if follower.behind:
            notes.append(
                f"mlaunch: {follower.behind:,} bytes of worker output not shown here (the console"
                f" could not keep up); every line is in the per-rank logs under {logs}\n"
            )
        if follower.error:
            notes.append(
                f"mlaunch: worker output stopped reaching the console ({follower.error}); every"
                f" line is in the per-rank logs under {logs}\n"
            )
        for note in notes:
            with contextlib.suppress(Exception):  # a console that failed may fail again
                write(note)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


__all__ = ["CHUNK", "CONTINUED", "MAX_LINE", "RankMap", "WorkerOutput", "follow"]
