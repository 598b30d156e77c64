"""``mlaunch status``: a job's state from SLURM and its run directory.

SLURM says queued / running / finished and how (``scontrol show job``, else ``sacct`` for a job
the controller has forgotten); the run directory says how far training got (``progress.jsonl``),
what each node last logged, and which rank failed and why (``error-rank*.json``,
:mod:`mlaunch.launcher.run_status`). Together they tell a graceful stop on a signal (a
preemption or the time-limit warning: resumable) from a failure and from a finished run, and
the run directory's stop request (``mlaunch stop``) tells a stop the user asked for from both.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlaunch.launcher.hang_report import hang_status
from mlaunch.launcher.run_status import (
    JobStatus,
    apply_launch,
    apply_stop,
    failures,
    hang_cause,
    launcher_record,
    node_views,
    progress,
    resumable_text,
    resume_command,
    stop_lines,
    stopped_early,
    telemetry_off,
)
from mlaunch.rundir import layout as lay
from mlaunch.slurm.client import SlurmError, SlurmJobInfo, job_info, queue_states

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


# --------------------------------------------------------------------------------------------
# Finding the job and its run directory


def _job_record(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / lay.SLURM_JOB_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _job_id_of(run_dir: Path, resolved: dict[str, Any] | None = None) -> str | None:
    """The job id a run directory belongs to: ``slurm-job.json``, else its ``resolved.json``
    (``resolved``: its content, when the caller has read it)."""
    if jid := _job_record(run_dir).get("job_id"):
        return str(jid)
    try:
        if resolved is not None:
            data = resolved
        else:
            data = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
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
        if (c / lay.SLURM_JOB_FILE).is_file() or (c / lay.RESOLVED_JSON_FILE).is_file():
            return c
    return None


# --------------------------------------------------------------------------------------------
# The status


def job_status(target: str, cwd: Path) -> JobStatus:
    """The status of ``target``: a run directory or a job id. Raises :class:`StatusInputError`
    when it is neither; a missing SLURM only leaves the SLURM half out. The run model
    (:class:`mlaunch.rundir.state.RunState`: captures, dumps) is read for the state decided."""
    st, since = _job_status(target, cwd)
    st.attach_run_state(since)
    return st


@dataclass
class Target:
    """What ``RUN_DIR|JOB_ID`` names: a run directory, a SLURM job, or both. Every command that
    takes a run by directory or job id (``status``, ``logs``, ``stop``, ...) resolves it here."""

    run_dir: Path | None
    job_id: str | None
    info: SlurmJobInfo | None = None
    """SLURM's view of the job; None without a job id, without SLURM, or when it forgot it."""
    note: str | None = None
    """Why SLURM could not be asked (``scontrol`` missing, ...), for the view to say."""


def resolve_target(target: str, cwd: Path) -> Target:
    """Resolve ``RUN_DIR|JOB_ID`` (relative paths from ``cwd``). Raises
    :class:`StatusInputError` when it names neither."""
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
    return Target(run_dir=run_dir, job_id=job_id, info=info, note=note)


def _job_status(target: str, cwd: Path) -> tuple[JobStatus, float | None]:
    """:func:`job_status` without the run model, and the start of the launch it describes."""
    t = resolve_target(target, cwd)
    return _status_of(t.run_dir, t.job_id, t.info, t.note)


def run_dir_status(run_dir: Path, resolved: dict[str, Any] | None = None) -> JobStatus:
    """The state of a run directory as :func:`job_status` decides it, from the run directory
    alone (SLURM not asked) and without the views' detail (each node's last line, failed ranks'
    logs, hang reports, the run model): ``mlaunch runs`` lists many runs this way, fast.
    ``resolved``: its ``resolved.json``, when the caller has read it."""
    return _status_of(run_dir, _job_id_of(run_dir, resolved), None, None, detail=False)[0]


