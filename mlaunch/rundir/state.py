"""One reading of a run directory: :class:`RunState`, which every view uses.

``mlaunch status`` (plain, ``--json`` and ``--watch``), ``mlaunch trace capture``, the report's
marks and default window, train's closing box and SLURM's status all ask it the same questions:
how far training got, whether the run still runs, where each capture is in its life, which
recorder dumps were written, whether a hang is suspected. Each answer is derived here once, from
the typed records (:mod:`.records`), so the views cannot disagree.

A capture has one life, the same for mlaunch and nemo-lens workers:
``requested`` (written, no rank has answered) -> ``scheduled`` (a rank armed it) -> ``running``
(a rank is in its window) -> ``done`` (every rank that answered ended it, at least one with
spans) / ``missed`` (the ranks got to it too late, or the run ended first) / ``refused`` (no
worker could take it: every answer says why not, e.g. a nemo-lens rank without an exporter).
A recorder-only request (``--recorded``) is ``done`` once a rank dumped after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlaunch.rundir.layout import CAPTURE_FINAL_STATES, CAPTURES_LOG_FILE
from mlaunch.rundir.records import (
    Heartbeat,
    LauncherAttempts,
    NodeHangReport,
    ProgressStep,
    RecorderDump,
    append_line,
    capture_answers,
    read_acks,
    read_capture_request,
    read_captures_log,
    read_dumps,
    read_hang_reports,
    read_heartbeats,
    read_launcher_record,
    read_lens_acks,
    read_progress_tail,
)

#: Every phase of a capture, in the order of its life; the last three are final.
CAPTURE_PHASES = ("requested", "scheduled", "running", "done", "missed", "refused")
FINAL_PHASES = frozenset({"done", "missed", "refused"})


@dataclass(frozen=True, slots=True)
class CaptureState:
    """One capture request of the run and where it is in its life."""

    id: str
    phase: str
    #: The span groups it switches on (a spec); None for a recorder-only request.
    groups: str | None
    #: The iterations it covered (the ranks' acks), else the ones it was scheduled for; None
    #: when neither is known (a time window no rank has answered).
    iterations: tuple[int, int] | None
    #: The ranks asked (None: every rank).
    ranks: list[int] | None
    recorded: bool
    created_ns: int | None
    #: The ranks that answered, and how (rank -> its ack state).
    answers: dict[int, str] = field(default_factory=dict)
    note: str | None = None

    @property
    def final(self) -> bool:
        return self.phase in FINAL_PHASES

    def log_record(self) -> dict[str, Any]:
        """Its line of the captures log (:data:`~.layout.CAPTURES_LOG_FILE`)."""
        return {**self.as_json(), "recorded": self.recorded, "created_ns": self.created_ns,
                "answers": {str(r): a for r, a in self.answers.items()}, "note": self.note}  # fmt: skip

    @classmethod
    def from_log(cls, body: dict[str, Any]) -> CaptureState:
        its = body.get("iterations")
        answers = body.get("answers") if isinstance(body.get("answers"), dict) else {}
        return cls(
            str(body["id"]), str(body.get("phase") or "missed"), body.get("groups"),
            (int(its[0]), int(its[1])) if isinstance(its, list) and len(its) == 2 else None,
            body.get("ranks"), bool(body.get("recorded")), body.get("created_ns"),
            {int(r): str(a) for r, a in answers.items()}, body.get("note"),
        )  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        """The ``captures`` entry of ``mlaunch status --json``."""
        return {
            "id": self.id,
            "phase": self.phase,
            "groups": self.groups,
            "iterations": list(self.iterations) if self.iterations else None,
            "ranks": self.ranks,
        }


@dataclass
class RunState:
    """What the run directory says of a run (see the module docstring)."""

    run_dir: Path
    #: Whether no worker is left to answer (the caller's verdict from the launcher record or
    #: SLURM: :meth:`read` takes it, since only SLURM knows a batch job's end).
    ended: bool
    progress: list[ProgressStep] = field(default_factory=list)
    launcher: LauncherAttempts | None = None
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)
    captures: list[CaptureState] = field(default_factory=list)
    dumps: list[RecorderDump] = field(default_factory=list)
    #: Every node's hang report of this launch (node order): merged by the launcher's
    #: :func:`mlaunch.launcher.hang_report.merged_report` for ``mlaunch status``.
    hang_reports: list[NodeHangReport] = field(default_factory=list)

    @classmethod
    def read(
        cls, run_dir: str | Path, *, ended: bool | None = None, since: float | None = None
    ) -> RunState:
        """Read ``run_dir``. ``ended`` None: from node 0's launcher record (ended when it says
        so; a directory without one, whose workers were started some other way, is taken as
        running, as ``mlaunch status`` takes its ``unknown`` state). ``since``: the launch's start (epoch
        seconds); what an earlier launch left (requests, dumps, beats) is not this one's."""
        run_dir = Path(run_dir)
        launcher = read_launcher_record(run_dir)
        if since is None and launcher is not None:
            since = launcher.started
        if ended is None:
            ended = launcher is not None and launcher.ended is not None
        state = cls(run_dir, ended, read_progress_tail(run_dir), launcher)
        state.heartbeats = {
            r: b for r, b in read_heartbeats(run_dir).items() if since is None or b.written >= since
        }
        state.dumps = [d for d in read_dumps(run_dir) if since is None or d.time_ns >= since * 1e9]
        state.hang_reports = read_hang_reports(run_dir, since)

        # A request older than every listening worker's start is one they all ignore (left by an
        # earlier run or incarnation: telemetry/_capture.py's rule), with or without a launcher.
        starts = [int(a.get("started_ns") or 0) for a in read_acks(run_dir).values()]
        first_start = min(starts) if starts else 0

        def this_launch(body: dict[str, Any]) -> bool:
            created = body.get("created_ns")
            if not isinstance(created, int):
                return True
            return created >= first_start and (since is None or created >= since * 1e9)

        for closed in read_captures_log(run_dir):
            if this_launch(closed):
                state.captures.append(state._closed(CaptureState.from_log(closed)))
        request = read_capture_request(run_dir)
        if request is not None and request.get("trigger", "request") != "hang":
            known = {c.id for c in state.captures}
            if this_launch(request) and request.get("id") not in known:
                state.captures.append(state._capture(request))
        return state

    # --- progress -------------------------------------------------------------------------------

    def hang_suspected(self) -> bool:
        """Whether the time since the last progress means anything: only while the run runs (a
        finished run's last progress is simply its end)."""
        return not self.ended

    # --- captures -------------------------------------------------------------------------------

    @property
    def capture(self) -> CaptureState | None:
        """The newest capture request of this launch."""
        return self.captures[-1] if self.captures else None

    def _closed(self, c: CaptureState) -> CaptureState:
        """A logged capture as it stands now: a recorder-only one is done once dumps followed it
        (they outlive the request); one still open when the run ended was missed."""
        if c.final:
            return c
        if c.groups is None:
            body = {"id": c.id, "created_ns": c.created_ns, "ranks": c.ranks, "recorded": True}
            c = self._capture(body)
        if not c.final and self.ended:
            return replace(c, phase="missed", note=c.note or "the run ended before it")
        return c

    def _capture(self, request: dict[str, Any]) -> CaptureState:
        rid = str(request.get("id") or "")
        created = request.get("created_ns") if isinstance(request.get("created_ns"), int) else None
        ranks = request.get("ranks")
        wanted = [int(r) for r in ranks] if isinstance(ranks, list) else None
        live = request.get("start_iteration") is not None or request.get("start_ns") is not None
        groups = str(request.get("groups") or "") if live else None
        acks = read_acks(self.run_dir)
        answers = capture_answers(acks, rid, read_lens_acks(self.run_dir, rid))
        # The ranks that listened when it was written (their process started before it) and
        # that it asks: each must end it before it is over.
        expected = {
            r for r, a in acks.items()
            if int(a.get("started_ns") or 0) <= (created or 0) and (wanted is None or r in wanted)
        }  # fmt: skip
        states = {r: str(a.get("state")) for r, a in answers.items()}
        note = None
        if not live:  # a recorder-only request: done once a rank dumped after it
            dumped = [
                d for d in self.dumps if d.trigger == "request" and d.time_ns >= (created or 0)
            ]
            phase = "done" if dumped else ("missed" if self.ended else "requested")
            if phase == "missed":
                note = "the run ended before a rank dumped its recorder"
            its = _span([d.iterations for d in dumped])
            return CaptureState(rid, phase, None, its, wanted, True, created, states, note)
        if not states:
            phase = "missed" if self.ended else "requested"
        elif self.ended or (
            all(s in CAPTURE_FINAL_STATES for s in states.values()) and expected <= set(states)
        ):
            if any(s == "done" for s in states.values()):
                phase = "done"
            elif all(
                not a.get("applied", True) and a.get("reason") for a in answers.values()
            ) or all(str(a.get("note") or "").startswith("cannot") for a in answers.values()):
                phase, note = "refused", _first_note(answers)
            else:
                phase, note = "missed", _first_note(answers)
        elif "running" in states.values() or any(
            s in CAPTURE_FINAL_STATES for s in states.values()
        ):
            phase = "running"  # some rank is in its window, or past it while others are not yet
        else:
            phase = "scheduled"
        expires = request.get("expires_ns")
        if phase not in FINAL_PHASES and isinstance(expires, int) and time.time_ns() > expires:
            # Its window and the grace after it have passed: a rank never answered (it died,
            # or has no telemetry); what the others captured stands.
            done = any(s == "done" for s in states.values())
            phase, note = ("done" if done else "missed"), "a rank never answered"
        if phase == "missed" and note is None and self.ended:
            note = "the run ended before the capture's window"
        return CaptureState(
            rid, phase, groups, _capture_iterations(request, answers), wanted, bool(request.get("recorded")),
            created, states, note,
        )  # fmt: skip

    # --- the report's window -----------------------------------------------------------------

    def window_includes(self) -> list[tuple[int, int]]:
        """The iterations a report's default window must show besides the first and last: every
        capture's and every recorder dump's (the run model's, whatever the spans carry)."""
        out = [c.iterations for c in self.captures if c.iterations is not None]
        out += [d.iterations for d in self.dumps if d.iterations is not None]
        return sorted(set(out))

    def as_json(self) -> dict[str, Any]:
        """The ``captures`` and ``dumps`` of ``mlaunch status --json``."""
        return {
            "captures": [c.as_json() for c in self.captures],
            "dumps": [d.as_json() for d in self.dumps],
        }


