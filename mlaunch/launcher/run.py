"""Running a :class:`~mlaunch.launcher.plan.LaunchPlan`: the side effects of ``mlaunch train``.

Creates the run directory and its files, starts torchrun in its own process group, follows the
trainer's progress records, forwards Ctrl-C/SIGTERM, and on failure finds which rank failed and
why. Still no torch import here: torchrun is a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from mlaunch import envcontract as ec
from mlaunch.launcher import jobtrace, orphan_guard, receiver_wiring, rendezvous, worker_output
from mlaunch.launcher.hang import Watchdog
from mlaunch.launcher.hang_report import HangReport
from mlaunch.launcher.plan import TORCHRUN_MODULE, LaunchPlan
from mlaunch.launcher.run_status import telemetry_off
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import Busy, take_lock, write_atomic
from mlaunch.rundir.records import (
    ProgressRecord,
    ProgressStep,
    StopRequest,
    read_progress_record,
    read_stop_request,
)
from mlaunch.rundir.worker_logs import launch_attempts

if TYPE_CHECKING:
    from mlaunch.receiver.core import ReceiverStats

#: Lines of a failed rank's log shown in the failure report.
LOG_TAIL_LINES = 15
#: How often the follower looks at the progress file and the torchrun process.
POLL_S = 0.2
#: How often at most the launcher's record is rewritten with the hang watchdog's state.
WATCHDOG_RECORD_S = 5.0


class Process(Protocol):
    """What the follower needs of the torchrun process (tests substitute a fake)."""

    pid: int

    def poll(self) -> int | None: ...


# --------------------------------------------------------------------------------------------
# The run directory


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` with ``mode`` from the file's creation (never briefly readable by
    others, as a chmod after writing would allow), atomically: nodes sharing a run directory
    may write the same file at once, and a reader never sees half of one."""
    write_atomic(path, text, mode=mode)


class RunDirBusy(Exception):
    """Another launcher (of this node rank) holds the run directory."""