def _status_of(
    run_dir: Path | None,
    job_id: str | None,
    info: SlurmJobInfo | None,
    note: str | None,
    *,
    detail: bool = True,
) -> tuple[JobStatus, float | None]:
    """The one derivation of a run's state (SLURM's ``info`` when there is one, else the run
    directory's records). ``detail`` False: only what decides the state and the progress."""
    st = JobStatus(job_id=job_id, state="unknown", run_dir=str(run_dir) if run_dir else None)
    st.note = note
    since = info.start_epoch() if info is not None else None
    if run_dir is not None:
        st.progress = progress(run_dir)
        st.failures = failures(run_dir, since, locate=detail)
        if detail:
            st.nodes = node_views(run_dir, since)
            outputs = sorted(run_dir.glob(lay.SLURM_OUTPUT_GLOB))
            st.output = str(outputs[-1]) if outputs else None
    if info is not None:
        st.slurm = info.as_json()
        st.incarnation = info.restarts + 1 if info.restarts is not None else None
        st.state = STATES.get(info.state, info.state.lower())
    rec = launcher_record(run_dir) if run_dir is not None else None
    launched = since if since is not None else (rec.started if rec is not None else None)
    if rec is not None and rec.watchdog is not None:
        st.watchdog = rec.watchdog
    if run_dir is not None and detail:
        st.hang = hang_status(run_dir, launched)
        st.telemetry_off = [
            {"rank": rank, "reason": reason}
            for rank, reason in telemetry_off(run_dir, launched).items()
        ]
    if info is None and run_dir is not None:  # no SLURM (or it forgot it): the launch's record
        apply_launch(st, run_dir, rec, locate=detail)
        if st.state != "unknown":
            hang_cause(st)
            apply_stop(st, run_dir, launched)
            return st, launched
        if st.failures:  # a run directory with neither: what its files tell
            st.state = "failed"
        elif st.progress and not stopped_early(st.progress):
            st.state = "completed"
    hang_cause(st)
    if st.state in ("completed", "failed") and not st.failures and stopped_early(st.progress):
        # The workers stopped on a signal (preemption, the time-limit warning, scancel
        # --signal) and saved: the job can resume from its checkpoint.
        st.state = "preempted"
    if run_dir is not None:  # the user asked for it (mlaunch stop): stopped, not preempted
        apply_stop(st, run_dir, launched)
    return st, launched


# --------------------------------------------------------------------------------------------
# Every run under a directory (``mlaunch runs``)

#: The state word of a folder that is no run directory, and of one whose records cannot be read.
NOT_A_RUN, CORRUPT = "not a run", "corrupt"
#: The state word of the local run directory of a Kubernetes TrainJob (its note says how to ask).
TRAINJOB_STATE = "on kubernetes"
#: Said under a listing with SLURM jobs in it: their state is the run directory's, not SLURM's.
SLURM_NOT_ASKED = (
    "SLURM could not be asked ({why}): a job's state is what its run directory says;"
    " `mlaunch status JOB_ID` asks SLURM"
)


