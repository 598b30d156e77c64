"""Live capture and the request channel: what ``mlaunch trace capture`` asks of a running worker.

Delivery
    ``mlaunch trace capture`` writes one JSON object to ``RUN_DIR/capture-request.json``
    (``lay.CAPTURE_REQUEST_FILE``). Every rank with telemetry on runs a
    :class:`RequestWatcher` thread that reads it at most once a second (one ``stat`` when it has
    not changed), off the training thread. A request created before this process started (an
    earlier run or incarnation), for another run id, or for other ranks is ignored. Keys: ``id``,
    ``created_ns``, ``run_id``, ``ranks`` (None: all), ``recorded`` (dump the flight recorder),
    and for a live capture ``groups`` (a span spec), ``iterations`` or ``seconds``,
    ``start_iteration`` and ``profiler``. Unknown keys are ignored.

Switching at the same iteration
    The command picks ``start_iteration`` a few seconds' worth of iterations ahead of the
    furthest rank, so every rank reads the request before it gets there. The watcher prepares the
    capture (a :class:`Capture`; on a rank that exports nothing it also builds the exporter) and
    then sets :data:`AT` to the start. The training thread's ``telemetry.set_iteration`` compares
    the iteration with :data:`AT` (the one integer compare the hot path pays) and only at the
    boundary calls in, which switches the enabled groups on, and ``iterations`` later back off.
    ``seconds`` ends the window at the first iteration boundary that many seconds after the
    switch (each rank on its own clock, so ranks may end an iteration apart). A rank that reads
    the request only after the start (a stalled rank) captures what is left of the window; past
    it, the capture is ``missed``. Acknowledgements (:func:`lay.capture_ack_file`) are
    written by the watcher thread, never by the training thread.

The switch
    The worker side of a capture is a small state machine on the training thread
    (:func:`boundary`): ``scheduled`` -> ``running`` at the start iteration (:func:`switch_on`:
    the groups go on, exported and marked with the capture's id; on a rank that exports nothing
    the exporter :func:`prepare_exporter` built off the training thread takes them) -> ``done``
    after the window (:func:`switch_off`); ``scheduled`` -> ``missed`` when the rank is past the
    window, or the run ends first (:func:`end_at_shutdown`). The groups live in the telemetry
    state object (``_core.Core``); ``telemetry`` republishes the span routes after a switch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlaunch.model.spec import SpanSpecError, resolve
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json

if TYPE_CHECKING:
    from mlaunch.telemetry._core import Core, Identity

log = logging.getLogger("mlaunch.telemetry")

NEVER = sys.maxsize
#: The iteration at which ``telemetry.set_iteration`` next calls :func:`boundary`: the start of
#: a scheduled capture, the end of a running one, else :data:`NEVER`. Written by the watcher
#: (scheduling) and the training thread (transitions); one int assignment each, atomic.
AT = NEVER

FINAL_STATES = lay.CAPTURE_FINAL_STATES


@dataclass
class Capture:
    """One live capture on this rank, from the request to its end."""

    id: str
    groups: frozenset[str]
    spec: str
    start: int
    #: The first iteration after the window (``iterations`` form); None for ``seconds``.
    end: int | None
    seconds: float | None
    profiler: bool
    state: str = "scheduled"
    first: int | None = None
    last: int | None = None
    switched_ns: int = 0
    #: Whether this rank's exporter was started for the capture (it exports nothing otherwise).
    exporter_started: bool = False
    profiler_file: str | None = None
    note: str = ""
    #: What the profiler hook's start returned (handed to its stop).
    profiler_handle: Any = None

    def ack(self, rank: int) -> dict[str, Any]:
        """The acknowledgement written for ``mlaunch trace capture --wait``."""
        return {
            "id": self.id,
            "rank": rank,
            "state": self.state,
            "groups": self.spec,
            "start_iteration": self.start,
            "end_iteration": None if self.end is None else self.end - 1,
            "seconds": self.seconds,
            "first_iteration": self.first,
            "last_iteration": self.last,
            "exporter_started": self.exporter_started,
            "profiler": self.profiler,
            "profiler_file": self.profiler_file,
            "note": self.note,
        }


def parse_capture(request: dict[str, Any]) -> Capture:
    """The :class:`Capture` a request asks for; raises ``ValueError`` for a malformed one (the
    command validates first, so this only guards against hand-written files)."""
    spec = str(request.get("groups") or "")
    try:
        groups = frozenset(g.value for g in resolve(spec)) if spec else frozenset()
    except SpanSpecError as exc:
        raise ValueError(str(exc)) from None
    iterations, seconds = request.get("iterations"), request.get("seconds")
    if (iterations is None) == (seconds is None):
        raise ValueError("a capture needs exactly one of iterations and seconds")
    start = int(request["start_iteration"])
    if iterations is not None:
        if int(iterations) < 1:
            raise ValueError("iterations must be at least 1")
        end, secs = start + int(iterations), None
    else:
        if float(seconds) <= 0:
            raise ValueError("seconds must be positive")
        end, secs = None, float(seconds)
    return Capture(
        id=str(request["id"]),
        groups=groups,
        spec=spec,
        start=start,
        end=end,
        seconds=secs,
        profiler=bool(request.get("profiler")),
    )


class Controller:
    """This process's live-capture state (the module-level :data:`CONTROL`)."""

    def __init__(self) -> None:
        self.capture: Capture | None = None
        self.rank = 0
        self.run_dir: Path | None = None
        #: Called by the watcher thread before a capture is armed (``telemetry`` installs it:
        #: it starts the exporter on a rank that has none). Raises to refuse the capture.
        self.prepare: Callable[[Capture], None] | None = None
        self.watcher: RequestWatcher | None = None
        #: Who this rank is, in every ack (the command learns the world size and which ranks
        #: listen from the ``listening`` ack each rank writes when it starts).
        self.identity: dict[str, Any] = {}
        self._acked: tuple[str, str] | None = None
        self._ack_lock = threading.Lock()

    def reset(self) -> None:
        global AT
        AT = NEVER
        self.capture = None
        self.prepare = None
        self._acked = None
        if self.watcher is not None:
            self.watcher.halt()
            self.watcher = None

    def schedule(self, capture: Capture) -> None:
        """Arm ``capture`` (watcher thread). A capture still running here is never replaced."""
        global AT
        current = self.capture
        if current is not None and current.state not in FINAL_STATES:
            log.warning(
                "mlaunch telemetry: capture %s ignored: capture %s is still %s",
                capture.id, current.id, current.state,
            )  # fmt: skip
            return
        try:
            if self.prepare is not None:
                self.prepare(capture)
        except Exception as exc:  # no exporter here (e.g. no SDK): this rank cannot take part
            capture.state, capture.note = "missed", f"cannot export here: {exc}"
            self.capture = capture
            self.write_ack()
            return
        self.capture = capture
        AT = capture.start
        self.write_ack()

    def changed(self) -> None:
        """The training thread moved the capture on: the watcher writes the ack soon."""
        watcher = self.watcher
        if watcher is not None:
            watcher.wake.set()

    def write_ack(self, listening: bool = False, ended: bool = False) -> None:
        """Write the capture's acknowledgement when its state changed since the last one (with
        no capture yet: the ``listening`` ack, when ``listening``). ``ended``: this rank's
        telemetry shuts down, so the ack says it no longer listens (``ended``, or the capture's
        final state with ``ended_ns``): an ack never says ``listening`` after the run. Never
        raises (an unwritable run directory only loses the ack)."""
        capture, run_dir = self.capture, self.run_dir
        if run_dir is None or (capture is None and not listening and self._acked is None):
            return
        with self._ack_lock:
            state = "listening" if capture is None else capture.state
            key = ("" if capture is None else capture.id, "ended" if ended else state)
            if key == self._acked:
                return
            body: dict[str, Any] = {"state": "listening", "id": None, "rank": self.rank}
            if capture is not None:
                body = capture.ack(self.rank)
            if ended:
                body["ended_ns"] = time.time_ns()
                if body["state"] not in FINAL_STATES:
                    body["state"] = "ended"
            body.update(self.identity)
            try:
                write_json(lay.capture_ack_file(run_dir, self.rank), body)
                self._acked = key
            except OSError as exc:
                log.warning("mlaunch telemetry: cannot write the capture ack (%s)", exc)


