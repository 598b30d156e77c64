"""The typed records of the run directory: ``progress.jsonl``'s lines, and (below) the records
the launcher and the workers leave (attempts, captures, recorder dumps, hang reports, beats)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mlaunch.rundir.layout import (
    CAPTURE_ACK_FILE,
    CAPTURE_REQUEST_FILE,
    CAPTURES_LOG_FILE,
    HANG_NODE_REPORT,
    HEARTBEAT_DIR,
    HEARTBEAT_FILE,
    LAUNCHER_RECORD_FILE,
    LENS_CAPTURE_ACK_TEMPLATE,
    PROGRESS_FILE,
    RECORDER_INDEX_FILE,
    STOP_REQUEST_FILE,
    TELEMETRY_DIR,
    hang_dir,
    heartbeat_file,
    launcher_record_file,
)

# ``progress.jsonl`` (:data:`PROGRESS_FILE`): one JSON object per line, appended and flushed by the
# rank that owns the loss, one per iteration and one per evaluation. Its two records are these
# dataclasses (their fields, in order, are the JSON keys): the trainer writes them with
# :func:`progress_line`, readers read them back with :func:`read_progress_record`. Every field may
# read as None: a non-finite float is written as null, and an earlier trainer's line, or a cut
# one, may lack keys, which read as None rather than make the line unreadable.


@dataclass(frozen=True, slots=True)
class ProgressStep:
    """One training iteration's line of ``progress.jsonl``."""

    iteration: int | None
    train_iters: int | None
    loss: float | None
    lr: float | None
    grad_norm: float | None
    tokens_per_sec: float | None
    step_ms: float | None
    #: CPU time of the whole process during the step (steadier than wall time on a shared host).
    cpu_ms: float | None
    skipped: bool | None
    #: Wall clock at the end of the step: a reader can see stalls between steps.
    time: float | None
    #: Data parallelism only (else left out): the step's gradient buckets, and how many of them
    #: the last backward launched itself (all of them when the all-reduce overlaps backward).
    grad_buckets: int | None = None
    grad_buckets_in_backward: int | None = None


@dataclass(frozen=True, slots=True)
class ProgressEval:
    """One evaluation's line of ``progress.jsonl``."""

    iteration: int | None
    eval_loss: float | None
    #: The greedy completion of a held-out prompt (``--sample-tokens``), else left out.
    sample: str | None = None


#: The fields a record leaves out of its line when they are None (they apply to some runs only).
_OPTIONAL_PROGRESS_FIELDS = frozenset({"grad_buckets", "grad_buckets_in_backward", "sample"})


def progress_line(record: ProgressStep | ProgressEval) -> str:
    """``record`` as its line of ``progress.jsonl`` (with the newline); a non-finite float is
    written as ``null`` (JSON has no NaN)."""
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.name in _OPTIONAL_PROGRESS_FIELDS:
            continue
        out[f.name] = None if isinstance(value, float) and not math.isfinite(value) else value
    return json.dumps(out) + "\n"


#: Either record of ``progress.jsonl``.
ProgressRecord = ProgressStep | ProgressEval

_STEP_FIELDS = tuple(f.name for f in fields(ProgressStep))
_EVAL_FIELDS = tuple(f.name for f in fields(ProgressEval))