def _lock_owner(path: Path) -> str:
    """Who holds the lock, as the holder wrote it (pid, host, run id, start time)."""
    try:
        with path.open("rb") as fh:
            info = json.loads(fh.read(4096).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another mlaunch train"
    return (
        f"mlaunch train pid {info.get('pid')} on host {info.get('host')}"
        f" (run id {info.get('run_id')}, started {info.get('started')})"
    )


def lock_run_dir(plan: LaunchPlan) -> int:
    """Take this node's exclusive lock on the run directory and return its file descriptor
    (held until this process exits: the kernel releases it on any death, so a crashed run never
    leaves a stale lock). Raises :class:`RunDirBusy` naming the holder when another launcher has
    it; then nothing in the directory has been touched but the (empty) lock file itself."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    path = lay.run_lock_file(plan.run_dir, plan.settings.launch.node_rank)
    try:
        fd = take_lock(path, blocking=False)  # O_CLOEXEC: torchrun and the workers do not hold it
    except Busy:
        raise RunDirBusy(
            f"{plan.run_dir} is in use by {_lock_owner(path)}; wait for it to end, or give this"
            " run another --run-dir"
        ) from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "run_id": plan.run_id,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return fd


def create_run_dir(plan: LaunchPlan, *, show_secrets: bool = False) -> None:
    """Create the run directory with ``resolved.env`` (0600), ``resolved.json`` and
    ``command.txt``. Several nodes may share one run directory: each writes the same files."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    (plan.run_dir / lay.TELEMETRY_DIR).mkdir(exist_ok=True)
    if ec.NCCL_DEBUG_INFO_PIPE_FILE in plan.child_env:  # torch makes its dump pipes in hang/
        lay.hang_dir(plan.run_dir).mkdir(exist_ok=True)
    _write_private(plan.run_dir / lay.RESOLVED_ENV_FILE, plan.resolved_env_text(show_secrets))
    _write_private(plan.run_dir / lay.RESOLVED_JSON_FILE, plan.resolved_json_text(show_secrets))
    _write_private(plan.run_dir / lay.COMMAND_FILE, plan.command_text(), 0o644)


def torchrun_log(plan: LaunchPlan) -> Path:
    """torchrun's own output (agent messages), kept out of the terminal."""
    return plan.log_dir / lay.TORCHRUN_LOG


def guarded(argv: list[str]) -> list[str]:
    """``python -m torch.distributed.run ...`` run through :mod:`mlaunch.launcher.orphan_guard`,
    so torchrun (and through it every worker) stops when this process dies, even by SIGKILL."""
    if argv[1:3] == ["-m", TORCHRUN_MODULE]:
        return [argv[0], "-m", orphan_guard.__name__, *argv[2:]]
    return argv


def spawn(argv: list[str], env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start torchrun in a new session, so its process group can be signalled as one and a
    terminal's Ctrl-C reaches the launcher first (which forwards it deliberately). Being in its own
    session, torchrun would outlive a killed launcher: the orphan guard ties it to this process."""
    env = {**env, ec.LAUNCHER_PID: str(os.getpid())}
    return subprocess.Popen(
        guarded(argv), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Progress records


class ProgressTail:
    """Reads complete new lines of ``progress.jsonl`` as the trainer appends them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Records of an earlier run in the same directory (a resume) are not this run's.
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def read(self) -> list[ProgressRecord]:
        """New records since the last call (a half-written last line waits for the next; a
        line that is no record is skipped)."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            record = read_progress_record(line)
            if record is not None:
                out.append(record)
        return out


# --------------------------------------------------------------------------------------------
# Failures


@dataclass
class RankFailure:
    """One failed worker, as far as its error files and logs tell."""

    rank: int | None
    local_rank: int | None
    node: int | None
    exc_type: str
    message: str
    log_path: Path | None = None
    log_tail: list[str] = field(default_factory=list)


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return lines[-n:]


def _read_from(path: Path, offset: int) -> str:
    """``path``'s text after ``offset`` (this launch's part of an appended log)."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _local_rank_dirs(plan: LaunchPlan, since: float) -> dict[int, Path]:
    """This node's per-local-rank log folders of the latest torchrun attempt of this launch."""
    attempts = launch_attempts(plan.log_dir, since)
    if not attempts:
        return {}
    latest, _ = attempts[max(attempts)]
    return {int(p.name): p for p in latest.iterdir() if p.is_dir() and p.name.isdigit()}


def _rank_log(folder: Path | None) -> tuple[Path | None, list[str]]:
    if folder is None:
        return None, []
    for name in ("stderr.log", "stdout.log"):
        tail = _tail(folder / name)
        if tail:
            return folder / name, tail
    return folder / "stderr.log", []


def _torchelastic_error(path: Path) -> tuple[str, str]:
    """(type, message) from a torchelastic ``error.json`` written by ``@record``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "error", "unreadable error file"
    msg = data.get("message", data)
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    text = str(msg).strip()
    exc_type, sep, rest = text.partition(": ")
    return (exc_type, rest) if sep and " " not in exc_type else ("error", text)


#: Worker exit codes that an interrupted run's forwarded signal explains (killed by SIGTERM,
#: SIGINT or SIGKILL, or exiting with the shell's 128 + signal for them).
INTERRUPT_EXITS = frozenset(
    code
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
    for code in (-int(sig), 128 + int(sig))
)
_WORKER_EXIT = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
)


def worker_exits(torchrun_text: str) -> list[tuple[int, int, int]]:
    """(rank, local rank, exit code) of each failed worker in torchrun's failure report (its
    ``ChildFailedError`` dump), the root cause first, each rank once."""
    found: dict[int, tuple[int, int, int]] = {}
    root, _, rest = torchrun_text.rpartition("Root Cause")
    for part in (rest, root) if root else (torchrun_text,):
        for m in _WORKER_EXIT.finditer(part):
            rank, local, code = map(int, m.groups())
            found.setdefault(rank, (rank, local, code))
    return list(found.values())


def _exit_text(code: int) -> str:
    """``exit code 3`` / ``killed by SIGSEGV`` for a worker's exit code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def collect_failures(
    plan: LaunchPlan, since: float, torchrun_text: str = "", interrupted: int | None = None
) -> list[RankFailure]:
    """Which ranks failed and why: the trainer's ``error-rank{R}.json`` first (it knows the
    global rank), then torchelastic's per-local-rank error files, then the workers torchrun
    reports as exited non-zero (``torchrun_text``: this launch's part of its log), each with its
    own stderr tail. Only files written since ``since`` (this launch) count; with
    ``interrupted``, workers stopped by the forwarded signal are not failures."""
    nproc = plan.settings.launch.nproc_per_node
    local_dirs = _local_rank_dirs(plan, since)
    failures: list[RankFailure] = []
    seen_local: set[int] = set()
    for path in sorted(plan.run_dir.glob(lay.ERROR_FILE.glob)):
        try:
            if path.stat().st_mtime < since - 1:
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        rank = int(data.get("rank", lay.ERROR_FILE.parse(path.name) or 0))
        local = rank % nproc
        folder = local_dirs.get(local)
        here = folder is not None and (folder / lay.TORCHELASTIC_ERROR_FILE).exists()
        log_path, tail = _rank_log(folder if here else None)
        if here:
            seen_local.add(local)
        failures.append(
            RankFailure(
                rank, local, rank // nproc, str(data.get("exception_type") or data.get("type") or "error"),
                str(data.get("message", "")), log_path, tail,
            )
        )  # fmt: skip
    for local, folder in sorted(local_dirs.items()):
        if local in seen_local or not (folder / lay.TORCHELASTIC_ERROR_FILE).exists():
            continue
        exc_type, message = _torchelastic_error(folder / lay.TORCHELASTIC_ERROR_FILE)
        log_path, tail = _rank_log(folder)
        rank = (
            plan.settings.launch.node_rank * nproc + local
            if plan.settings.launch.nnodes == 1
            else None
        )
        node = plan.settings.launch.node_rank if plan.settings.launch.nnodes == 1 else None
        failures.append(RankFailure(rank, local, node, exc_type, message, log_path, tail))
    if not failures:
        # No error file (a script without @record, a segfault, an argparse exit): the worker
        # exits torchrun itself reports. Never a traceback merely printed to a log: a handled
        # one is not a failure, and an interrupted run must not be reported as a crash.
        for rank, local, code in worker_exits(torchrun_text):
            if interrupted is not None and code in INTERRUPT_EXITS:
                continue  # the forwarded signal's doing, not a failure
            folder = local_dirs.get(local)
            log_path, tail = _rank_log(folder)
            if folder is not None:
                log_path, tail = folder / "stderr.log", _tail(folder / "stderr.log")
            # An exit code's reason is usually the last line (argparse's "error: ..."); a signal
            # leaves no message of its own.
            message = (
                next((line.strip() for line in reversed(tail) if line.strip()), "(no output)")
                if code >= 0
                else ""
            )
            node = (
                rank // nproc if plan.settings.launch.nnodes > 1 else plan.settings.launch.node_rank
            )
            failures.append(
                RankFailure(rank, local, node, _exit_text(code), message, log_path, tail)
            )
    return failures