@dataclass
class RunRow:
    """One folder of a runs directory, as ``mlaunch runs`` lists it."""

    run_id: str
    state: str
    path: str
    started: float | None = None
    """When its newest launch started (epoch seconds), else when it was submitted to SLURM."""
    iteration: int | None = None
    train_iters: int | None = None
    entry: str | None = None
    """What the workers run: ``trainer`` (mlaunch's), the script's path or ``-m MODULE``."""
    job_id: str | None = None
    resume: str | None = None
    """The command that resumes it, when it stopped with a checkpoint."""
    note: str | None = None
    """Why a folder is listed as :data:`NOT_A_RUN` or :data:`CORRUPT`."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _entry_of(resolved: dict[str, Any]) -> str | None:
    settings = resolved.get("settings")
    if not isinstance(settings, dict):
        return None

    def value(key: str) -> Any:
        entry = settings.get(key)
        return entry.get("value") if isinstance(entry, dict) else None

    if value("launch.script"):
        return str(value("launch.script"))
    if value("launch.module"):
        return f"-m {value('launch.module')}"
    return "trainer"


def run_row(run_dir: Path) -> RunRow:
    """One folder as a row: its state by :func:`run_dir_status` (the words of ``mlaunch
    status``), progress, start, entry point and resume command; a folder that is no run, or
    whose records cannot be read, is a row that says so (never an exception)."""
    from mlaunch.rundir.records import read_json_object

    row = RunRow(run_dir.name, NOT_A_RUN, str(run_dir))
    trainjob = read_json_object(run_dir / lay.TRAINJOB_RECORD_FILE)
    if trainjob is not None and not lay.is_run_dir(run_dir):
        # A TrainJob's manifest and record: its run is in the pods and on their volume; asking
        # the API per row would make the listing slow, as asking SLURM would.
        name, ns = trainjob.get("name"), trainjob.get("namespace")
        row.state = TRAINJOB_STATE
        row.started = (
            trainjob.get("created") if isinstance(trainjob.get("created"), float) else None
        )
        row.note = f"a Kubernetes TrainJob: mlaunch status trainjob/{name} -n {ns}"
        return row
    if not lay.is_run_dir(run_dir):
        row.note = "no resolved.json, launcher record, SLURM job or logs/ in it"
        return row
    resolved_path = run_dir / lay.RESOLVED_JSON_FILE
    resolved = read_json_object(resolved_path)
    if resolved is None and resolved_path.exists():
        row.state, row.note = CORRUPT, f"{lay.RESOLVED_JSON_FILE} cannot be read as a JSON object"
        return row
    resolved = resolved or {}
    try:
        st = run_dir_status(run_dir, resolved)
    except Exception as exc:  # noqa: BLE001 - a listing names a folder it cannot read, never stops
        row.state, row.note = CORRUPT, f"{type(exc).__name__}: {exc}"
        return row
    row.run_id = str(resolved.get("run_id") or run_dir.name)
    row.state, row.job_id = st.state, st.job_id
    la = st.launcher
    row.started = la.started if la is not None else _job_record(run_dir).get("submitted")
    if row.started is None:
        with contextlib.suppress(OSError):
            row.started = resolved_path.stat().st_mtime
    if st.progress:
        row.iteration, row.train_iters = (
            st.progress.get("iteration"),
            st.progress.get("train_iters"),
        )
    row.entry = _entry_of(resolved)
    if row.train_iters is None and row.entry == "trainer":  # no iteration yet: the resolved total
        entry = (resolved.get("settings") or {}).get("training.train_iters")
        total = entry.get("value") if isinstance(entry, dict) else None
        row.train_iters = total if isinstance(total, int) else None
    if st.resumable:
        row.resume = resume_command(run_dir, st.job_id)
    return row


def list_runs(folder: Path) -> tuple[list[RunRow], str | None]:
    """Every folder directly under ``folder`` (hidden ones aside), newest first (a folder with
    no start last), and a note when its SLURM jobs' states could not be asked. SLURM is asked
    once for the whole queue (``squeue``), never per job: a job still in the queue has SLURM's
    word (queued, running), one that left it what its run directory says."""
    rows = [
        run_row(Path(e.path))
        for e in os.scandir(folder)
        if e.is_dir() and not e.name.startswith(".")
    ]
    note = None
    if any(r.job_id for r in rows):
        try:
            queue = queue_states()
        except SlurmError as exc:
            note = SLURM_NOT_ASKED.format(why=exc)
        else:
            for r in rows:
                if r.job_id in queue:
                    r.state = STATES.get(queue[r.job_id], queue[r.job_id].lower())
    rows.sort(key=lambda r: (r.started is None, -(r.started or 0), r.path))
    return rows, note


# --------------------------------------------------------------------------------------------
# Text


def status_text(st: JobStatus) -> str:
    """The plain-text view."""
    s = st.slurm or {}
    head = f"job {st.job_id}" if st.job_id else "run"
    if s.get("name"):
        head += f" ({s['name']})"
    head += f": {st.state.replace('_', ' ')}"  # launcher_died: "launcher died"
    if st.state == "queued" and s.get("reason") and s["reason"] != "None":
        head += f" ({s['reason']})"
    if s.get("state") and STATES.get(s["state"]) != st.state:
        head += f" [SLURM: {s['state']}]"
    if st.state == "running" and s.get("nodes"):
        head += f" on {s['nodes']} for {s.get('elapsed')}"
    elif s.get("exit_code") and st.state not in ("queued", "running"):
        head += f", exit code {s['exit_code']}, ran {s.get('elapsed')}"
    k = st.trainjob
    if k is not None:  # a TrainJob: its namespace, and why it waits or failed
        head = f"trainjob {k['name']} (namespace {k['namespace']}): {st.state}"
        if k.get("reason") and st.state != "failed":
            head += f" ({k['reason']})"
    if st.incarnation and st.incarnation > 1:
        head += f"; incarnation {st.incarnation} ({st.incarnation - 1} requeue(s))"
    if st.restarts:
        head += f"; {len(st.restarts)} restart(s)"
    lines = [head]
    la = st.launcher
    if st.state == "launcher_died" and la is not None:
        lines.append(
            f"launcher: pid {la.pid} on {la.host} is gone without ending the run (killed, e.g."
            " by SIGKILL or the OOM killer); its workers were stopped with it"
        )
    elif st.state == "running" and la is not None:
        where = f"pid {la.pid} on {la.host}"
        lines.append(f"launcher: {where}" + ("" if la.alive else " (not checked from this host)"))
    hung = bool(st.hang and st.cause and st.cause.startswith("hang:"))
    if st.state == "failed" and st.cause and not st.failures and not hung:
        who = f"rank {st.failed_rank}" if st.failed_rank is not None else "the run"
        lines.append(f"failed:   {who}: {st.cause}")
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
    if st.hang:
        lines.append(f"hang:     attempt {st.hang.get('attempt')}: {st.hang['verdict']}")
        lines.append(f"          report: {st.hang['report']}")
    for r in st.restarts:
        lines.append(f"restart:  attempt {r.attempt} after {r.cause}")
    for off in st.telemetry_off:
        lines.append(f"telemetry: off on rank {off['rank']}: {off['reason']}")
    lines += [f"capture:  {capture_text(c)}" for c in st.captures]
    if st.dumps:
        lines.append(f"recorder: {dumps_text(st.dumps)}")
    for pod in (k or {}).get("pods", []):
        why = f" ({pod['reason']})" if pod.get("reason") else ""
        where = f" on {pod['host']}" if pod.get("host") else ""
        lines.append(f"pod:      {pod['name']} (node {pod['node']}): {pod['phase']}{why}{where}")
    for n in st.nodes:
        lines.append(f"node {n.node}:   {n.last_line or '(nothing logged yet)'}")
    if st.state == "preempted":  # a stop the user asked for says it in stop_lines
        lines.append(resumable_text(st.run_dir or "", st.job_id))
    lines += stop_lines(st)
    if st.note:
        lines.append(f"note:     {st.note}")
    return "\n".join(lines)


def capture_text(c: dict[str, Any]) -> str:
    """One capture as ``status`` and ``status --watch`` show it: its id, what, and its phase."""
    from mlaunch.model.strategies import format_ranks

    what = (
        f"groups {c['groups'] or '(none)'}" if c.get("groups") is not None else "flight recorders"
    )
    who = "every rank" if c.get("ranks") is None else f"ranks {format_ranks(c['ranks'])}"
    its = c.get("iterations")
    where = ""
    if its:
        where = f", iteration {its[0]}" if its[0] == its[1] else f", iterations {its[0]}-{its[1]}"
    return f"{c['id']} ({what} of {who}{where}): {c['phase']}"


def dumps_text(dumps: list[dict[str, Any]]) -> str:
    """The recorder dumps in one line: how many, from which ranks, why."""
    from mlaunch.model.strategies import format_ranks

    ranks = sorted({d["rank"] for d in dumps})
    triggers = sorted({d["trigger"] for d in dumps})
    n = len(dumps)
    return (
        f"{n} dump{'s' if n != 1 else ''} from rank{'s' if len(ranks) != 1 else ''}"
        f" {format_ranks(ranks)} ({', '.join(triggers)})"
    )
