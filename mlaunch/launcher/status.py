"""``mlaunch status``: a job's state from SLURM and its run directory.

SLURM says queued / running / finished and how (``scontrol show job``, else ``sacct`` for a job
the controller has forgotten); the run directory says how far training got (``progress.jsonl``),
what each node last logged, and which rank failed and why (``error-rank*.json``). Together they
tell a graceful stop on a signal (a preemption or the time-limit warning: resumable) from a
failure and from a finished run.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.launcher.slurm import SlurmError, SlurmJobInfo, job_info

#: SLURM state -> mlaunch's word for it.
STATES: dict[str, str] = {
    **dict.fromkeys(
        ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESIZING"),
        "queued",
    ),
    **dict.fromkeys(("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"), "running"),
    "SUSPENDED": "suspended",
    "COMPLETED": "completed",
    **dict.fromkeys(("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), "failed"),
    **dict.fromkeys(("TIMEOUT", "PREEMPTED"), "preempted"),
    "CANCELLED": "cancelled",
}
_JOB_ID = re.compile(r"\d+(?:_\d+)?")


class StatusInputError(ValueError):
    """The argument names neither a run directory nor a SLURM job."""


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
class JobStatus:
    """Everything ``mlaunch status`` shows."""

    job_id: str | None
    state: str
    run_dir: str | None
    slurm: dict[str, Any] | None = None
    incarnation: int | None = None
    """1 for the first run of the job, 2 after one requeue, ..."""
    progress: dict[str, Any] | None = None
    nodes: list[NodeView] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    """This incarnation's failed ranks, the first to fail first."""
    output: str | None = None
    note: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The status as a JSON object."""
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Finding the job and its run directory


def _job_record(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / ec.SLURM_JOB_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _job_id_of(run_dir: Path) -> str | None:
    """The job id a run directory belongs to: ``slurm-job.json``, else its ``resolved.json``."""
    if jid := _job_record(run_dir).get("job_id"):
        return str(jid)
    try:
        data = json.loads((run_dir / ec.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
        env = data.get("environment", {})
    except (OSError, ValueError, AttributeError):
        return None
    run_id = str(data.get("run_id", ""))
    return run_id if _JOB_ID.fullmatch(run_id) and env else None


def _run_dir_of(job_id: str, info: SlurmJobInfo | None, cwd: Path) -> Path | None:
    """A job's run directory: where SLURM writes its output (``mlaunch sbatch`` puts it there),
    else ``runs/<job id>`` under its working directory or this one."""
    candidates = []
    if info is not None and info.stdout:
        candidates.append(Path(info.stdout.replace("%j", job_id)).parent)
    if info is not None and info.work_dir:
        candidates.append(Path(info.work_dir) / "runs" / job_id)
    candidates.append(cwd / "runs" / job_id)
    for c in candidates:
        if (c / ec.SLURM_JOB_FILE).is_file() or (c / ec.RESOLVED_JSON_FILE).is_file():
            return c
    return None


# --------------------------------------------------------------------------------------------
# The run directory


def _last_json_line(path: Path, want: str) -> dict[str, Any] | None:
    """The last JSON line of ``path`` with the key ``want`` (reads only the file's tail)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and want in record:
            return record
    return None


def _last_line(path: Path) -> str | None:
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    return lines[-1] if lines else None


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
        data = json.loads((run_dir / ec.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
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
    for path in (run_dir / ec.LOGS_DIR).glob(
        f"{ec.NODE_LOG_DIR.glob}/*/attempt_*/{local}/std*.log"
    ):
        try:
            if since is not None and path.stat().st_mtime < since - 1:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")[-200_000:]
        except OSError:
            continue
        if any(m and m in text for m in marks):
            return ec.NODE_LOG_DIR.parse(path.relative_to(run_dir / ec.LOGS_DIR).parts[0]), path
    return None, None


def node_views(run_dir: Path, since: float | None = None) -> list[NodeView]:
    """Each node's most recently written worker log (or its launcher's progress view, or
    torchrun's log) since ``since`` (this incarnation's start), and its last line."""
    views = []
    for folder in sorted((run_dir / ec.LOGS_DIR).glob(ec.NODE_LOG_DIR.glob)):
        number = ec.NODE_LOG_DIR.parse(folder.name)
        if number is None:
            continue
        # A worker's log, or (nodes other than 0) the launcher's progress view, whichever is newer.
        # Node 0's progress view is the job's output (the other nodes write only a pointer there).
        first = folder.name == ec.NODE_LOG_DIR.name(0)
        outputs = sorted(run_dir.glob(ec.SLURM_OUTPUT_GLOB)) if first else []
        logs = [*folder.glob("*/attempt_*/*/std*.log"), folder / ec.LAUNCHER_LOG, *outputs]
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


def failures(run_dir: Path, since: float | None = None) -> list[Failure]:
    """The failed ranks (``error-rank*.json`` written since ``since``), the first to fail first."""
    nproc = _nproc(run_dir)
    out = []
    for path in run_dir.glob(ec.ERROR_FILE.glob):
        try:
            if since is not None and path.stat().st_mtime < since - 1:
                continue  # an earlier incarnation's
            data = json.loads(path.read_text(encoding="utf-8"))
            rank = int(data.get("rank", ec.ERROR_FILE.parse(path.name)))
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
    record = _last_json_line(run_dir / ec.PROGRESS_FILE, "loss")
    if record is None:
        return None
    out = {k: record.get(k) for k in ("iteration", "train_iters", "loss", "time")}
    if isinstance(out["time"], int | float):
        out["age_s"] = round(time.time() - out["time"], 1)
    return out


def _stopped_early(prog: dict[str, Any] | None) -> bool:
    return bool(
        prog
        and isinstance(prog.get("iteration"), int)
        and isinstance(prog.get("train_iters"), int)
        and prog["iteration"] < prog["train_iters"]
    )


# --------------------------------------------------------------------------------------------
# The status


def job_status(target: str, cwd: Path) -> JobStatus:
    """The status of ``target``: a run directory or a job id. Raises :class:`StatusInputError`
    when it is neither; a missing SLURM only leaves the SLURM half out."""
    path = Path(target).expanduser()
    path = path if path.is_absolute() else cwd / path
    run_dir: Path | None = None
    if path.is_dir():
        run_dir = path
        job_id = _job_id_of(path)
    elif _JOB_ID.fullmatch(target.strip()):
        job_id = target.strip()
    else:
        raise StatusInputError(f"{target!r} is neither a run directory nor a SLURM job id")
    info: SlurmJobInfo | None = None
    note = None
    if job_id is not None:
        try:
            info = job_info(job_id)
        except SlurmError as exc:
            note = str(exc)
    if run_dir is None:
        assert job_id is not None
        run_dir = _run_dir_of(job_id, info, cwd)
        if run_dir is None and info is None:
            raise StatusInputError(
                f"job {job_id}: SLURM does not know it and there is no runs/{job_id} here"
                + (f" ({note})" if note else "")
            )
    st = JobStatus(job_id=job_id, state="unknown", run_dir=str(run_dir) if run_dir else None)
    st.note = note
    since = info.start_epoch() if info is not None else None
    if run_dir is not None:
        st.progress = progress(run_dir)
        st.nodes = node_views(run_dir, since)
        st.failures = failures(run_dir, since)
        outputs = sorted(run_dir.glob(ec.SLURM_OUTPUT_GLOB))
        st.output = str(outputs[-1]) if outputs else None
    if info is not None:
        st.slurm = info.as_json()
        st.incarnation = info.restarts + 1 if info.restarts is not None else None
        st.state = STATES.get(info.state, info.state.lower())
    elif run_dir is not None:  # SLURM has forgotten the job: what the run directory tells
        if st.failures:
            st.state = "failed"
        elif st.progress and not _stopped_early(st.progress):
            st.state = "completed"
    if st.state in ("completed", "failed") and not st.failures and _stopped_early(st.progress):
        # The workers stopped on a signal (preemption, the time-limit warning, scancel
        # --signal) and saved: the job can resume from its checkpoint.
        st.state = "preempted"
    return st


# --------------------------------------------------------------------------------------------
# Text


def status_text(st: JobStatus) -> str:
    """The plain-text view."""
    s = st.slurm or {}
    head = f"job {st.job_id}" if st.job_id else "run"
    if s.get("name"):
        head += f" ({s['name']})"
    head += f": {st.state}"
    if st.state == "queued" and s.get("reason") and s["reason"] != "None":
        head += f" ({s['reason']})"
    if s.get("state") and STATES.get(s["state"]) != st.state:
        head += f" [SLURM: {s['state']}]"
    if st.state == "running" and s.get("nodes"):
        head += f" on {s['nodes']} for {s.get('elapsed')}"
    elif s.get("exit_code") and st.state not in ("queued", "running"):
        head += f", exit code {s['exit_code']}, ran {s.get('elapsed')}"
    if st.incarnation and st.incarnation > 1:
        head += f"; incarnation {st.incarnation} ({st.incarnation - 1} requeue(s))"
    lines = [head]
    if st.run_dir:
        lines.append(f"run dir:  {st.run_dir}")
    if st.output:
        lines.append(f"output:   {st.output}")
    p = st.progress
    if p:
        loss = f", loss {p['loss']:.4f}" if isinstance(p.get("loss"), int | float) else ""
        age = f" ({p['age_s']:.0f} s ago)" if isinstance(p.get("age_s"), int | float) else ""
        lines.append(f"progress: iteration {p.get('iteration')}/{p.get('train_iters')}{loss}{age}")
    for f in st.failures:
        where = f" (node {f.node})" if f.node is not None else ""
        at = f" at iteration {f.iteration}" if f.iteration is not None else ""
        lines.append(f"failed:   rank {f.rank}{where}{at}: {f.exception_type}: {f.message}")
        if f.log:
            lines.append(f"          log: {f.log}")
    for n in st.nodes:
        lines.append(f"node {n.node}:   {n.last_line or '(nothing logged yet)'}")
    if st.state == "preempted":
        lines.append(
            "resumable: the workers stopped on a signal and saved; it resumes from the checkpoint"
            f" when the job is requeued (scontrol requeue {st.job_id})"
        )
    if st.note:
        lines.append(f"note:     {st.note}")
    return "\n".join(lines)