# --------------------------------------------------------------------------------------------
# Restarts and the launcher's record


@dataclass
class Restart:
    """torchrun restarted the worker group: attempt ``attempt - 1`` ended and ``attempt`` began."""

    attempt: int
    cause: str
    """What ended the attempt before: ``rank 1 killed by SIGKILL``, as torchrun's agent logged."""
    rank: int | None
    time: float
    """When torchrun made the attempt's log folder (before its workers started)."""


class RestartWatch:
    """torchrun's restarts as they happen, whatever the telemetry settings: each new
    ``<log-dir>/<id>/attempt_<N>/`` folder of this launch, with the failure torchrun's agent
    logged for the group before it (the lines the job trace reads too)."""

    def __init__(self, plan: LaunchPlan, since: float, log_offset: int) -> None:
        self.plan = plan
        self.since = since
        self.offset = log_offset
        self.attempt = 0
        self._cause: tuple[str, int | None] | None = None

    def poll(self) -> list[Restart]:
        """The restarts since the last call (none while the first attempt runs)."""
        path = torchrun_log(self.plan)
        # The folders first: torchrun logs a group's failure before it makes the next folder,
        # so every failure behind a folder seen now is in the lines read after it.
        folders = {
            n: made for n, (_, made) in launch_attempts(self.plan.log_dir, self.since).items()
        }
        text = _read_from(path, self.offset)
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for m in jobtrace.FAILED_LINE.finditer(complete):
            code, local = int(m.group(1)), int(m.group(2))
            one_node = self.plan.settings.launch.nnodes == 1
            rank = local if one_node else None
            who = f"rank {local}" if one_node else f"local rank {local} of this node"
            self._cause = (
                f"{who} {_exit_text(code).replace('exit code', 'exited with code')}",
                rank,
            )
        out = []
        for n in sorted(folders):
            if n <= self.attempt:
                continue
            cause, rank = self._cause or (
                "the worker group was restarted (another node's failed)",
                None,
            )
            out.append(Restart(n, cause, rank, folders[n]))
            self.attempt, self._cause = n, None
        return out


