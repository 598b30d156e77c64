"""``mlaunch trace capture``: write a request into a running run's directory, which every worker
reads at most once a second off its training thread (``mlaunch.telemetry._capture``), and, with
``--wait``, follow the workers' acknowledgements until the capture is over.

A live capture (``--groups SPEC`` with ``--iterations N`` or ``--seconds S``) starts at one
iteration on every selected rank: the command picks it ahead of the furthest rank (the newest
``progress.jsonl`` record) by at least :data:`LEAD_S` seconds of iterations (at least
:data:`MIN_LEAD_ITERS`), so every watcher has read the request (once a second) and prepared the
switch before its rank gets there.

The request carries its creation time and the run id when the run directory names one: a worker
started after the request was written (a later run in the same directory, a restart, a requeue)
ignores it, so a request left behind never applies to a later run or incarnation. It works for a
multi-node job whose run directory is shared (SLURM runs already need a shared ``--save``); with
a run directory local to each node, run the command on every node.
"""

from __future__ import annotations

import json
import math
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.launcher.run_status import LIVE_STATES, JobStatus
from mlaunch.lens_hook import START_LEAD_S
from mlaunch.model.spec import SpanSpecError, format_groups, resolve
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json
from mlaunch.rundir.records import (
    capture_answers,
    read_acks,
    read_capture_request,
    read_dumps,
    read_lens_acks,
    read_progress_tail,
)
from mlaunch.rundir.state import RunState, log_superseded
from mlaunch.settings import recorded_off_reason

#: How far ahead of the furthest rank a capture starts, in seconds of its iterations: the
#: watchers read the request at most a second after it is written, and a rank that exports
#: nothing builds its exporter before arming the switch.
LEAD_S = 5.0
MIN_LEAD_ITERS = 3
#: Progress records whose step times set the lead (the newest ones).
STEP_SAMPLES = 20
#: After its expected end, how long a capture without every ack still counts as running (a
#: slow rank may be behind), and how long ``--wait`` waits for the last acks.
GRACE_S = 60.0


#: The setting of the flight recorder's groups in ``resolved.json`` (empty: no recorder).
RECORDER_SETTING = "telemetry.recorder_groups"


class CaptureInputError(ValueError):
    """A request that cannot be made (one line for the user; nothing was written)."""


@dataclass
class CaptureRequest:
    """What was written, for the command's output."""

    id: str
    run_dir: Path
    ranks: list[int] | None
    recorded: bool
    iteration: int | None
    groups: str | None = None
    iterations: int | None = None
    seconds: float | None = None
    start_iteration: int | None = None
    profiler: bool = False
    #: Ranks expected to answer (from their ``listening`` acks); None when no rank has one.
    expected_ranks: list[int] | None = None
    #: Ranks that export nothing under the run's strategy: their exporter starts for it.
    exporter_started: list[int] = field(default_factory=list)
    #: A ``--script``/``--module`` run (its workers may trace through nemo-lens): the ranks whose
    #: nemo-lens can capture and, for each other rank, why not (:func:`lens_capture_ranks`).
    lens_ranks: list[int] | None = None
    lens_cannot: dict[int, str] = field(default_factory=dict)
    #: Filled by :func:`wait_for_capture`: each rank's last ack.
    outcome: dict[int, dict[str, Any]] | None = None
    waited: bool = False

    @property
    def live(self) -> bool:
        return self.start_iteration is not None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "run_dir": str(self.run_dir),
            "ranks": "all" if self.ranks is None else self.ranks,
            "recorded": self.recorded,
            "iteration": self.iteration,
            "request_file": str(self.run_dir / lay.CAPTURE_REQUEST_FILE),
        }
        if self.live:
            out.update(
                {
                    "groups": self.groups,
                    "iterations": self.iterations,
                    "seconds": self.seconds,
                    "start_iteration": self.start_iteration,
                    "end_iteration": (
                        self.start_iteration + self.iterations - 1  # type: ignore[operator]
                        if self.iterations is not None
                        else None
                    ),
                    "profiler": self.profiler,
                    "expected_ranks": self.expected_ranks,
                    "exporter_started": self.exporter_started,
                }
            )
            if self.lens_ranks is not None:
                out["nemo_lens"] = {
                    "ranks": self.lens_ranks,
                    "cannot": {str(r): why for r, why in sorted(self.lens_cannot.items())},
                }
        if self.waited:
            out["outcome"] = (
                {str(r): ack for r, ack in sorted(self.outcome.items())}
                if self.outcome is not None
                else None
            )
            out["complete"] = self.complete
        return out

    @property
    def complete(self) -> bool:
        """Every expected rank acknowledged this capture with a final state."""
        if self.outcome is None or not self.expected_ranks:
            return False
        return all(
            self.outcome.get(r, {}).get("state") in lay.CAPTURE_FINAL_STATES
            for r in self.expected_ranks
        )


