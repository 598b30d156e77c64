"""SLURM's client commands, for ``mlaunch sbatch`` (submit) and ``mlaunch status`` (ask).

The side effects of :mod:`mlaunch.slurm.batch`: ``sbatch``, ``scontrol``, ``scancel``,
``sacct`` as subprocesses (their output parsed here, nowhere else). The allocation read from
SLURM's variables inside a job is the launcher's (:mod:`mlaunch.launcher.cluster_env`): ``mlaunch
train`` plans with it, and the launcher never imports this package, which sits above it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlaunch.rundir import layout as lay

if TYPE_CHECKING:  # ``mlaunch status`` never pays for the settings layer
    from mlaunch.slurm.batch import BatchJob

#: How long a SLURM client command may take (a busy controller answers slowly).
CLIENT_TIMEOUT_S = 60.0
#: ``key=value`` starts in ``scontrol show job -o`` (values may hold spaces: Comment, Command).
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
#: The uid in ``scontrol``'s ``UserId=alice(1000)``.
_UID = re.compile(r"\((\d+)\)$")


class SlurmError(RuntimeError):
    """A SLURM command is missing or failed (its message says which and why)."""


def _run(
    argv: list[str], *, env: Mapping[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"{argv[0]}: not found (run this where SLURM's commands are installed)")
    try:
        return subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
            env=dict(env) if env is not None else None,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)}: no answer in {CLIENT_TIMEOUT_S:.0f} s") from None


def _message(out: subprocess.CompletedProcess[str]) -> str:
    return (out.stderr or out.stdout).strip() or f"exit code {out.returncode}"


# --------------------------------------------------------------------------------------------
# Submitting


@dataclass(frozen=True)
class Submission:
    """A submitted job."""

    job_id: str
    run_dir: Path
    held: bool
    """Still held because the user asked for it (``--sbatch-arg=--hold``)."""


def _user_hold(job: BatchJob) -> bool:
    return any(a in ("-H", "--hold") for a in job.options.sbatch_args)


def submit(job: BatchJob, script: str, environ: Mapping[str, str]) -> Submission:
    """Submit ``script`` and write the run directory (``job.sbatch``, ``slurm-job.json``).

    The job id names the run directory, and SLURM needs that directory (its output file is
    there) the moment the job starts: so the job is submitted held, the directory is written,
    and only then is the job released. If writing fails the job is cancelled.
    """
    out = _run(["sbatch", "--parsable", "--hold"], env=environ, stdin=script)
    if out.returncode != 0:
        raise SlurmError(f"sbatch: {_message(out)}")
    job_id = out.stdout.strip().split(";")[0]
    run_dir = job.run_dir(job_id)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / lay.JOB_SCRIPT_FILE).write_text(script, encoding="utf-8")
        record = {
            "job_id": job_id,
            "submitted": time.time(),
            "submit_host": socket.gethostname(),
            "cwd": str(job.cwd),
            "nodes": job.options.nodes,
            "workers_per_node": job.workers_per_node,
            "run_dir": str(run_dir),
            "script": lay.JOB_SCRIPT_FILE,
        }
        (run_dir / lay.SLURM_JOB_FILE).write_text(json.dumps(record, indent=1) + "\n")
    except OSError as exc:
        cancel(job_id, environ)
        raise SlurmError(
            f"cannot write the run directory {run_dir} ({exc}); job {job_id} cancelled"
        ) from None
    held = _user_hold(job)
    if not held:
        rel = _run(["scontrol", "release", job_id], env=environ)
        if rel.returncode != 0:
            cancel(job_id, environ)
            raise SlurmError(f"scontrol release {job_id}: {_message(rel)}; job cancelled")
    return Submission(job_id, run_dir, held)


def cancel(job_id: str, environ: Mapping[str, str] | None = None) -> None:
    """``scancel`` the job (best effort: used on the way out of a failure)."""
    with contextlib.suppress(SlurmError):
        _run(["scancel", job_id], env=environ)


def signal_batch(job_id: str, signal: str, environ: Mapping[str, str] | None = None) -> None:
    """``scancel --signal=SIGNAL --batch JOB``: the signal to the job's batch script only, which
    passes it on to the training step (the time-limit warning's path). Raises SlurmError."""
    out = _run(["scancel", f"--signal={signal}", "--batch", job_id], env=environ)
    if out.returncode != 0:
        raise SlurmError(f"scancel --signal={signal} --batch {job_id}: {_message(out)}")


# --------------------------------------------------------------------------------------------
# Asking


@dataclass(frozen=True)
class SlurmJobInfo:
    """What SLURM says of one job."""

    job_id: str
    state: str
    """SLURM's state word: PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, PREEMPTED, ..."""
    reason: str
    exit_code: str
    restarts: int | None
    """Requeues so far (``scontrol``; None from ``sacct``)."""
    nodes: str
    start: str
    end: str
    elapsed: str
    name: str
    stdout: str
    work_dir: str
    source: str
    """``scontrol`` (the controller still knows the job) or ``sacct`` (accounting)."""
    user_id: int | None = None
    """The uid of the job's owner (``scontrol``'s ``UserId=name(uid)``; None from ``sacct``)."""

    def start_epoch(self) -> float | None:
        """The start of the current incarnation (local time), or None when not started."""
        try:
            return time.mktime(time.strptime(self.start, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return None

    def as_json(self) -> dict[str, Any]:
        """The fields as a JSON object."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def parse_scontrol(line: str) -> dict[str, str]:
    """``Key=value Key=value ...`` of ``scontrol show job -o`` (values may hold spaces)."""
    marks = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def queue_states(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every job in SLURM's queue (pending, running, completing, ...) and its state, in one
    ``squeue`` call: a job absent from it has ended or is unknown. Raises SlurmError without
    SLURM or when the controller does not answer."""
    out = _run(["squeue", "-h", "-o", "%i|%T"], env=environ)
    if out.returncode != 0:
        raise SlurmError(f"squeue: {_message(out)}")
    states = {}
    for line in out.stdout.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id and state:
            states[job_id] = state
    return states


def job_info(job_id: str, environ: Mapping[str, str] | None = None) -> SlurmJobInfo | None:
    """The job as ``scontrol show job`` tells it, else as ``sacct`` does (a job the controller
    has forgotten, where accounting exists), else None. Raises SlurmError without SLURM."""
    out = _run(["scontrol", "show", "job", "-o", job_id], env=environ)
    if out.returncode == 0 and out.stdout.strip():
        f = parse_scontrol(out.stdout.strip().splitlines()[0])
        restarts = f.get("Restarts", "")
        return SlurmJobInfo(
            job_id=f.get("JobId", job_id), state=f.get("JobState", "UNKNOWN"),
            reason=f.get("Reason", ""), exit_code=f.get("ExitCode", ""),
            restarts=int(restarts) if restarts.isdigit() else None,
            nodes=f.get("NodeList", ""), start=f.get("StartTime", ""),
            end=f.get("EndTime", ""), elapsed=f.get("RunTime", ""), name=f.get("JobName", ""),
            stdout=f.get("StdOut", ""), work_dir=f.get("WorkDir", ""), source="scontrol",
            user_id=int(m.group(1)) if (m := _UID.search(f.get("UserId", ""))) else None,
        )  # fmt: skip
    if shutil.which("sacct") is None:
        return None
    fields = "JobID,JobName,State,ExitCode,Start,End,Elapsed,NodeList,WorkDir"
    acct = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", fields], env=environ)
    rows = (
        [r.split("|") for r in acct.stdout.splitlines() if r.strip()]
        if acct.returncode == 0
        else []
    )
    if not rows:
        return None
    jid, name, state, code, start, end, elapsed, nodes, work_dir = (rows[-1] + [""] * 9)[:9]
    return SlurmJobInfo(
        job_id=jid, state=state.split()[0] if state else "UNKNOWN", reason="", exit_code=code,
        restarts=None, nodes=nodes, start=start, end=end, elapsed=elapsed, name=name, stdout="",
        work_dir=work_dir, source="sacct",
    )  # fmt: skip