class LauncherRecord:
    """This node's :func:`~mlaunch.lay.launcher_record_file`: written when the launch
    starts, at each restart and when it ends (atomically: a reader never sees half). A launcher
    killed by SIGKILL leaves it without ``ended``, its pid gone: ``mlaunch status`` tells that
    from a run that is still going. Writing it never stops a launch."""

    def __init__(self, plan: LaunchPlan, started: float) -> None:
        self.path = lay.launcher_record_file(plan.run_dir, plan.settings.launch.node_rank)
        self.data: dict[str, Any] = {
            "pid": os.getpid(), "host": socket.gethostname(), "run_id": plan.run_id,
            "node": plan.settings.launch.node_rank, "started": started, "attempt": 0,
            "restarts": [], "ended": None, "exit_code": None, "signal": None, "failures": [],
        }  # fmt: skip
        self._watch_written = float("-inf")
        self._write()

    def restarted(self, restart: Restart) -> None:
        """Attempt ``restart.attempt`` began."""
        self.data["attempt"] = restart.attempt
        self.data["restarts"].append(
            {"attempt": restart.attempt, "rank": restart.rank, "cause": restart.cause,
             "time": restart.time}
        )  # fmt: skip
        self._write()

    def watching(self, state: dict[str, Any], *, now: bool = False) -> None:
        """The hang watchdog's state (:meth:`~mlaunch.launcher.hang.Watchdog.state`), written
        when it changed, at most every :data:`WATCHDOG_RECORD_S` (``now``: at once)."""
        t = time.monotonic()
        if state == self.data.get("watchdog"):
            return
        if not now and t - self._watch_written < WATCHDOG_RECORD_S:
            return
        self._watch_written = t
        self.data["watchdog"] = state
        self._write()

    def hung(self, report: HangReport) -> None:
        """The hang watchdog declared attempt ``report.attempt`` hung."""
        self.data.setdefault("hangs", []).append(
            {"attempt": report.attempt, "detected_at": report.detected_at,
             "verdict": report.verdict, "action": report.action}
        )  # fmt: skip
        self._write()

    def ended(
        self, exit_code: int | None, interrupted: int | None, failures: list[RankFailure],
        error: str | None = None, hang: str | None = None, rendezvous: str | None = None,
    ) -> None:  # fmt: skip
        """The launch is over (``error``: the launcher itself stopped on an exception; ``hang``:
        the verdict of the hang that ended it; ``rendezvous``: why torchrun's rendezvous
        failed)."""
        self.data.update(
            ended=time.time(), exit_code=exit_code, error=error, hang=hang, rendezvous=rendezvous,
            signal=jobtrace.signal_name(interrupted) if interrupted is not None else None,
            failures=[
                {"rank": f.rank, "local_rank": f.local_rank, "node": f.node,
                 "exception_type": f.exc_type, "message": f.message,
                 "log": str(f.log_path) if f.log_path else None}
                for f in failures
            ],
        )  # fmt: skip
        self._write()

    def _write(self) -> None:
        with contextlib.suppress(OSError):
            _write_private(self.path, json.dumps(self.data, indent=1) + "\n", 0o644)