def read_progress_record(raw: bytes | str) -> ProgressRecord | None:
    """One line of ``progress.jsonl`` as its record: an evaluation's when it has ``eval_loss``,
    else a step's when it has ``loss``; None for a line that is neither, or no JSON object (a
    crash can cut the last line). A key the line lacks reads as None; values are the line's own,
    unchecked (a reader checks the type of what it uses, as it checked the JSON object's), and
    keys no record has are dropped."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if "eval_loss" in record:
        return ProgressEval(**{name: record.get(name) for name in _EVAL_FIELDS})
    if "loss" in record:
        return ProgressStep(**{name: record.get(name) for name in _STEP_FIELDS})
    return None


def _progress_tail_lines(run_dir: str | Path, limit: int) -> list[bytes]:
    try:
        with (Path(run_dir) / PROGRESS_FILE).open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - limit))
            lines = fh.read().splitlines()
    except OSError:
        return []
    return lines[1:] if size > limit else lines


def read_progress_tail(run_dir: str | Path, limit: int = 64 << 10) -> list[ProgressStep]:
    """The training records in the last ``limit`` bytes of ``run_dir``'s ``progress.jsonl``,
    oldest first ([] when it cannot be read): what a view of a running job needs of a file that
    grows with the run, without reading it whole. The line the cut falls inside is dropped."""
    lines = _progress_tail_lines(run_dir, limit)
    return [r for r in map(read_progress_record, lines) if isinstance(r, ProgressStep)]


def read_last_progress_step(run_dir: str | Path, limit: int = 64 << 10) -> ProgressStep | None:
    """The newest training record in the last ``limit`` bytes (:func:`read_progress_tail`'s
    last), parsing back from the end only until it is found (a listing of many runs reads one
    record of each)."""
    for raw in reversed(_progress_tail_lines(run_dir, limit)):
        record = read_progress_record(raw)
        if isinstance(record, ProgressStep):
            return record
    return None


# --------------------------------------------------------------------------------------------
# The records the launcher and the workers leave (each written by :mod:`.atomic`, or a beat
# rewritten in place at a fixed width): read here, once, for :class:`~.state.RunState`.


def read_json_object(path: str | Path) -> dict[str, Any] | None:
    """The JSON object at ``path``; None when missing, unreadable or not an object."""
    try:
        body = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One rank's progress beat (:data:`~.layout.HEARTBEAT_FILE`): the iteration it last started
    and when; ``ended`` once its telemetry shut down (the last beat of the process)."""

    rank: int
    iteration: int | None
    time: float | None
    pid: int | None
    ended: bool
    telemetry_off: str | None
    #: When the file was last written (its mtime): an earlier launch's beats are older.
    written: float


def read_heartbeat(run_dir: str | Path, rank: int) -> Heartbeat | None:
    """One rank's beat, or None when it has none (or it cannot be read)."""
    path = heartbeat_file(run_dir, rank)
    body = read_json_object(path)
    if body is None:
        return None
    try:
        written = path.stat().st_mtime
    except OSError:
        return None
    it, t, pid = body.get("iteration"), body.get("time"), body.get("pid")
    off = body.get("telemetry_off")
    return Heartbeat(
        rank, it if isinstance(it, int) else None, t if isinstance(t, int | float) else None,
        pid if isinstance(pid, int) else None, body.get("ended") is True,
        off if isinstance(off, str) and off else None, written,
    )  # fmt: skip


def read_heartbeats(run_dir: str | Path) -> dict[int, Heartbeat]:
    """Every rank's beat (rank -> beat); unreadable ones are left out."""
    out: dict[int, Heartbeat] = {}
    folder = Path(run_dir) / HEARTBEAT_DIR
    for path in folder.glob(HEARTBEAT_FILE.glob) if folder.is_dir() else ():
        rank = HEARTBEAT_FILE.parse(path.name)
        beat = read_heartbeat(run_dir, rank) if rank is not None else None
        if beat is not None:
            out[rank] = beat  # type: ignore[index]
    return out


def read_capture_request(run_dir: str | Path) -> dict[str, Any] | None:
    """The request at the top of the run directory (:data:`~.layout.CAPTURE_REQUEST_FILE`)."""
    return read_json_object(Path(run_dir) / CAPTURE_REQUEST_FILE)


def read_captures_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The superseded captures (:data:`~.layout.CAPTURES_LOG_FILE`), oldest first."""
    try:
        lines = (Path(run_dir) / CAPTURES_LOG_FILE).read_bytes().splitlines()
    except OSError:
        return []
    out = []
    for raw in lines:
        try:
            body = json.loads(raw)
        except ValueError:
            continue
        if isinstance(body, dict) and body.get("id"):
            out.append(body)
    return out


def read_acks(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every mlaunch worker's latest capture ack (rank -> body); unreadable ones are left out."""
    out: dict[int, dict[str, Any]] = {}
    folder = Path(run_dir) / TELEMETRY_DIR
    for path in folder.glob(CAPTURE_ACK_FILE.glob) if folder.is_dir() else ():
        rank = CAPTURE_ACK_FILE.parse(path.name)
        body = read_json_object(path)
        if rank is not None and body is not None:
            out[rank] = body
    return out


