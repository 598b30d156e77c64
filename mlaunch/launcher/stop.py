"""Stopping a live local run (``mlaunch stop``): the launchers of every node on this host get the
graceful SIGTERM, after the request is written to the run directory.

The order matters: the request (:data:`~mlaunch.rundir.layout.STOP_REQUEST_FILE`) is written
first, then the signals go out. The launcher reads it when the signal arrives (``--now``: it kills
the workers instead of asking them to save), ``mlaunch status`` reads it to say *stopped* rather
than preempted, and a SLURM job's batch script reads it to not requeue a stop the user asked for
(:mod:`mlaunch.slurm.stop` sends that job its warning signal instead of SIGTERM).

Every check comes before the request is written: a run that is not running, or one of another
user, is refused with nothing changed (no file written, no signal sent).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlaunch.launcher.run_status import pid_alive
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json
from mlaunch.rundir.records import (
    StopRequest,
    launcher_nodes,
    read_launcher_record,
    read_stop_request,
)

#: How long ``mlaunch stop`` waits for the run to end by default: the current iteration, a save
#: and the telemetry flush, with room for torchrun's own 30 s grace to a worker that ignores
#: SIGTERM.
DEFAULT_TIMEOUT_S = 300.0
#: How long a launcher that holds its lock but has not yet written this launch's record (its
#: first moments) is waited for before the stop gives up on it.
STARTING_WAIT_S = 30.0
POLL_S = 0.2


class StopRefused(ValueError):
    """The run cannot be stopped by this user now; the message says why. Nothing was changed."""


@dataclass(frozen=True)
class NodeLauncher:
    """One node's live launcher of the run."""

    node: int
    pid: int
    host: str | None
    started: float
    uid: int | None
    """The real uid of its process (None: on another host, not checked)."""

    @property
    def here(self) -> bool:
        """On this host: it can be signalled and its process checked."""
        return self.host == socket.gethostname()

    def describe(self) -> str:
        return f"node {self.node}'s launcher (pid {self.pid} on {self.host})"


def _uid_of(pid: int) -> int | None:
    """The real uid of process ``pid`` (``/proc/PID/status``), or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _lock_holder(run_dir: Path, node: int) -> int | None:
    """The pid the node's lock file names when that process is a live mlaunch here (the lock is
    taken before the launcher's record is written: a launch in its first moments)."""
    try:
        with lay.run_lock_file(run_dir, node).open("rb") as fh:
            info = json.loads(fh.read(4096) or b"{}")
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not pid_alive(pid):
        return None
    return pid if isinstance(pid, int) else None


def _lock_nodes(run_dir: Path) -> list[int]:
    names = (lay.RUN_LOCK_FILE.parse(p.name) for p in run_dir.glob(lay.RUN_LOCK_FILE.glob))
    return sorted(n for n in names if n is not None)


def handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler installed (``SigCgt`` of
    ``/proc/PID/status``): a launcher installs its handler once torchrun is spawned, and removes it
    when torchrun has exited; a SIGTERM outside that window would kill it on the spot, leaving
    neither its workers' save nor its record's end."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def live_launchers(run_dir: Path) -> tuple[list[NodeLauncher], dict[int, int]]:
    """Every node's launcher of the newest launch that has not ended (a launcher on this host
    whose process is gone has ended, killed), and the launchers on this host not ready for the
    signal yet (node -> pid): one that holds its lock but has not written this launch's record,
    or has not installed its SIGTERM handler (its first moments, or its last)."""
    out: list[NodeLauncher] = []
    recorded: set[int] = set()
    not_ready: dict[int, int] = {}
    for node in launcher_nodes(run_dir):
        rec = read_launcher_record(run_dir, node)
        if rec is None or rec.ended is not None or rec.pid is None:
            continue
        here = rec.host == socket.gethostname()
        if here and not pid_alive(rec.pid):
            continue
        recorded.add(rec.pid)
        out.append(NodeLauncher(node, rec.pid, rec.host, rec.started,
                                _uid_of(rec.pid) if here else None))  # fmt: skip
        if here and not handles_sigterm(rec.pid):
            not_ready[node] = rec.pid
    for node in _lock_nodes(run_dir):
        if (pid := _lock_holder(run_dir, node)) is not None and pid not in recorded:
            not_ready[node] = pid
    return out, not_ready


def _alive(launcher: NodeLauncher, run_dir: Path) -> bool:
    """Whether the launcher has not ended yet: here, while its process lives (it records its end
    before it closes its receiver and writes the span store); elsewhere, until its record says
    it ended."""
    if launcher.here:
        return pid_alive(launcher.pid)
    rec = read_launcher_record(run_dir, launcher.node)
    return rec is not None and rec.pid == launcher.pid and rec.ended is None