# --------------------------------------------------------------------------------------------
# Running


@dataclass
class RunResult:
    """How a launch ended."""

    exit_code: int
    wall_s: float
    records: list[ProgressRecord]
    """Every progress record this launch saw (training and eval)."""
    interrupted: int | None = None
    """The signal forwarded to the job, if any."""
    failures: list[RankFailure] = field(default_factory=list)
    torchrun_tail: list[str] = field(default_factory=list)
    receiver: ReceiverStats | None = None
    """The embedded OTLP receiver's counts, when this launch hosted one."""
    started: float = 0.0
    """When the launch started (``time.time()``): files older than this are an earlier run's."""
    span_counts: dict[str, int] | None = None
    """Where the workers' spans went, summed over the ranks that wrote counts (emitted,
    delivered, spooled, dropped, ranks; :func:`read_span_counts`), or None when none did."""
    trace_files: list[Path] = field(default_factory=list)
    """The run directory's trace files: the workers' (``traces-rank{R}.jsonl``, the file
    exporter's or the embedded receiver's) and the launchers' job traces
    (``traces-launcher-node{N}.jsonl``)."""
    rendezvous_failure: str | None = None
    """Why torchrun's rendezvous failed (:func:`~mlaunch.launcher.rendezvous.failure_cause`), when
    torchrun gave up with no worker failed."""
    hang: HangReport | None = None
    """The hang that ended the final attempt (``--on-hang stop``), or None."""
    hangs: list[HangReport] = field(default_factory=list)
    """Every hang the watchdog reported during the launch."""
    telemetry_off: dict[int, str] = field(default_factory=dict)
    """This node's ranks whose telemetry is off although it was asked for, and why (their
    progress beats: :func:`~mlaunch.launcher.run_status.telemetry_off`)."""

    @property
    def train_records(self) -> list[ProgressStep]:
        """The training records (not evaluation ones)."""
        return [r for r in self.records if isinstance(r, ProgressStep)]


class Display(Protocol):
    """What the follower reports progress to (a Rich bar, plain lines, or nothing)."""

    def record(self, record: ProgressRecord) -> None: ...

    def interrupted(
        self, signum: int, forced: bool = False, by: StopRequest | None = None
    ) -> None: ...

    def restarted(self, restart: Restart, max_restarts: int) -> None: ...

    def hang(self, report: HangReport) -> None: ...

    def telemetry_off(self, rank: int, reason: str) -> None: ...

    def worker_output(self, text: str) -> None: ...


#: Signals the launcher passes on as the graceful SIGTERM: Ctrl-C, SIGTERM, and SIGUSR1 (SLURM's
#: warning before the time limit, ``scancel --signal=USR1``), which would otherwise kill it.
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _ignore_usr1_in_children() -> None:
    """SLURM delivers a step's signals to every process of the step, torchrun's agent included,
    which has no SIGUSR1 handler and would die of it (its workers then killed mid-save). An
    ignored signal stays ignored across exec: set here, before torchrun is spawned, it is
    inherited by torchrun and its workers; a worker that wants it installs its own handler (the
    trainer does under SLURM), and the launcher handles it in :func:`_forwarding`."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from ``/proc``; empty where there is none): torchrun
    starts each worker in a session of its own, out of reach of a signal to torchrun's group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def force_kill(pid: int) -> None:
    """SIGKILL torchrun's process group and every worker's (each in its own session)."""
    for child in _descendants(pid):
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def _forwarding(
    proc: Process, on_signal: Callable[[int, bool], None], now: Callable[[], bool] = lambda: False
) -> Iterator[list[int]]:
    """While inside, :data:`FORWARDED_SIGNALS` go to torchrun's process group as SIGTERM: torchrun
    passes it to the workers, which finish the iteration, save and flush telemetry. (SIGINT
    would interrupt a worker mid-step; SIGTERM is the graceful path the trainer implements.)
    A second Ctrl-C forces the stop (SIGKILL to torchrun and every worker): a worker that ignores
    SIGTERM would otherwise hold the launcher for torchrun's whole grace period. Only Ctrl-C
    forces, and ``now()`` (``mlaunch stop --now`` asked it: its request in the run directory):
    SLURM's SIGUSR1 then SIGTERM at the time limit must stay graceful."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, _frame: Any) -> None:
        forced = (signum == signal.SIGINT and signal.SIGINT in received) or now()
        received.append(signum)
        if forced:
            force_kill(proc.pid)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        on_signal(signum, forced)

    previous = {s: signal.signal(s, handler) for s in FORWARDED_SIGNALS}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def execute(
    plan: LaunchPlan,
    started: Callable[[], Display],
    *,
    show_secrets: bool = False,
    spawn_fn: Callable[..., Process] | None = None,
) -> RunResult:
    """Create the run directory, start torchrun, follow it to the end and collect failures.

    ``started`` is called right after torchrun is spawned and returns the display to report
    to: whatever it prints (the summary) overlaps the workers' start-up instead of delaying it.
    """
    # The lock first: a second launch on a busy directory stops here, before writing anything.
    lock = lock_run_dir(plan)
    try:
        return _execute_locked(plan, started, show_secrets=show_secrets, spawn_fn=spawn_fn)
    finally:
        os.close(lock)