CONTROL = Controller()


class RequestWatcher(threading.Thread):
    """Reads the run directory's request at most once a second and hands it on: ``recorded`` to
    ``on_recorded`` (the flight recorder's dump), a live capture to :data:`CONTROL`. Also writes
    the capture's acknowledgements when the training thread wakes it.

    Under ``mlaunch train`` it also keeps this rank's progress beat (``heartbeat``, rewritten
    when ``mark()`` moved; written at once when ``telemetry_off`` says why this rank's telemetry
    is off, so the launcher can say so before the first iteration) and answers a ``trigger: "hang"`` request itself, on this thread
    (``on_hang``): the training thread is presumed stuck, so what the launcher's hang watchdog
    asks for cannot wait for an iteration boundary that may never come."""

    INTERVAL_S = 1.0

    def __init__(
        self,
        path: Path,
        run_id: str,
        rank: int,
        started_ns: int,
        on_recorded: Callable[[], None],
        announce: bool = True,
        *,
        captures: bool = True,
        heartbeat: Path | None = None,
        mark: Callable[[], tuple[int, float] | None] | None = None,
        on_hang: Callable[[str, bool], None] | None = None,
        telemetry_off: str | None = None,
    ) -> None:
        super().__init__(name="mlaunch-capture-watch", daemon=True)
        self.telemetry_off = telemetry_off
        self.announce = announce
        self.path, self.run_id, self.rank, self.started_ns = path, run_id, rank, started_ns
        self.on_recorded = on_recorded
        self.captures = captures
        self.heartbeat, self.mark, self.on_hang = heartbeat, mark, on_hang
        self.wake = threading.Event()
        self.stopped = False
        self.seen: set[str] = set()
        self._mtime = 0
        self._warned = False
        self._beat: tuple[int, float] | None = None
        self._beat_fd: int | None = None
        self._beat_width = HEARTBEAT_WIDTH

    def halt(self) -> None:
        self.stopped = True
        self.wake.set()

    def run(self) -> None:
        if self.announce:
            CONTROL.write_ack(listening=True)  # this rank takes requests
        try:
            if self.telemetry_off is not None:
                with contextlib.suppress(Exception):
                    self.beat(first=True)
            while True:
                self.wake.wait(self.INTERVAL_S)
                self.wake.clear()
                if self.stopped:
                    return
                try:
                    self.beat()
                    self.poll()
                except Exception as exc:  # a bad request never stops training or the watcher
                    if not self._warned:
                        self._warned = True
                        log.warning("mlaunch telemetry: ignoring capture request (%s)", exc)
                if self.captures:
                    CONTROL.write_ack()
        finally:
            if self._beat_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._beat_fd)
                self._beat_fd = None

    def beat(self, first: bool = False, ended: bool = False) -> None:
        """Write the progress beat when the iteration moved (or, ``first``, before any): one
        ``pwrite`` of a fixed-width line into a file opened once (no rename, no new inode: cheap
        on a shared file system). ``telemetry`` (when set) says why this rank's telemetry is off.
        ``ended``: the last beat, at shutdown, whatever moved (the beats are once a second, so
        without it a run's last iterations would never reach the file), marked ``ended``."""
        mark = self.mark() if self.mark is not None else None
        if self.heartbeat is None or (
            not first and not ended and (mark is None or mark == self._beat)
        ):
            return
        if self._beat_fd is None:
            self.heartbeat.parent.mkdir(parents=True, exist_ok=True)
            # Truncated once: an earlier process's beat may be longer than this one's lines.
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            self._beat_fd = os.open(self.heartbeat, flags, 0o644)
        beat: dict[str, Any] = {
            "rank": self.rank,
            "iteration": mark[0] if mark else None,
            "time": mark[1] if mark else None,
            "pid": os.getpid(),
        }
        if self.telemetry_off is not None:
            beat["telemetry_off"] = self.telemetry_off
        if ended:
            beat["ended"] = True
        body = json.dumps(beat)
        # Never narrower than an earlier write: a shorter line must cover all of the longer one.
        self._beat_width = max(self._beat_width, len(body))
        os.pwrite(self._beat_fd, body.ljust(self._beat_width).encode() + b"\n", 0)
        self._beat = mark

    def poll(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        request = json.loads(self.path.read_text(encoding="utf-8"))
        rid = str(request.get("id", ""))
        if not rid or rid in self.seen:
            return
        self.seen.add(rid)
        if int(request.get("created_ns", 0)) < self.started_ns:
            return  # left behind by an earlier run or incarnation
        if request.get("run_id") and request["run_id"] != self.run_id:
            return
        ranks = request.get("ranks")
        if ranks is not None and self.rank not in ranks:
            return
        if request.get("trigger", "request") == "hang":
            if self.on_hang is not None:
                self.on_hang(rid, bool(request.get("open_spans")))
            return
        if request.get("recorded"):
            self.on_recorded()
        if self.captures and (request.get("groups") or request.get("profiler")):
            CONTROL.schedule(parse_capture(request))


#: Bytes of a progress beat's JSON (space padded, so a shorter rewrite leaves no stale tail).
HEARTBEAT_WIDTH = 160


def start_watcher(
    identity: Identity,
    started_ns: int,
    on_recorded: Callable[[], None],
    *,
    exporting: bool,
    announce: bool = True,
    prepare: Callable[[Capture], None] | None = None,
    captures: bool = True,
    heartbeat: Path | None = None,
    mark: Callable[[], tuple[int, float] | None] | None = None,
    on_hang: Callable[[str, bool], None] | None = None,
    telemetry_off: str | None = None,
) -> None:
    """Watch the run directory's request file for this rank (``identity``: the worker's, as
    ``setup`` derived it) and write its capture acks there. ``announce``: write the
    ``listening`` ack now (a run that keeps no files, the console or ``none`` exporter, writes
    acks only once a request came). ``captures`` False (telemetry off): only the progress beat
    and the hang watchdog's requests."""
    run_dir, run_id, rank = Path(identity.run_dir), identity.run_id, identity.rank
    CONTROL.reset()
    CONTROL.rank, CONTROL.run_dir = rank, run_dir
    CONTROL.prepare = prepare
    CONTROL.identity = {
        "run_id": run_id,
        "world_size": identity.world_size,
        "exporting": exporting,
        "started_ns": started_ns,
        "pid": os.getpid(),
    }
    watcher = RequestWatcher(
        run_dir / lay.CAPTURE_REQUEST_FILE,
        run_id,
        rank,
        started_ns,
        on_recorded,
        announce,
        captures=captures,
        heartbeat=heartbeat,
        mark=mark,
        on_hang=on_hang,
        telemetry_off=telemetry_off,
    )
    CONTROL.watcher = watcher
    watcher.start()


def stop_watcher() -> None:
    """Stop the watcher at shutdown: the last beat (this rank's final iteration) and the last
    ack are written first, both marked ended, so neither outlives the run as a live rank's."""
    watcher = CONTROL.watcher
    if watcher is not None:
        watcher.halt()  # its thread writes nothing more: the final beat and ack are these
        with contextlib.suppress(Exception):
            watcher.join(timeout=2.0)
        with contextlib.suppress(Exception):
            watcher.beat(ended=True)
    with contextlib.suppress(Exception):
        CONTROL.write_ack(ended=True)
    CONTROL.reset()


# ------------------------------------------------------------------------------------------------
# The switch: the worker side of a live capture, on the training thread
#
# scheduled -> running (at ``start``: the capture's groups go on) -> done (after the window:
# back off); scheduled -> missed (past the window before this rank got there, or the run ended
# first). The groups live in the telemetry state object (``_core.Core``): the switch changes
# ``core.captured`` / ``core.capturing`` and returns True, and ``telemetry.set_iteration``
# republishes the span routes the hot path reads.


def boundary(core: Core, iteration: int) -> bool:
    """The training thread reached :data:`AT`: start, continue or end the capture. While a
    capture runs this is called at every iteration (it notes how far the window got, so a run
    that ends inside it acks the right last iteration); outside one, never. Returns whether the
    enabled groups changed. Never raises (a failure ends the capture here)."""
    global AT
    capture = CONTROL.capture
    try:
        if capture is None or capture.state in FINAL_STATES:
            AT = NEVER
            return False
        if capture.state == "scheduled":
            if capture.end is not None and iteration >= capture.end:
                capture.state, capture.note = "missed", f"this rank was at iteration {iteration}"
                AT = NEVER
                CONTROL.changed()
                return False
            switch_on(core, capture, iteration)
            capture.last = iteration
            AT = iteration + 1
            CONTROL.changed()
            return True
        if iteration == capture.last:  # set_iteration again for the same iteration
            return False
        if capture.end is not None:
            over = iteration >= capture.end
        else:
            over = time.time_ns() >= capture.switched_ns + int(capture.seconds * 1e9)  # type: ignore[operator]
        if not over:
            capture.last = iteration
            AT = iteration + 1
            return False
        switch_off(core, capture)
        AT = NEVER
        CONTROL.changed()
        return True
    except Exception as exc:  # telemetry never breaks training: the capture ends here
        log.warning("mlaunch telemetry: live capture failed (%s)", exc)
        AT = NEVER
        if capture is not None and capture.state == "running":
            with contextlib.suppress(Exception):
                switch_off(core, capture)
        if capture is not None:
            capture.state, capture.note = "done", f"ended early: {exc}"
        CONTROL.changed()
        return True


def switch_on(core: Core, capture: Capture, iteration: int) -> None:
    """The capture's groups on, from ``iteration``: exported (not recorded) and marked with its
    id; on a rank that exports nothing, the exporter ``prepare_exporter`` built takes them."""
    if core.runtime is None and core.capture_runtime is not None:
        core.capture_runtime.install_spans(iteration)
    core.captured = capture.groups - core.exported
    core.capture_id = capture.id
    core.capturing = True  # the capture runtime's set_iteration keeps the block trace ids
    capture.state, capture.first, capture.switched_ns = "running", iteration, time.time_ns()
    if capture.profiler:
        _start_profiler(core, capture)


def switch_off(core: Core, capture: Capture) -> None:
    """The capture's groups back off (the exported and recorded ones as before it)."""
    core.capturing = False
    core.captured = frozenset()
    capture.state = "done"
    if capture.profiler_handle is not None:
        _stop_profiler(core, capture)


def end_at_shutdown(core: Core) -> None:
    """A capture still running when the job ends (its last iteration was the run's) ends here,
    and its ack is written before the watcher stops."""
    global AT
    capture = CONTROL.capture
    AT = NEVER
    if capture is None:
        return
    if capture.state == "running":
        switch_off(core, capture)
    elif capture.state == "scheduled":
        capture.state, capture.note = "missed", "the run ended before the capture started"


def prepare_exporter(core: Core, capture: Capture) -> None:
    """Before a capture is armed (the watcher thread): on a rank that exports nothing, build
    the exporter now, off the training thread, with the run's settings (the same sink: file,
    OTLP or the embedded receiver), traces only and no rank sampling; the training thread
    installs it at the switch. It stays, idle, for later captures until shutdown."""
    settings, identity = core.settings, core.identity
    if settings is None or identity is None:
        raise RuntimeError("telemetry is not set up")
    if core.runtime is not None:
        return  # this rank exports: its runtime takes the captured spans
    capture.exporter_started = True
    if core.capture_runtime is not None:
        return
    from mlaunch.telemetry._runtime import Runtime

    settings = settings.model_copy(
        update={
            "traces_enabled": True,
            "metrics_enabled": False,
            "logs_enabled": False,
            "sampler_enabled": False,
        }
    )
    core.capture_runtime = Runtime(settings, identity, environ=os.environ, install_now=False)


def _start_profiler(core: Core, capture: Capture) -> None:
    hooks, identity = core.profiler_hooks, core.identity
    if hooks is None or identity is None:
        capture.note = "no profiler here: the worker registered none (mlaunch's trainer does)"
        return
    path = lay.profiler_trace_file(identity.run_dir, identity.rank, capture.id)
    try:
        capture.profiler_handle = hooks[0](path)
        capture.profiler_file = str(path)
    except Exception as exc:
        capture.note = f"profiler did not start: {exc}"


def _stop_profiler(core: Core, capture: Capture) -> None:
    handle, capture.profiler_handle = capture.profiler_handle, None
    try:
        core.profiler_hooks[1](handle, profiler_metadata(core.identity, capture))  # type: ignore[index]
    except Exception as exc:
        capture.note = f"profiler trace not written: {exc}"
        capture.profiler_file = None


def profiler_metadata(identity: Identity | None, capture: Capture) -> dict[str, Any]:
    """What a profiler trace carries to tie it to the run's spans: the capture, the rank and
    the trace ids of the ``megatron.train`` blocks the window covers."""
    from mlaunch.model.segments import DEFAULT_SEGMENT_ITERS, train_block
    from mlaunch.telemetry._spans import segment_trace_id

    first = capture.first or capture.start
    last = capture.last if capture.last is not None else first
    per = identity.block_iters if identity is not None else DEFAULT_SEGMENT_ITERS
    run_id = identity.run_id if identity is not None else ""
    incarnation = identity.incarnation if identity is not None else ""
    blocks = sorted({train_block(it, per) for it in range(first, last + 1)})
    return {
        "mlaunch.capture.id": capture.id,
        "mlaunch.run_id": identity.run_id if identity is not None else None,
        "rank": identity.rank if identity is not None else None,
        "first_iteration": first,
        "last_iteration": last,
        "trace_ids": [f"{segment_trace_id(run_id, incarnation, b):032x}" for b in blocks],
    }