def parse_ranks(text: str) -> list[int] | None:
    """``all`` -> None, ``0,3`` -> [0, 3]; raises :class:`CaptureInputError` otherwise."""
    text = text.strip().lower()
    if text == "all":
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise CaptureInputError(f"--ranks: {part!r} is not a rank; use all or R,R,...")
        out.append(int(part))
    return sorted(set(out))


def _resolved(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _world_size(run_dir: Path, acks: dict[int, dict[str, Any]]) -> int | None:
    """The run's world size: ``resolved.json``'s (an ``mlaunch train`` run), else the largest
    one a rank's ack names (a worker started some other way)."""
    value = _resolved(run_dir).get("world_size")
    if isinstance(value, int) and value > 0:
        return value
    sizes = [a["world_size"] for a in acks.values() if isinstance(a.get("world_size"), int)]
    return max(sizes) if sizes else None


def _setting(run_dir: Path, key: str) -> Any:
    """One setting's value from ``resolved.json`` (``telemetry.enabled``), None when unknown."""
    entry = (_resolved(run_dir).get("settings") or {}).get(key)
    return entry.get("value") if isinstance(entry, dict) else None


def _run_id(run_dir: Path) -> str | None:
    value = _resolved(run_dir).get("run_id")
    return str(value) if value else None


def _recent_steps(run_dir: Path) -> tuple[int | None, float | None]:
    """The newest iteration in ``progress.jsonl`` and the median step time (s) of the newest
    records."""
    iteration: int | None = None
    steps: list[float] = []
    for record in reversed(read_progress_tail(run_dir)):
        if not isinstance(record.iteration, int):
            continue
        iteration = record.iteration if iteration is None else iteration
        if isinstance(record.step_ms, int | float) and record.step_ms > 0:
            steps.append(record.step_ms / 1e3)
        if len(steps) >= STEP_SAMPLES:
            break
    return iteration, (statistics.median(steps) if steps else None)


def _window(
    groups: str | None, iterations: int | None, seconds: float | None, profiler: bool
) -> str | None:
    """Check the live-capture flags; returns the spec's groups as text (None: no live capture)."""
    live = groups is not None or profiler
    if not live:
        if iterations is not None or seconds is not None:
            flag = "--iterations" if iterations is not None else "--seconds"
            raise CaptureInputError(f"{flag} needs --groups SPEC (or --profiler): what to capture")
        return None
    if (iterations is None) == (seconds is None):
        raise CaptureInputError(
            "a live capture needs exactly one of --iterations N and --seconds S"
        )
    if iterations is not None and iterations < 1:
        raise CaptureInputError(f"--iterations {iterations}: capture at least 1 iteration")
    if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
        raise CaptureInputError(f"--seconds {seconds}: give a positive number of seconds")
    if groups is None:
        return ""
    try:
        resolved = resolve(groups)
    except SpanSpecError as exc:
        raise CaptureInputError(f"--groups: {exc}") from None
    if not resolved:
        raise CaptureInputError(f"--groups {groups!r} names no group; try --groups all")
    return format_groups(resolved)


def running_capture(run_dir: Path, run_id: str | None) -> str | None:
    """The id of a live capture of this run that is not over (the run model's phase), else
    None."""
    capture = RunState.read(run_dir, ended=False).capture
    request = read_capture_request(run_dir) or {}
    if capture is None or capture.final or capture.groups is None:
        return None
    if run_id and request.get("run_id") and request["run_id"] != run_id:
        return None
    return capture.id


def request_capture(
    target: str,
    status: Callable[[], JobStatus],
    *,
    recorded: bool,
    ranks: str,
    groups: str | None = None,
    iterations: int | None = None,
    seconds: float | None = None,
    profiler: bool = False,
) -> CaptureRequest:
    """Validate and write the request; raises :class:`CaptureInputError` (nothing written).

    ``status`` looks up the job ``target`` names (``mlaunch.slurm.status.job_status``, which sits
    above the launcher, so the caller passes it in) and raises :class:`CaptureInputError` when
    the target names no job; it is called only once the arguments themselves are valid, so a bad
    spec, window or rank list is reported before an unknown target.
    """
    spec = _window(groups, iterations, seconds, profiler)
    if spec is None and not recorded:
        raise CaptureInputError(
            "nothing to capture: pass --groups SPEC with --iterations N or --seconds S"
            " (a live capture), or --recorded (dump the flight recorders)"
        )
    wanted = parse_ranks(ranks)
    st = status()
    if st.run_dir is None:
        raise CaptureInputError(f"{target}: no run directory found for it")
    run_dir = Path(st.run_dir)
    if st.state not in LIVE_STATES:
        # Completed, failed, stopped by a signal (preempted, interrupted), or its launcher died:
        # no worker is left to read a request.
        raise CaptureInputError(
            f"{run_dir}: the run has {st.state.replace('_', ' ')} (it is not running);"
            " no worker is left to capture"
        )
    script_run = bool(_setting(run_dir, "launch.script") or _setting(run_dir, "launch.module"))
    if not st.progress and not (script_run and spec is not None and seconds is not None):
        raise CaptureInputError(
            f"{run_dir}: no training progress yet ({lay.PROGRESS_FILE}); capture once it trains"
            + (
                " (a Megatron-LM/nemo-lens worker writes none: capture it by time, --seconds S)"
                if script_run
                else ""
            )
        )
    acks = read_acks(run_dir)
    world = _world_size(run_dir, acks)
    if wanted is not None and world is not None and (bad := [r for r in wanted if r >= world]):
        raise CaptureInputError(
            f"--ranks: rank {bad[0]} is not in this run (world size {world}: ranks 0-{world - 1})"
        )
    if (off := recorded_off_reason(_resolved(run_dir).get("settings") or {})) is not None:
        raise CaptureInputError(
            f"{run_dir}: telemetry is off in this run ({off}): no worker watches for requests"
        )
    if recorded and _setting(run_dir, RECORDER_SETTING) == "":
        raise CaptureInputError(
            f"{run_dir}: this run has no flight recorder (--otel-recorder-groups was empty at"
            " launch), so --recorded has nothing to dump; launch with --otel-recorder-groups SPEC"
        )
    run_id = _run_id(run_dir)
    if (busy := running_capture(run_dir, run_id)) is not None:
        raise CaptureInputError(
            f"{run_dir}: capture {busy} is still running; wait for it"
            f" (mlaunch trace capture ... --wait) or until its window has passed"
        )
    now = time.time_ns()
    req = CaptureRequest(
        id=secrets.token_hex(6),
        run_dir=run_dir,
        ranks=wanted,
        recorded=recorded,
        iteration=(st.progress or {}).get("iteration"),
    )
    body: dict[str, Any] = {
        "id": req.id,
        "created_ns": now,
        "run_id": run_id,
        "ranks": wanted,
        "recorded": recorded,
    }
    if spec is not None:
        latest, step_s = _recent_steps(run_dir)
        latest = latest if latest is not None else int(req.iteration or 0)
        step_s = step_s or 1.0
        lead = max(MIN_LEAD_ITERS, math.ceil(LEAD_S / step_s))
        # The furthest rank may be one iteration past the one that writes progress (a pipeline's
        # first stage): one more iteration of margin.
        req.start_iteration = latest + lead + 1
        req.groups, req.iterations, req.seconds, req.profiler = (
            groups, iterations, seconds, profiler,
        )  # fmt: skip
        window_s = (lead + 1) * step_s + (seconds if seconds is not None else iterations * step_s)  # type: ignore[operator]
        body.update(
            {
                "groups": groups or "",
                "iterations": iterations,
                "seconds": seconds,
                "start_iteration": req.start_iteration,
                "profiler": profiler,
                # Where a time window starts for nemo-lens workers (mlaunch.lens_hook), which
                # cannot see iterations: far enough ahead that every rank has read the request.
                "start_ns": now + int(START_LEAD_S * 1e9) if seconds is not None else None,
                # Command-side only (workers ignore it): when a capture that never got every
                # ack stops counting as running.
                "expires_ns": now + int((2 * window_s + GRACE_S) * 1e9),
            }
        )
        listening = sorted(
            r for r, a in acks.items() if run_id is None or a.get("run_id") in (None, run_id)
        )
        if listening:
            req.expected_ranks = [r for r in listening if wanted is None or r in wanted]
            req.exporter_started = [
                r for r in req.expected_ranks if acks[r].get("exporting") is False
            ]
        if script_run:
            req.lens_ranks, req.lens_cannot = lens_capture_ranks(run_dir)
            if wanted is not None:
                req.lens_ranks = [r for r in req.lens_ranks if r in wanted]
                req.lens_cannot = {r: w for r, w in req.lens_cannot.items() if r in wanted}
            if not listening and seconds is not None:
                # No mlaunch.telemetry worker said it listens: nemo-lens workers answer instead.
                req.expected_ranks = req.lens_ranks or None
    log_superseded(run_dir)
    write_json(run_dir / lay.CAPTURE_REQUEST_FILE, body)  # a worker never reads half a request
    return req


def wait_for_capture(
    req: CaptureRequest, poll_s: float = 0.2, timeout_s: float | None = None
) -> CaptureRequest:
    """Follow the acks until every expected rank ended the capture (done or missed), the run
    finished, or the capture's window plus :data:`GRACE_S` has passed; fills ``req.outcome``."""
    req.waited = True
    body = read_capture_request(req.run_dir) or {}
    if not req.live:
        return _wait_for_dumps(req, body, poll_s, timeout_s)
    expires = int(body.get("expires_ns") or 0) / 1e9
    deadline = time.time() + timeout_s if timeout_s is not None else max(expires, time.time() + 10)
    while True:
        acks = read_acks(req.run_dir)
        if req.expected_ranks is None:
            listening = sorted(acks)
            req.expected_ranks = [
                r for r in listening if req.ranks is None or r in req.ranks
            ] or None
        req.outcome = capture_answers(acks, req.id, read_lens_acks(req.run_dir, req.id))
        if req.complete or time.time() >= deadline:
            return req
        time.sleep(poll_s)


def lens_capture_ranks(run_dir: Path) -> tuple[list[int], dict[int, str]]:
    """For a run whose workers trace through nemo-lens (``--script``/``--module``): ``(the ranks
    that will capture, {rank: why it cannot})``, from the run's ``resolved.json``.

    A nemo-lens worker can switch groups only where nemo-lens built an exporter: on the ranks the
    export strategy leaves out it installed no-op providers, so nothing traced there goes anywhere
    (mlaunch's own trainer starts an exporter on demand instead). Both empty when the run directory
    has no readable ``resolved.json``.
    """
    try:
        data = json.loads((Path(run_dir) / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
        world = int(data["world_size"])
        exporting = sorted(int(r) for r in data.get("exporting_ranks") or ())
        settings = data.get("settings") or {}
    except (OSError, ValueError, KeyError, TypeError):
        return [], {}

    def value(path: str) -> Any:
        entry = settings.get(path)
        return entry.get("value") if isinstance(entry, dict) else None

    off = None
    if not value("telemetry.enabled"):
        why = recorded_off_reason(settings) or "--otel-enabled to turn it on"
        off = f"telemetry is off in this run ({why})"
    elif value("telemetry.traces_enabled") is False:
        off = "traces are off in this run (TRACES_ENABLED=false)"
    elif value("telemetry.otel.sdk_disabled"):  # a record written before the switch was resolved
        off = f"{ec.OTEL_SDK_DISABLED} is set in this run"
    if off is not None:
        return [], {r: off for r in range(world)}
    strategy = value("telemetry.export_strategy") or "single_rank"
    why = (
        f"it does not export under the run's export strategy {strategy!r}: nemo-lens built no"
        " exporter there (use --otel-export-strategy all_ranks at launch to capture every rank)"
    )
    return exporting, {r: why for r in range(world) if r not in exporting}


def _wait_for_dumps(
    req: CaptureRequest, body: dict[str, Any], poll_s: float, timeout_s: float | None
) -> CaptureRequest:
    """``--recorded --wait``: until every expected rank has written the dump the request asked
    for (its recorder's index says so), the run ended, or :data:`GRACE_S` has passed."""
    created = int(body.get("created_ns") or time.time_ns())
    deadline = time.time() + (timeout_s if timeout_s is not None else GRACE_S)
    if req.expected_ranks is None:
        world = _world_size(req.run_dir, read_acks(req.run_dir))
        every = list(range(world)) if world else None
        req.expected_ranks = req.ranks if req.ranks is not None else every
    while True:
        req.outcome = {}
        for d in read_dumps(req.run_dir):
            if d.trigger == "request" and d.time_ns >= created:
                lo, hi = d.iterations or (None, None)
                req.outcome[d.rank] = {
                    "state": "done", "first_iteration": lo, "last_iteration": hi,
                    "note": f"{d.spans} spans written",
                }  # fmt: skip
        if req.expected_ranks is None and req.outcome:
            req.expected_ranks = sorted(req.outcome)
        if req.complete or time.time() >= deadline:
            return req
        if RunState.read(req.run_dir).ended:
            return req
        time.sleep(poll_s)