def _execute_locked(
    plan: LaunchPlan,
    started: Callable[[], Display],
    *,
    show_secrets: bool,
    spawn_fn: Callable[..., Process] | None,
) -> RunResult:
    """:func:`execute` once the run directory is this launcher's."""
    _ignore_usr1_in_children()
    create_run_dir(plan, show_secrets=show_secrets)
    tail = ProgressTail(plan.progress_file)
    start = time.time()
    records: list[ProgressRecord] = []
    spawn_fn = spawn_fn or spawn
    # The embedded OTLP receiver / relay (None when the plan does not call for one). Started
    # before torchrun so the workers' environment can point at it; closed (flushed, spooled,
    # counts written) on every way out of here, within the telemetry shutdown deadline.
    receiver, child_env = receiver_wiring.start(plan)
    # The launcher's own job trace (mlaunch.job + one span per torchrun attempt; no-op when off).
    # With the relay it goes upstream through the receiver (spooled like a worker's spans).
    job = jobtrace.start(plan, sinks=jobtrace.relay_sinks(plan, receiver))
    argv, env = job.wrap(plan.argv, child_env)
    log_path = torchrun_log(plan)
    log_offset = log_path.stat().st_size if log_path.exists() else 0  # earlier launches' part
    restarts = RestartWatch(plan, start, log_offset)
    launch_record = LauncherRecord(plan, start)
    watchdog = Watchdog(plan, start, receiver, nccl_env=ec.NCCL_DEBUG_INFO_PIPE_FILE in child_env)
    stopped_hung = False  # the current attempt was stopped by the watchdog
    beats = _TelemetryOff(plan, start)
    received: list[int] = []  # the forwarded signals (rebound to the handler's list below)
    try:
        with log_path.open("ab") as log, job.guard():
            proc = spawn_fn(argv, env, log)
            job.spawned()
            # The handler only forwards and notes the signal; the loop below says so. Printing
            # from the handler could re-enter a write the loop was in (the display's file: a
            # RuntimeError "reentrant call" that killed a node's launcher on SIGTERM), and a
            # signal may arrive before the display exists.
            pending: list[tuple[int, bool]] = []

            def notify(signum: int, forced: bool) -> None:
                pending.append((signum, forced))

            def announce(display: Display) -> None:
                while pending:
                    signum, forced = pending.pop(0)
                    job.interrupted(signum)
                    # Said with who asked when `mlaunch stop` sent it (its request came first).
                    by = read_stop_request(plan.run_dir, start) if signum != signal.SIGINT else None
                    display.interrupted(signum, forced, by)

            def stop_now() -> bool:  # `mlaunch stop --now` wrote its request before the signal
                req = read_stop_request(plan.run_dir, start)
                return req is not None and req.now

            # The workers' output (--tee): drained when the loop ends, before the result.
            with _forwarding(proc, notify, stop_now) as received, contextlib.ExitStack() as tee:
                display = started()
                tee.enter_context(worker_output.follow(plan, start, display.worker_output))
                while True:
                    announce(display)
                    code = proc.poll()
                    for record in tail.read():
                        records.append(record)
                        display.record(record)
                        watchdog.record(record)
                    for rank, reason in beats.poll(final=code is not None):
                        display.telemetry_off(rank, reason)
                    if code is not None:
                        announce(display)  # a signal of the last moment is said too
                        break
                    job.poll()
                    for restart in restarts.poll():  # announced while the run goes on
                        if stopped_hung:  # the exits torchrun saw were the watchdog's stop
                            restart.cause = "the hang watchdog stopped the hung workers"
                            restart.rank = None
                        launch_record.restarted(restart)
                        display.restarted(restart, plan.settings.launch.max_restarts)
                        watchdog.attempt_started(restart.attempt, restart.time)
                        stopped_hung = False
                    hang = watchdog.check(proc.pid) if not received else None
                    if watchdog.enabled:
                        launch_record.watching(watchdog.state())
                    if hang is not None:
                        job.hung()
                        launch_record.hung(hang)
                        display.hang(hang)
                        if hang.action == "stop":
                            watchdog.stop(proc.pid)  # settles with the other nodes first
                            stopped_hung = True
                        else:
                            watchdog.settle()
                    time.sleep(POLL_S)
        result = RunResult(
            code, time.time() - start, records, received[0] if received else None, started=start
        )
        result.hangs = watchdog.reports
        result.telemetry_off = beats.seen
        if code != 0 and stopped_hung and watchdog.reports:
            # The workers' exits are the watchdog's doing: the hang is what failed.
            result.hang = watchdog.reports[-1]
            result.torchrun_tail = _tail(torchrun_log(plan))
        elif code != 0:
            text = _read_from(log_path, log_offset)
            result.failures = collect_failures(plan, start, text, result.interrupted)
            result.torchrun_tail = _tail(torchrun_log(plan))
            if not result.failures and result.interrupted is None:
                # No worker failed: torchrun itself gave up, most often at the rendezvous, whose
                # cause is chained deep in a traceback of its log.
                result.rendezvous_failure = rendezvous.failure_cause(text)
            if result.interrupted is not None and not result.failures:
                # torchrun reports its own signal as a failure (exit 1) even when every worker
                # stopped cleanly; the job was interrupted, which shells spell 128 + signal.
                result.exit_code = 128 + result.interrupted
        for restart in restarts.poll():  # one the loop had no time to see
            launch_record.restarted(restart)
        if watchdog.enabled:
            launch_record.watching(watchdog.state(), now=True)
        launch_record.ended(
            result.exit_code, result.interrupted, result.failures,
            hang=result.hang.verdict if result.hang else None,
            rendezvous=result.rendezvous_failure,
        )  # fmt: skip
        # Before the receiver closes: in relay mode the job's last spans go through it.
        job.finish(result.exit_code, result.failures, result.interrupted)
    except BaseException as exc:
        if launch_record.data["ended"] is None:
            launch_record.ended(None, received[0] if received else None, [], type(exc).__name__)
        raise
    finally:
        receiver_stats = (
            receiver.close(plan.settings.telemetry.shutdown_timeout_s) if receiver else None
        )
    result.receiver = receiver_stats
    result.span_counts = read_span_counts(plan, start)
    # The launcher's job trace is a trace like the workers' (every `mlaunch trace` command reads
    # it): counted with them, so a run whose workers exported nothing still shows its one file.
    telemetry = plan.run_dir / lay.TELEMETRY_DIR
    result.trace_files = sorted(
        [*telemetry.glob(lay.TRACES_FILE_GLOB), *telemetry.glob(lay.LAUNCHER_TRACES_FILE_GLOB)]
    )
    # The workers have exited: the store costs training nothing now. An interrupted launch
    # (Ctrl-C, SLURM's SIGTERM) is on its way out and leaves it to the first read, as does a
    # small trace (its first read builds it in under a second). One node writes it (see
    # mlaunch.launcher.receiver_wiring).
    if (
        result.interrupted is None
        and plan.settings.launch.node_rank == 0
        and _store_due(result.trace_files)
    ):
        finish_store(plan.run_dir)
    return result