def owner_problem(launchers: list[NodeLauncher], run: str) -> str | None:
    """Why this user may not stop the run (another user's launcher), or None."""
    me = os.getuid()
    for la in launchers:
        if la.uid is not None and la.uid != me:
            return (
                f"{run} belongs to {user_name(la.uid)} ({la.describe()}); only the user who"
                " started it can stop it"
            )
    return None


def user_name(uid: int) -> str:
    """``user alice (uid 1000)``, or ``uid 1000`` when the name is unknown."""
    import pwd

    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def new_request(now: bool, job_id: str | None = None) -> StopRequest:
    """This user's request, made now."""
    import pwd

    uid = os.getuid()
    try:
        user: str | None = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = None
    return StopRequest(time.time(), now, uid, user, socket.gethostname(), os.getpid(), job_id)


def write_request(run_dir: Path, request: StopRequest) -> None:
    """Write the request where the launchers, the batch script and ``status`` read it; raises
    :class:`StopRefused` when it cannot be written (then nothing was written)."""
    try:
        write_json(run_dir / lay.STOP_REQUEST_FILE, request.as_json(), indent=1)
    except OSError as exc:
        raise StopRefused(
            f"cannot write the stop request {run_dir / lay.STOP_REQUEST_FILE}"
            f" ({exc.strerror or exc}); nothing was stopped"
        ) from None


@dataclass
class LocalStop:
    """A local run's launchers, checked and ready to be stopped (:func:`prepare`)."""

    run_dir: Path
    launchers: list[NodeLauncher]
    earlier: StopRequest | None
    """A stop already asked of this launch (graceful; this one may make it ``--now``)."""

    @property
    def here(self) -> list[NodeLauncher]:
        return [la for la in self.launchers if la.here]

    @property
    def elsewhere(self) -> list[NodeLauncher]:
        return [la for la in self.launchers if not la.here]


def prepare(
    run_dir: Path,
    *,
    state: Callable[[], str],
    wait_s: float = STARTING_WAIT_S,
    say: Callable[[str], None],
) -> LocalStop:
    """Find the run's live launchers and check that this user may stop them; raises
    :class:`StopRefused` (nothing changed) when there is none, one belongs to another user, or
    none runs on this host. ``state``: the run's state word (asked only to refuse a run that is not
    running). A launcher not ready for the signal (:func:`live_launchers`) is waited for."""
    launchers, not_ready = live_launchers(run_dir)
    if not launchers and not not_ready:
        raise StopRefused(
            f"run {run_dir} is {state().replace('_', ' ')}, not running: nothing to stop"
        )
    me = os.getuid()
    for node, pid in not_ready.items():
        if (uid := _uid_of(pid)) is not None and uid != me:
            raise StopRefused(
                f"run {run_dir} belongs to {user_name(uid)} (node {node}'s launcher, pid {pid});"
                " only the user who started it can stop it"
            )
    if (problem := owner_problem(launchers, f"run {run_dir}")) is not None:
        raise StopRefused(problem)
    for la in launchers:
        if la.here:  # where /proc hides other users' processes: the kernel's own check
            try:
                os.kill(la.pid, 0)
            except PermissionError:
                raise StopRefused(
                    f"run {run_dir}: {la.describe()} is not yours to signal; only the user who"
                    " started it can stop it"
                ) from None
            except ProcessLookupError:
                pass
    if not_ready:
        say(f"waiting for node(s) {', '.join(map(str, not_ready))} to be ready for the signal ...")
        deadline = time.monotonic() + wait_s
        while not_ready and time.monotonic() < deadline:
            time.sleep(POLL_S)
            launchers, not_ready = live_launchers(run_dir)
        if not_ready:
            raise StopRefused(
                f"run {run_dir}: node(s) {', '.join(map(str, not_ready))} still starting or"
                f" ending after {wait_s:.0f} s (no SIGTERM handler yet); try again in a moment"
            )
        if not launchers:
            raise StopRefused(
                f"run {run_dir} is {state().replace('_', ' ')}, not running: nothing to stop"
            )
    if not any(la.here for la in launchers):
        where = ", ".join(la.describe() for la in launchers)
        raise StopRefused(f"run {run_dir} runs on another host ({where}): run `mlaunch stop` there")
    since = min(la.started for la in launchers)
    return LocalStop(run_dir, launchers, read_stop_request(run_dir, since))


def signal_launchers(stop: LocalStop) -> list[NodeLauncher]:
    """SIGTERM to every launcher on this host (each forwards it to its torchrun: the workers
    finish the iteration and save, or, on a ``--now`` request, are killed); the ones signalled."""
    sent = []
    for la in stop.here:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: nothing to do
            os.kill(la.pid, signal.SIGTERM)
            sent.append(la)
    return sent


def wait_ended(stop: LocalStop, timeout_s: float) -> list[NodeLauncher]:
    """Wait until every launcher has ended, at most ``timeout_s``; the ones still running."""
    deadline = time.monotonic() + timeout_s
    left = list(stop.launchers)
    while left:
        left = [la for la in left if _alive(la, stop.run_dir)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return left
