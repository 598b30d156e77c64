"""A run's state from its run directory: the half of ``mlaunch status`` that needs no SLURM.

The run directory says how far training got (``progress.jsonl``), what each node last logged,
which rank failed and why (``error-rank*.json``), and, outside SLURM, how the newest launch ended
(its launcher's record and job trace). :mod:`mlaunch.slurm.status` adds what SLURM says and
decides the job's state from both; it sits above the launcher, so this half never asks SLURM.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.model.spans import Attr, SpanName
from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import (
    LauncherAttempts,
    StopRequest,
    read_heartbeats,
    read_json_object,
    read_last_progress_step,
    read_launcher_record,
    read_stop_request,
)
from mlaunch.rundir.state import RunState

_JOB, _ATTEMPT = SpanName.JOB.value, SpanName.JOB_ATTEMPT.value

#: The states in which workers may still be there to answer (anything else is the run's end:
#: completed, failed, preempted, interrupted, stopped (by ``mlaunch stop``), cancelled, launcher
#: died). ``unknown``: a run directory with neither a launcher record nor SLURM to say (a worker
#: started another way).
LIVE_STATES = frozenset({"running", "queued", "suspended", "unknown"})


@dataclass
class Failure:
    """One failed rank, as its ``error-rank{R}.json`` says."""

    rank: int
    node: int | None
    exception_type: str
    message: str
    iteration: int | None
    time: float | None
    log: str | None


@dataclass
class NodeView:
    """What one node last wrote."""

    node: int
    log: str | None
    last_line: str | None


@dataclass
class RestartView:
    """One restart of the worker group by torchrun: attempt ``attempt`` began after ``cause``."""

    attempt: int
    rank: int | None
    cause: str
    time: float | None


@dataclass
class LauncherView:
    """What the launcher's record (``launcher-node0.json``) says of the newest launch."""

    pid: int | None
    host: str | None
    started: float | None
    ended: float | None
    exit_code: int | None
    signal: str | None
    alive: bool | None
    """Whether its process still runs (None: ended, or on another host: not checked)."""


@dataclass
class JobStatus:
    """Everything ``mlaunch status`` shows."""

    job_id: str | None
    state: str
    run_dir: str | None
    slurm: dict[str, Any] | None = None
    trainjob: dict[str, Any] | None = None
    """A Kubernetes TrainJob's side (``mlaunch status trainjob/NAME``): ``name``, ``namespace``,
    ``run_id``, ``reason``, ``conditions``, ``pods`` (:mod:`mlaunch.kube.jobs`); else None."""
    incarnation: int | None = None
    """1 for the first run of the job, 2 after one requeue, ..."""
    progress: dict[str, Any] | None = None
    nodes: list[NodeView] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    """This incarnation's failed ranks, the first to fail first."""
    output: str | None = None
    note: str | None = None
    launcher: LauncherView | None = None
    """The newest launch in the run directory, from its launcher's record (None: none there)."""
    attempt: int | None = None
    """torchrun's attempt the launch is in or ended in (0, then one more per restart)."""
    restarts: list[RestartView] = field(default_factory=list)
    failed_rank: int | None = None
    """With ``failed``: the rank that failed the final attempt (first to fail), when known."""
    cause: str | None = None
    """With ``failed``: why (its exception, or how it exited)."""
    watchdog: dict[str, Any] | None = None
    """Node 0's hang watchdog as its launcher last wrote it (``setting``, ``timeout_s``: the bound
    in force, ``last_progress``: epoch seconds, ``starting``, ``source``, ``attempt``); None
    without a record or with the watchdog off."""
    hang: dict[str, Any] | None = None
    """The newest hang the launchers' watchdogs reported for this launch (every node's ranks
    merged): ``detected_at``, ``verdict``, ``ranks`` (rank, span, iteration, frame), ``attempt``,
    ``action``, ``report``; None when none hung."""
    telemetry_off: list[dict[str, Any]] = field(default_factory=list)
    """Ranks of this launch whose telemetry is off although it was asked for (``rank``,
    ``reason``: e.g. its setup failed), as their progress beats say (:func:`telemetry_off`)."""
    captures: list[dict[str, Any]] = field(default_factory=list)
    """This launch's capture requests, each with its phase in the capture's life (``id``,
    ``phase``, ``groups``, ``iterations``, ``ranks``: :class:`mlaunch.rundir.state.CaptureState`)."""
    dumps: list[dict[str, Any]] = field(default_factory=list)
    """This launch's flight-recorder dumps (``rank``, ``seq``, ``trigger``, ``time_ns``,
    ``spans``, ``iterations``), oldest first."""
    stop: dict[str, Any] | None = None
    """The user's request to stop this launch (``mlaunch stop``: ``requested_at``, ``now``,
    ``uid``, ``user``, ``host``, ``pid``, ``job_id``), while it stops and once it has; None when
    none was made."""
    resume_from: int | None = None
    """With ``stopped``: the iteration of the newest committed checkpoint, from which a resume
    continues (the one the stop saved, or with ``--now`` an older one); None: not resumable."""
    run: RunState | None = field(default=None, repr=False, compare=False)
    """The run model every view reads (:meth:`attach_run_state`); not part of the JSON."""

    @property
    def resumable(self) -> bool:
        """Whether a resume carries the run on from a checkpoint: its workers stopped on a
        signal and saved (``preempted``), or the user stopped it and a checkpoint is there
        (``stopped``). ``mlaunch status``, ``mlaunch runs`` and train's closing lines say how."""
        return self.state == "preempted" or (
            self.state == "stopped" and self.resume_from is not None
        )

    @property
    def live(self) -> bool:
        """Whether workers may still be there (:data:`LIVE_STATES`)."""
        return self.state in LIVE_STATES

    def attach_run_state(self, since: float | None) -> None:
        """Read the run model of ``run_dir`` for this state (ended unless :attr:`live`) and
        fill :attr:`captures` and :attr:`dumps` from it: every view shows the same phases."""
        if self.run_dir is None:
            return
        self.run = RunState.read(self.run_dir, ended=not self.live, since=since)
        model = self.run.as_json()
        self.captures, self.dumps = model["captures"], model["dumps"]

    def as_json(self) -> dict[str, Any]:
        """The status as a JSON object."""
        run, self.run = self.run, None
        try:
            out = asdict(self)
        finally:
            self.run = run
        out.pop("run", None)
        return out