class _TelemetryOff:
    """This node's ranks whose telemetry setup failed, as their progress beats say: read at most
    once a second while the run goes on, and once more when torchrun has exited (a short run's
    workers may be gone before the first look)."""

    def __init__(self, plan: LaunchPlan, started: float) -> None:
        launch = plan.settings.launch
        first = launch.node_rank * launch.nproc_per_node
        self.ranks = range(first, first + launch.nproc_per_node)
        self.run_dir, self.started = plan.run_dir, started
        self.seen: dict[int, str] = {}
        self._next = 0.0

    def poll(self, final: bool = False) -> list[tuple[int, str]]:
        """The ranks newly found with their telemetry off, and why."""
        now = time.time()
        if not final and now < self._next:
            return []
        self._next = now + 1.0
        new = []
        for rank, reason in telemetry_off(self.run_dir, self.started, self.ranks).items():
            if rank not in self.seen:
                self.seen[rank] = reason
                new.append((rank, reason))
        return new


def _store_due(trace_files: list[Path]) -> bool:
    """The run's JSON is big enough for its store to be written at its end (the receiver's first
    append's floor; the test hook MLAUNCH_TEST_STORE_MIN_BYTES lowers it for a tiny run)."""
    from mlaunch.receiver.store_append import MIN_APPEND_BYTES

    if not trace_files:
        return False
    floor = int(os.environ.get("MLAUNCH_TEST_STORE_MIN_BYTES", MIN_APPEND_BYTES))
    size = 0
    for f in trace_files:
        with contextlib.suppress(OSError):
            size += f.stat().st_size
    return size >= floor


