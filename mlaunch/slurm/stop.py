"""``mlaunch stop RUN_DIR|JOB_ID [--now]``: stop a live run as a preemption would, and wait for it.

The target resolves as ``status``'s (:func:`~mlaunch.slurm.status.resolve_target`). A SLURM job
SLURM knows gets its time-limit warning (``scancel --signal=USR1 --batch``): the batch script
passes it to the step, every node's launcher stops its workers gracefully, and the script's
requeue logic finds the stop request and does not requeue. Any other run is stopped through its
launchers on this host (:mod:`mlaunch.launcher.stop`). Either way the request is written to the
run directory first, and every refusal comes before it (nothing changed).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlaunch.launcher import stop as local
from mlaunch.launcher.run_status import JobStatus
from mlaunch.launcher.stop import StopRefused
from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import read_stop_request
from mlaunch.slurm.client import SlurmError, job_info, signal_batch
from mlaunch.slurm.status import STATES, Target, job_status, resolve_target

#: How often SLURM is asked whether the job has ended.
SLURM_POLL_S = 1.0


class StopFailed(RuntimeError):
    """The stop could not be sent (SLURM refused the signal); the request was taken back."""


@dataclass
class StopOutcome:
    """How the stop went."""

    what: str
    """``run DIR`` or ``job ID``."""
    ended: bool
    """The run ended within the timeout."""
    waiting_for: list[str] = field(default_factory=list)
    """With ``ended`` False: what still runs."""
    status: JobStatus | None = None
    """The run's status once it ended (``stopped``, unless something else ended it first)."""


def stop(
    target: str, cwd: Path, *, now: bool, timeout_s: float, say: Callable[[str], None]
) -> StopOutcome:
    """Stop ``target`` and wait (at most ``timeout_s``) until it has ended; ``say`` is told what
    is done and waited for. Raises :class:`~mlaunch.slurm.status.StatusInputError` (neither a
    run directory nor a job) or :class:`StopRefused` (nothing changed), or :class:`StopFailed`."""
    t = resolve_target(target, cwd)
    if t.job_id is not None and t.info is not None:
        return _stop_job(t, cwd, now=now, timeout_s=timeout_s, say=say)
    if t.run_dir is None:
        raise StopRefused(f"{target}: no run directory to stop")
    return _stop_local(t.run_dir, cwd, now=now, timeout_s=timeout_s, say=say)


def _state(run_dir: Path, cwd: Path) -> str:
    return job_status(str(run_dir), cwd).state


def _what_happens(now: bool) -> str:
    return "kill the workers, nothing saved" if now else "finish the iteration, save and exit"


def _stop_local(
    run_dir: Path, cwd: Path, *, now: bool, timeout_s: float, say: Callable[[str], None]
) -> StopOutcome:
    what = f"run {run_dir}"
    plan = local.prepare(run_dir, state=lambda: _state(run_dir, cwd), say=say)
    earlier = plan.earlier
    if earlier is not None and (earlier.now or not now):
        say(f"{what}: a stop was already asked at {_clock(earlier.requested_at)}; waiting for it")
    else:
        local.write_request(run_dir, local.new_request(now))
        sent = local.signal_launchers(plan)
        say(f"{what}: SIGTERM to {', '.join(la.describe() for la in sent) or 'no launcher'}")
    for la in plan.elsewhere:
        say(
            f"note: {la.describe()} runs on another host and was not signalled; its workers stop"
            " with the others' (or run `mlaunch stop` there)"
        )
    say(
        f"waiting for {len(plan.launchers)} launcher(s) to {_what_happens(now)}"
        f" (at most {timeout_s:.0f} s) ..."
    )
    left = local.wait_ended(plan, timeout_s)
    if left:
        return StopOutcome(what, False, [la.describe() for la in left])
    return StopOutcome(what, True, status=job_status(str(run_dir), cwd))


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def _stop_job(
    t: Target, cwd: Path, *, now: bool, timeout_s: float, say: Callable[[str], None]
) -> StopOutcome:
    from mlaunch.slurm.batch import WARNING_SIGNAL

    assert t.job_id is not None and t.info is not None
    job_id, info = t.job_id, t.info
    what = f"job {job_id}"
    state = STATES.get(info.state, info.state.lower())
    if state == "queued":
        raise StopRefused(
            f"{what} is queued, not running: there is nothing to save; `scancel {job_id}`"
            " cancels it"
        )
    if state not in ("running", "suspended"):
        raise StopRefused(f"{what} is {state}, not running: nothing to stop")
    if info.user_id is not None and info.user_id != os.getuid():
        raise StopRefused(
            f"{what} belongs to {local.user_name(info.user_id)}; only the user who submitted it"
            " can stop it"
        )
    if t.run_dir is None:
        raise StopRefused(
            f"{what}: its run directory was not found (looked where SLURM writes its output and"
            f" in runs/{job_id} here): the stop request must go there, or the job would requeue"
            " itself"
        )
    earlier = read_stop_request(t.run_dir, info.start_epoch())
    if earlier is not None and (earlier.now or not now):
        say(f"{what}: a stop was already asked at {_clock(earlier.requested_at)}; waiting for it")
    else:
        request = local.new_request(now, job_id)
        local.write_request(t.run_dir, request)
        try:
            signal_batch(job_id, WARNING_SIGNAL)
        except SlurmError as exc:
            # Not sent: take the request back (the job goes on, and would not requeue otherwise).
            with contextlib.suppress(OSError):
                (t.run_dir / lay.STOP_REQUEST_FILE).unlink()
            raise StopFailed(str(exc)) from None
        say(
            f"{what}: {WARNING_SIGNAL} to its batch script (scancel --signal={WARNING_SIGNAL}"
            f" --batch {job_id}); it will not be requeued"
        )
    say(f"waiting for every node of {what} to {_what_happens(now)} (at most {timeout_s:.0f} s) ...")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            current = job_info(job_id)
        except SlurmError as exc:
            say(f"note: {exc}")
            current = None
        word = STATES.get(current.state, current.state.lower()) if current else "unknown"
        if current is not None and word not in ("running", "suspended"):
            break
        if time.monotonic() >= deadline:
            return StopOutcome(what, False, [f"{what} ({current.state if current else '?'})"])
        time.sleep(SLURM_POLL_S)
    return StopOutcome(what, True, status=job_status(job_id, cwd))