# --------------------------------------------------------------------------------------------
# The run directory


#: How far back a node's last line is looked for: a worker whose console exporter writes its
#: telemetry to stdout can write many kilobytes of records between two lines of its own.
_LAST_LINE_WINDOWS = (8192, 256 * 1024, 4 * 1024 * 1024)


def _last_line(path: Path) -> str | None:
    """The last line a worker wrote that is not a record of a console telemetry exporter (None
    when there is none in the log's last few MiB)."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            for window in _LAST_LINE_WINDOWS:
                start = max(0, size - window)
                fh.seek(start)
                lines = fh.read().decode(errors="replace").splitlines()
                if start > 0 and lines:
                    lines = lines[1:]  # the window may begin inside a line
                found = next(_output_lines(reversed(lines)), None)
                if found is not None or start == 0:
                    return found
    except OSError:
        return None
    return None


#: How the SDK's ``to_json`` begins a span, a metrics batch and a log record.
_CONSOLE_RECORD_STARTS = ('{"name": ', '{"resource_metrics": ', '{"body": ')


def _is_console_record(line: str) -> bool:
    """A console exporter's record written on one line (nemo-lens 0.2.0's compact JSONL)."""
    if not (line.startswith(_CONSOLE_RECORD_STARTS) and line.endswith("}")):
        return False
    return not line.startswith('{"name": ') or '"context": {"trace_id": "0x' in line


def _output_lines(newest_first: Iterable[str]) -> Iterator[str]:
    """The non-empty lines, newest first, that are not the OpenTelemetry SDK console exporter's
    records a ``--otel-exporter console`` worker writes to stdout: nemo-lens 0.1.0 writes each
    as an indented JSON block (``{`` and ``}`` alone at the line start), 0.2.0 as one compact
    JSON line. Either would otherwise be a worker's "last line"."""
    in_block = False
    for raw in newest_first:
        line = raw.rstrip()
        if in_block:
            in_block = line != "{"
            continue
        if line == "}":  # the end of a 0.1.0 record: skip back to its opening brace
            in_block = True
            continue
        if _is_console_record(line):  # a 0.2.0 record
            continue
        if line.strip():
            yield line.strip()


def _newest(paths: list[Path]) -> Path | None:
    dated = []
    for p in paths:
        try:
            dated.append((p.stat().st_mtime, p))
        except OSError:
            continue
    return max(dated)[1] if dated else None