def _span(ranges: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    known = [r for r in ranges if r is not None]
    return (min(lo for lo, _ in known), max(hi for _, hi in known)) if known else None


def _capture_iterations(
    request: dict[str, Any], answers: dict[int, dict[str, Any]]
) -> tuple[int, int] | None:
    """What the ranks say they covered (first..last iteration of their acks), else what the
    request scheduled (start .. start + iterations - 1)."""
    covered = [
        (a["first_iteration"], a.get("last_iteration") or a["first_iteration"])
        for a in answers.values()
        if isinstance(a.get("first_iteration"), int)
    ]
    if covered:
        return _span(covered)  # type: ignore[arg-type]
    start, n = request.get("start_iteration"), request.get("iterations")
    if isinstance(start, int) and isinstance(n, int) and n > 0:
        return (start, start + n - 1)
    return None


def _first_note(answers: dict[int, dict[str, Any]]) -> str | None:
    for _, a in sorted(answers.items()):
        note = a.get("note") or a.get("reason")
        if note:
            return str(note)
    return None


def log_superseded(run_dir: str | Path) -> None:
    """Before a new request replaces the request file (``trace capture``, the hang watchdog):
    the capture it held goes to the captures log with its phase now (its acks are replaced
    next), so the run model keeps every capture of the run."""
    previous = RunState.read(run_dir, ended=False).capture
    if previous is not None and previous.id not in {c["id"] for c in read_captures_log(run_dir)}:
        append_line(Path(run_dir) / CAPTURES_LOG_FILE, previous.log_record())