def read_lens_acks(run_dir: str | Path, request_id: str) -> dict[int, dict[str, Any]]:
    """nemo-lens workers' answers to request ``request_id`` (``mlaunch.lens_hook``), in the shape
    of an mlaunch worker's ack: ``state`` done once the groups were switched back, missed when
    not applied (``note`` says why), running in between."""
    out: dict[int, dict[str, Any]] = {}
    folder = Path(run_dir) / TELEMETRY_DIR
    pattern = LENS_CAPTURE_ACK_TEMPLATE.format(rank="*", id=request_id)
    for path in folder.glob(pattern) if folder.is_dir() else ():
        body = read_json_object(path)
        try:
            rank = int(body["rank"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            continue
        assert body is not None
        if not body.get("applied"):
            state = "missed"
        else:
            state = "done" if body.get("ended_ns") else "running"
        out[rank] = {**body, "state": state, "note": body.get("reason") or None}
    return out


def capture_answers(
    acks: dict[int, dict[str, Any]], request_id: str, lens: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Each rank's answer to ``request_id``: its mlaunch worker's ack, else its nemo-lens hook's.
    A process that runs ``mlaunch.telemetry`` (it wrote an mlaunch ack, for any request) answers
    for its rank whatever its hook says: the hook in such a worker refuses iteration windows,
    which the mlaunch worker takes, so its refusal must not end the capture early."""
    out = {r: a for r, a in acks.items() if a.get("id") == request_id}
    mlaunch_pids = {a.get("pid") for a in acks.values() if a.get("pid") is not None}
    for rank, ack in lens.items():
        if rank not in out and ack.get("pid") not in mlaunch_pids:
            out[rank] = ack
    return out


@dataclass(frozen=True, slots=True)
class RecorderDump:
    """One flight-recorder dump of one rank (a line of its :data:`~.layout.RECORDER_INDEX_FILE`,
    written beside the dump itself): why, when, and the iterations the ring held."""

    rank: int
    seq: int
    trigger: str
    time_ns: int
    spans: int
    iterations: tuple[int, int] | None

    def as_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "seq": self.seq, "trigger": self.trigger, "time_ns": self.time_ns,
            "spans": self.spans, "iterations": list(self.iterations) if self.iterations else None,
        }  # fmt: skip


def dump_record(
    rank: int, seq: int, trigger: str, spans: int, iterations: list[int]
) -> dict[str, Any]:
    """The index line of one dump (the recorder appends it after the dump's own line)."""
    import time

    its = [min(iterations), max(iterations)] if iterations else None
    return {"rank": rank, "seq": seq, "trigger": trigger, "time_ns": time.time_ns(),
            "spans": spans, "iterations": its}  # fmt: skip


def append_line(path: str | Path, body: dict[str, Any]) -> None:
    """Append ``body`` as one JSON line (one ``write``: a reader never sees half of it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(body) + "\n")


def read_dumps(run_dir: str | Path) -> list[RecorderDump]:
    """Every rank's recorder dumps, oldest first (cut or unreadable lines skipped)."""
    out: list[RecorderDump] = []
    folder = Path(run_dir) / TELEMETRY_DIR
    for path in folder.glob(RECORDER_INDEX_FILE.glob) if folder.is_dir() else ():
        if RECORDER_INDEX_FILE.parse(path.name) is None:
            continue
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for raw in lines:
            try:
                d = json.loads(raw)
                its = d.get("iterations")
                out.append(RecorderDump(
                    int(d["rank"]), int(d["seq"]), str(d["trigger"]), int(d["time_ns"]),
                    int(d.get("spans") or 0),
                    (int(its[0]), int(its[1])) if isinstance(its, list) and len(its) == 2 else None,
                ))  # fmt: skip
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return sorted(out, key=lambda d: (d.time_ns, d.rank))


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


@dataclass(frozen=True, slots=True)
class LauncherRestart:
    """One restart of the worker group by torchrun (the record's ``restarts``): attempt
    ``attempt`` began after ``cause`` (rank ``rank`` failed the one before)."""

    attempt: int | None
    rank: int | None
    cause: str
    time: float | None


@dataclass(frozen=True, slots=True)
class LauncherFailure:
    """A failed rank of the final attempt as the launcher recorded it when the launch ended."""

    rank: int | None
    local_rank: int | None
    node: int | None
    exception_type: str | None
    message: str | None
    log: str | None


@dataclass(frozen=True, slots=True)
class LauncherHang:
    """A hang the node's watchdog declared (the record's ``hangs``)."""

    attempt: int | None
    detected_at: float | None
    verdict: str | None
    action: str | None


@dataclass(frozen=True, slots=True)
class LauncherAttempts:
    """One node's launcher record of the newest launch (:func:`~.layout.launcher_record_file`,
    written by :class:`mlaunch.launcher.run.LauncherRecord`): who launched, when, the attempt it
    is in, its restarts and hangs, and how it ended (``ended`` None: not ended, or the launcher
    was killed). A value of the wrong type reads as None (a record of an earlier mlaunch)."""

    started: float
    pid: int | None = None
    host: str | None = None
    run_id: str | None = None
    node: int | None = None
    attempt: int | None = None
    restarts: tuple[LauncherRestart, ...] = ()
    ended: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    failures: tuple[LauncherFailure, ...] = ()
    #: The launcher itself stopped on an exception.
    error: str | None = None
    #: The verdict of the hang that ended the launch.
    hang: str | None = None
    #: Why torchrun's rendezvous failed (recorded only when no worker failed).
    rendezvous: str | None = None
    #: The hang watchdog's state as last written (``mlaunch status --json``'s ``watchdog``).
    watchdog: dict[str, Any] | None = None
    hangs: tuple[LauncherHang, ...] = ()

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LauncherAttempts | None:
        started = _num(body.get("started"))
        if started is None:
            return None
        rows = lambda key: [r for r in body.get(key) or [] if isinstance(r, dict)]  # noqa: E731
        watchdog = body.get("watchdog")
        return cls(
            started, _int(body.get("pid")), _str(body.get("host")), _str(body.get("run_id")),
            _int(body.get("node")), _int(body.get("attempt")),
            tuple(LauncherRestart(_int(r.get("attempt")), _int(r.get("rank")), str(r.get("cause")),
                                  _num(r.get("time"))) for r in rows("restarts")),
            _num(body.get("ended")), _int(body.get("exit_code")), _str(body.get("signal")),
            tuple(LauncherFailure(_int(f.get("rank")), _int(f.get("local_rank")),
                                  _int(f.get("node")), _str(f.get("exception_type")),
                                  _str(f.get("message")), _str(f.get("log"))) for f in rows("failures")),
            _str(body.get("error")), _str(body.get("hang")), _str(body.get("rendezvous")),
            watchdog if isinstance(watchdog, dict) else None,
            tuple(LauncherHang(_int(h.get("attempt")), _num(h.get("detected_at")),
                               _str(h.get("verdict")), _str(h.get("action"))) for h in rows("hangs")),
        )  # fmt: skip


def read_launcher_record(run_dir: str | Path, node_rank: int = 0) -> LauncherAttempts | None:
    """One node's launcher record of the newest launch, or None (missing, unreadable, or
    without a start)."""
    data = read_json_object(launcher_record_file(run_dir, node_rank))
    return LauncherAttempts.from_json(data) if data is not None else None


def launcher_nodes(run_dir: str | Path) -> list[int]:
    """The node ranks whose launcher left a record in ``run_dir`` (every node of a multi-node run
    shares it), in order."""
    names = (
        LAUNCHER_RECORD_FILE.parse(p.name) for p in Path(run_dir).glob(LAUNCHER_RECORD_FILE.glob)
    )
    return sorted(n for n in names if n is not None)


@dataclass(frozen=True, slots=True)
class StopRequest:
    """The user's request to stop the run (:data:`~.layout.STOP_REQUEST_FILE`, written by
    ``mlaunch stop`` before it signals the launchers): when, by whom, and whether without a save.
    A request older than a launch's start is an earlier launch's (a stopped run, resumed)."""

    requested_at: float
    #: ``--now``: the workers are killed, nothing saved.
    now: bool = False
    uid: int | None = None
    user: str | None = None
    host: str | None = None
    #: The process of ``mlaunch stop`` that asked.
    pid: int | None = None
    #: The SLURM job it was asked of (None: a local run).
    job_id: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StopRequest | None:
        at = _num(body.get("requested_at"))
        if at is None:
            return None
        return cls(
            at, body.get("now") is True, _int(body.get("uid")), _str(body.get("user")),
            _str(body.get("host")), _int(body.get("pid")), _str(body.get("job_id")),
        )  # fmt: skip


def read_stop_request(run_dir: str | Path, since: float | None = None) -> StopRequest | None:
    """The stop request of the launch that started at ``since`` (one second of slack: another
    host's clock), or None: none, unreadable, or an earlier launch's."""
    body = read_json_object(Path(run_dir) / STOP_REQUEST_FILE)
    req = StopRequest.from_json(body) if body is not None else None
    if req is None or (since is not None and req.requested_at < since - 1):
        return None
    return req


@dataclass(frozen=True, slots=True)
class NodeHangReport:
    """One node's hang report (:data:`~.layout.HANG_NODE_REPORT`, written by
    :func:`mlaunch.launcher.hang_report.write_report`): when its watchdog declared the attempt
    hung, what it saw of its ranks (``ranks``: the report's rank objects as written) and what it
    did. The merge of every node's (the verdict judged over all ranks) is the launcher's."""

    node: int | None
    detected_at: float
    attempt: int
    action: str | None
    verdict: str | None
    timeout_s: float | None
    collect_s: float
    ranks: tuple[dict[str, Any], ...]
    nccl: dict[str, Any] | None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> NodeHangReport | None:
        detected = _num(body.get("detected_at"))
        if detected is None:
            return None
        nccl = body.get("nccl")
        return cls(
            _int(body.get("node")), detected, int(body.get("attempt") or 0),
            _str(body.get("action")), _str(body.get("verdict")), _num(body.get("timeout_s")),
            float(body.get("collect_s") or 0),
            tuple(r for r in body.get("ranks") or [] if isinstance(r, dict)),
            nccl if isinstance(nccl, dict) else None,
        )  # fmt: skip


def read_hang_reports(run_dir: str | Path, since: float | None = None) -> list[NodeHangReport]:
    """Every node's hang report detected since ``since`` (a second of slack: the launch's start
    is the launcher's clock), in node order; unreadable ones are left out."""
    out: list[NodeHangReport] = []
    for path in sorted(hang_dir(run_dir).glob(HANG_NODE_REPORT.glob)):
        body = read_json_object(path)
        report = NodeHangReport.from_json(body) if body is not None else None
        if report is not None and (since is None or report.detected_at >= since - 1):
            out.append(report)
    return out


__all__ = [
    "capture_answers",
    "read_heartbeat",
    "read_captures_log",
    "read_json_object",
    "Heartbeat",
    "read_heartbeats",
    "read_capture_request",
    "read_acks",
    "read_lens_acks",
    "RecorderDump",
    "dump_record",
    "append_line",
    "read_dumps",
    "read_launcher_record",
    "launcher_nodes",
    "StopRequest",
    "read_stop_request",
    "LauncherAttempts",
    "LauncherRestart",
    "LauncherFailure",
    "LauncherHang",
    "NodeHangReport",
    "read_hang_reports",
    "ProgressStep",
    "ProgressEval",
    "progress_line",
    "ProgressRecord",
    "read_progress_record",
    "read_progress_tail",
    "read_last_progress_step",
]