def _nproc(run_dir: Path) -> int | None:
    try:
        data = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
        return int(data["settings"]["launch.nproc_per_node"]["value"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _rank_log(
    run_dir: Path, rank: int, local: int | None, message: str, since: float | None
) -> tuple[int | None, Path | None]:
    """(node, log) of a failed rank. torchrun's c10d rendezvous numbers the nodes in the order
    of (host name, pid), not SLURM's, so ``rank // nproc`` need not be the ``logs/node<N>`` it
    ran under: the log is the one of that local rank, in any node's folder, that names the rank
    (``[rank<R>]:``) or holds its error message."""
    if local is None:
        return None, None
    marks = [f"[rank{rank}]", message[:80]] if message else [f"[rank{rank}]"]
    for path in (run_dir / lay.LOGS_DIR).glob(
        f"{lay.NODE_LOG_DIR.glob}/*/attempt_*/{local}/std*.log"
    ):
        try:
            if since is not None and path.stat().st_mtime < since - 1:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")[-200_000:]
        except OSError:
            continue
        if any(m and m in text for m in marks):
            return lay.NODE_LOG_DIR.parse(path.relative_to(run_dir / lay.LOGS_DIR).parts[0]), path
    return None, None


def node_views(run_dir: Path, since: float | None = None) -> list[NodeView]:
    """Each node's most recently written worker log (or its launcher's progress view, or
    torchrun's log) since ``since`` (this incarnation's start), and its last line."""
    views = []
    for folder in sorted((run_dir / lay.LOGS_DIR).glob(lay.NODE_LOG_DIR.glob)):
        number = lay.NODE_LOG_DIR.parse(folder.name)
        if number is None:
            continue
        # A worker's log, or (nodes other than 0) the launcher's progress view, whichever is newer.
        # Node 0's progress view is the job's output (the other nodes write only a pointer there).
        first = folder.name == lay.NODE_LOG_DIR.name(0)
        outputs = sorted(run_dir.glob(lay.SLURM_OUTPUT_GLOB)) if first else []
        logs = [*folder.glob("*/attempt_*/*/std*.log"), folder / lay.LAUNCHER_LOG, *outputs]
        logs = [p for p in logs if p.is_file() and p.stat().st_size > 0]
        if since is not None:
            logs = [p for p in logs if p.stat().st_mtime >= since - 1]
        newest = _newest(logs)
        views.append(
            NodeView(
                number, str(newest) if newest else None, _last_line(newest) if newest else None
            )
        )
    return sorted(views, key=lambda v: v.node)


def failures(
    run_dir: Path, since: float | None = None, slack_s: float = 1.0, *, locate: bool = True
) -> list[Failure]:
    """The failed ranks (``error-rank*.json`` written since ``since``, less ``slack_s`` for a
    coarse file clock), the first to fail first. ``locate`` False: without looking for each
    one's node and log in the workers' logs (a listing needs only that they failed)."""
    nproc = _nproc(run_dir) if locate else None
    out = []
    for path in run_dir.glob(lay.ERROR_FILE.glob):
        try:
            if since is not None and path.stat().st_mtime < since - slack_s:
                continue  # an earlier incarnation's
            data = json.loads(path.read_text(encoding="utf-8"))
            rank = int(data.get("rank", lay.ERROR_FILE.parse(path.name)))
        except (OSError, ValueError, TypeError):
            continue
        message = str(data.get("message", ""))
        node, log = _rank_log(run_dir, rank, rank % nproc if nproc else None, message, since)
        out.append(
            Failure(
                rank, node, str(data.get("exception_type") or "error"), message,
                data.get("iteration"), data.get("time"), str(log) if log else None,
            )
        )  # fmt: skip
    return sorted(out, key=lambda f: (f.time or 0, f.rank))


def progress(run_dir: Path) -> dict[str, Any] | None:
    """The newest training record of ``progress.jsonl`` (iteration, loss, age)."""
    record = read_last_progress_step(run_dir)
    if record is None:
        return None
    out: dict[str, Any] = {
        "iteration": record.iteration,
        "train_iters": record.train_iters,
        "loss": record.loss,
        "time": record.time,
    }
    if isinstance(out["time"], int | float):
        out["age_s"] = round(time.time() - out["time"], 1)
    return out


def stopped_early(prog: dict[str, Any] | None) -> bool:
    """Whether the newest progress record is short of the last iteration."""
    return bool(
        prog
        and isinstance(prog.get("iteration"), int)
        and isinstance(prog.get("train_iters"), int)
        and prog["iteration"] < prog["train_iters"]
    )


def telemetry_off(
    run_dir: Path, since: float | None, ranks: Iterable[int] | None = None
) -> dict[int, str]:
    """Rank -> why its telemetry is off although it was asked for, from the progress beats
    (``heartbeat/rank{R}.json``: a worker whose ``mlaunch.telemetry`` setup failed says so in
    its first beat) written since ``since`` (an earlier launch's beats are not this one's).
    ``ranks``: only these (a launcher reads its own node's); None: every beat there."""
    beats = read_heartbeats(run_dir)
    out: dict[int, str] = {}
    for rank in sorted(beats) if ranks is None else ranks:
        beat = beats.get(rank)
        if beat is None or (since is not None and beat.written < since - 1):
            continue
        if beat.telemetry_off:
            out[rank] = beat.telemetry_off
    return out


# --------------------------------------------------------------------------------------------
# The launcher's record and job trace


def launcher_record(run_dir: Path) -> LauncherAttempts | None:
    """Node 0's launcher record of the newest launch (``launcher-node0.json``), or None."""
    return read_launcher_record(run_dir, 0)


def pid_alive(pid: Any) -> bool:
    """Whether ``pid`` is a live (not zombie) mlaunch process on this host."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and b"mlaunch" in cmdline


def _launcher_view(rec: LauncherAttempts) -> LauncherView:
    alive = None
    if rec.ended is None and rec.host == socket.gethostname():
        alive = pid_alive(rec.pid)
    return LauncherView(rec.pid, rec.host, rec.started, rec.ended, rec.exit_code, rec.signal, alive)


def job_trace(run_dir: Path, since: float | None) -> list[dict[str, Any]]:
    """The launcher's spans (``mlaunch.job``, ``mlaunch.job.attempt``, every node's) that ended
    since ``since`` (the newest launch's start: an earlier launch had ended before it began)."""
    from mlaunch.otlp.otlp_json import read_spans

    spans: list[dict[str, Any]] = []
    for path in sorted((run_dir / lay.TELEMETRY_DIR).glob(lay.LAUNCHER_TRACES_FILE_GLOB)):
        try:
            spans += read_spans(path)
        except (OSError, ValueError):
            continue
    if since is not None:
        spans = [s for s in spans if s.get("end_ns", 0) >= (since - 1) * 1e9]
    return sorted(spans, key=lambda s: s.get("start_ns", 0))


def _restarts_from_trace(spans: list[dict[str, Any]]) -> list[RestartView]:
    """A restart after every attempt that ended in error and has a successor."""
    attempts = [s for s in spans if s.get("name") == _ATTEMPT]
    numbers = {s["attributes"].get(Attr.ATTEMPT) for s in attempts}
    out = []
    for s in attempts:
        n = s["attributes"].get(Attr.ATTEMPT)
        if isinstance(n, int) and n + 1 in numbers and s.get("status_code") == 2:
            out.append(RestartView(n + 1, s["attributes"].get(Attr.FAILED_RANK),
                                   s.get("status_message") or "failed", s["end_ns"] / 1e9))  # fmt: skip
    return out


def _checkpoint_roots(run_dir: Path) -> list[Path]:
    """Where the run saves: the default ``checkpoints/`` and the ``--save`` of ``command.txt``."""
    roots = [run_dir / lay.CHECKPOINTS_DIR]
    try:
        argv = (run_dir / lay.COMMAND_FILE).read_text(encoding="utf-8").split()
        if "--save" in argv[:-1]:
            roots.append(Path(argv[argv.index("--save") + 1].strip("'\"")))
    except OSError:
        pass
    return roots


def saved_since(run_dir: Path, since: float) -> bool:
    """Whether a checkpoint was committed since ``since`` (the default ``checkpoints/`` or the
    ``--save`` of ``command.txt``)."""
    for root in _checkpoint_roots(run_dir):
        with contextlib.suppress(OSError):
            if (root / lay.CHECKPOINT_TRACKER_FILE).stat().st_mtime >= since - 1:
                return True
    return False


def resume_command(run_dir: str | Path, job_id: str | None) -> str | None:
    """The command that resumes the run: ``scontrol requeue JOB`` for a SLURM job, else the
    newest launch as it was given (``resolved.json``'s ``launched_as``: ``cd`` to where it was
    started, ``mlaunch train`` with its words) into the run directory where it is now (a
    ``--run-dir`` before a ``--`` for the script); None when the launch recorded none."""
    if job_id is not None:
        return f"scontrol requeue {job_id}"
    body = read_json_object(Path(run_dir) / lay.RESOLVED_JSON_FILE) or {}
    given = body.get("launched_as")
    if not isinstance(given, dict) or not isinstance(given.get("argv"), list):
        return None
    words = [str(w) for w in given["argv"]]
    cut = words.index("--") if "--" in words else len(words)
    words[cut:cut] = ["--run-dir", str(Path(run_dir).absolute())]
    cwd = str(given.get("cwd") or ".")
    return f"cd {shlex.quote(cwd)} && mlaunch train {shlex.join(words)}"


def latest_checkpoint(run_dir: Path) -> int | None:
    """The iteration of the newest committed checkpoint (its tracker file, which the trainer
    replaces after each commit), or None when the run has none."""
    found = []
    for root in _checkpoint_roots(run_dir):
        with contextlib.suppress(OSError, ValueError):
            found.append(int((root / lay.CHECKPOINT_TRACKER_FILE).read_text().strip()))
    return max(found) if found else None


def resumable_text(run_dir: str | Path, job_id: str | None) -> str:
    """How a run whose workers stopped on a signal and saved resumes (``mlaunch status`` of a
    preempted run, and ``mlaunch train``'s closing lines after Ctrl-C or SIGTERM), with the
    command (:func:`resume_command`) on a line of its own."""
    if job_id is None:
        text = (
            "resumable: the workers stopped on a signal and saved; `mlaunch train` with the same"
            f" settings and --run-dir {run_dir} resumes from the checkpoint"
        )
        command = resume_command(run_dir, None)
        return text + (f"\nresume:   {command}" if command else "")
    return (
        "resumable: the workers stopped on a signal and saved; it resumes from the checkpoint"
        f" when the job is requeued (scontrol requeue {job_id})"
    )


def apply_launch(
    st: JobStatus, run_dir: Path, rec: LauncherAttempts | None, *, locate: bool = True
) -> None:
    """Outside SLURM: the state from the newest launch's record and job trace (``locate``:
    :func:`failures`')."""
    since = rec.started if rec else None
    # The job trace says what a launch without a record did (read only then, or for restarts).
    spans = job_trace(run_dir, since) if rec is None else []
    jobs = [s for s in spans if s.get("name") == _JOB]
    job = jobs[-1] if jobs else None
    if rec is not None:
        st.launcher = _launcher_view(rec)
        st.attempt = rec.attempt
        st.restarts = [RestartView(r.attempt, r.rank, r.cause, r.time) for r in rec.restarts]  # type: ignore[arg-type]
    elif job is None:
        return  # neither: the run directory alone tells (below)
    if not st.restarts and (rec is None or locate):
        # An earlier mlaunch's record without restarts: the job trace's (a listing, which
        # needs only the state, leaves them out and skips reading the trace).
        st.restarts = _restarts_from_trace(spans if rec is None else job_trace(run_dir, since))
    if st.attempt is None and job is not None:
        st.attempt = job["attributes"].get(Attr.ATTEMPT)
    final_since = st.restarts[-1].time if st.restarts and st.restarts[-1].time else since
    # The final attempt's failures, not a restarted one's: that attempt's error files were written
    # before torchrun made the next attempt's folder (the restart's time), so no slack here.
    restarted = bool(st.restarts and st.restarts[-1].time)
    st.failures = failures(run_dir, final_since, 0.0 if restarted else 1.0, locate=locate)
    if rec is not None and rec.ended is None:
        st.state = "launcher_died" if st.launcher and st.launcher.alive is False else "running"
        return
    if rec is not None:
        code, sig = rec.exit_code, rec.signal
        recorded = list(rec.failures)
    else:
        assert job is not None
        code, sig = (
            job["attributes"].get(Attr.EXIT_CODE),
            job["attributes"].get(Attr.SIGNAL),
        )
        recorded = []
    if sig is not None and not recorded and not st.failures:
        saved = saved_since(run_dir, since if since is not None else job["start_ns"] / 1e9)
        st.state = "preempted" if saved else "interrupted"
        return
    if code == 0:
        st.state, st.failures = "completed", []  # the final attempt succeeded
        return
    st.state = "failed"
    if st.failures:
        f = st.failures[0]
        st.failed_rank, st.cause = f.rank, f"{f.exception_type}: {f.message}"
    elif recorded:
        f0 = recorded[0]
        st.failed_rank = f0.rank
        what, msg = f0.exception_type or "error", f0.message or ""
        st.cause = f"{what}: {msg}" if msg else what
        if f0.rank is not None:
            st.failures = [Failure(f0.rank, f0.node, what, msg, None, None, f0.log)]
    elif job is not None:
        attempts = [s for s in spans if s.get("name") == _ATTEMPT]
        st.failed_rank = job["attributes"].get(Attr.FAILED_RANK)
        st.cause = (attempts[-1].get("status_message") if attempts else None) or "failed"
    if rec is not None and rec.rendezvous:  # recorded only when no worker failed
        st.cause = f"rendezvous failed: {rec.rendezvous}"
    if rec is not None and rec.error:
        st.cause = st.cause or f"launcher stopped: {rec.error}"


def apply_stop(st: JobStatus, run_dir: Path, since: float | None) -> None:
    """A launch the user stopped (``mlaunch stop``: its request, made since ``since``, the
    launch's start) is *stopped* once it ended, unless something else ended it first (a failed
    rank, a hang, the last iteration): resumable from the newest checkpoint when there is one."""
    req = read_stop_request(run_dir, since)
    if req is None:
        return
    st.stop = req.as_json()
    ended_by_signal = st.state in ("preempted", "interrupted", "cancelled") or (
        st.state in ("completed", "failed") and not st.cause and stopped_early(st.progress)
    )
    if st.live or st.failures or not ended_by_signal:
        return
    st.state = "stopped"
    st.resume_from = latest_checkpoint(run_dir)


def stopped_lines(run_dir: Path, req: StopRequest, iteration: int | None) -> list[str]:
    """:func:`stop_lines` of a local launch the user stopped that has just ended, reaching
    ``iteration``: what ``mlaunch status`` will say of it, for train's closing lines."""
    st = JobStatus(job_id=None, state="stopped", run_dir=str(run_dir))
    st.stop = req.as_json()
    st.resume_from = latest_checkpoint(run_dir)
    st.progress = {"iteration": iteration} if iteration is not None else None
    return stop_lines(st)


def stop_lines(st: JobStatus) -> list[str]:
    """What ``mlaunch status`` says of a stop the user asked for: who asked and when, and with
    ``stopped``, whether and from where the run resumes (None of this without a request)."""
    req = st.stop
    if not req:
        return []
    who = f" by {req['user']}" if req.get("user") else ""
    when = time.strftime("%H:%M:%S", time.localtime(req["requested_at"]))
    how = " --now" if req.get("now") else ""
    if st.state != "stopped":
        doing = (
            "killing the workers" if req.get("now") else "the workers finish the iteration and save"
        )
        return [f"stopping: mlaunch stop{how}{who} at {when}; {doing}"] if st.live else []
    lines = [f"stopped:  mlaunch stop{how}{who} at {when}"]
    it, reached = st.resume_from, (st.progress or {}).get("iteration")
    where = st.run_dir or ""
    if st.job_id is None:
        how_to = f"`mlaunch train` with the same settings and --run-dir {where} resumes"
    else:
        how_to = f"requeued (scontrol requeue {st.job_id}), the job resumes"
    if it is None:
        lines.append(
            "not resumable: no checkpoint was saved"
            + (" (--now)" if req.get("now") else "")
            + "; --save-interval N saves them"
        )
    elif req.get("now") and isinstance(reached, int) and it < reached:
        lines.append(
            f"resumable from an older checkpoint: --now saved nothing; {how_to} from iteration"
            f" {it}, saved before the stop (iterations {it + 1}-{reached} are trained again)"
        )
    else:
        lines.append(f"resumable: {how_to} from the checkpoint of iteration {it}")
    command = resume_command(where, None) if st.job_id is None else None
    if command:
        lines.append(f"resume:   {command}")
    return lines


def hang_cause(st: JobStatus) -> None:
    """A run that failed after its watchdog stopped a hung attempt failed of the hang (the
    workers' exits were the watchdog's SIGTERM/SIGKILL)."""
    if st.state == "failed" and st.hang and st.hang.get("action") == "stop":
        last = st.restarts[-1].attempt if st.restarts else 0
        if st.hang.get("attempt") == (st.attempt if st.attempt is not None else last):
            st.cause = f"hang: {st.hang['verdict']}"
            st.failed_rank, st.failures = None, []