#: How long the end of a run waits for its span store (built from the workers' JSON, or the
#: receiver's last tail appended); past it the build goes on in the background and a read of
#: the run waits for it (the store's lock) instead of building it again.
STORE_WAIT_S = 60.0


def finish_store(run_dir: Path, wait_s: float = STORE_WAIT_S) -> None:
    """Build the run's columnar span store (or append what it lacks) from its OTLP-JSON, in a
    process of its own, waiting at most ``wait_s``. Never raises and never changes the run's
    outcome: a failure is one line on stderr, and the JSON, complete, stays where it is."""
    import sys

    from mlaunch.trace.store import spawn_update

    later = "`mlaunch trace` builds it from the OTLP-JSON on the first read"
    try:
        proc = spawn_update(run_dir)
    except OSError as exc:
        print(f"mlaunch: span store not written ({exc}); {later}", file=sys.stderr)
        return
    try:
        _, err = proc.communicate(timeout=wait_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        # Past the wait, or Ctrl-C while waiting: the job is over either way, and the store's
        # process (a session of its own) finishes without the launcher.
        print(f"mlaunch: the span store is still being written, in the background ({run_dir})",
              file=sys.stderr)  # fmt: skip
        return
    if proc.returncode:
        lines = (err or "").strip().splitlines()
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        print(f"mlaunch: span store not written ({why}); {later}", file=sys.stderr)


def read_span_counts(plan: LaunchPlan, since: float) -> dict[str, int] | None:
    """The sum of this launch's ``span-counts-rank{R}.json`` (each exporting rank's telemetry
    runtime writes one at shutdown; files older than ``since`` are an earlier launch's), or None
    when no rank wrote one."""
    total = {"emitted": 0, "delivered": 0, "spooled": 0, "dropped": 0, "ranks": 0}
    for rank in range(plan.settings.world_size):
        path = lay.span_counts_file(plan.run_dir, rank)
        try:
            if path.stat().st_mtime < since - 1:
                continue  # an earlier launch's
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for key in ("emitted", "delivered", "spooled", "dropped"):
            value = data.get(key)
            total[key] += value if isinstance(value, int) else 0
        total["ranks"] += 1
    return total if total["ranks"] else None
