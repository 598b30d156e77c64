"""The worker side of a live capture in a nemo-lens worker: a daemon thread that reads the run
directory's capture request at most once a second and switches nemo-lens's enabled span groups
for the request's time window, through nemo-lens's public setter
``nemo.lens.state.set_enabled_span_groups`` (read by ``is_span_group_enabled`` at every call site).

Time-aligned, not iteration-aligned: a nemo-lens worker has no iteration counter mlaunch can read.
The request names a wall-clock window, ``start_ns`` (default: its ``created_ns``) for ``seconds``;
every rank switches at ``start_ns`` (the watcher sleeps until then once it has seen the request)
and back at ``start_ns + seconds``, so ranks agree to within their clocks and a thread wake-up.
A request seen after its start is applied at once and still ends on time; one seen after its end,
or with only ``iterations``, is answered without being applied.

During the window the enabled groups are the worker's own plus the captured ones (the run's coarse
spans stay on, so the captured spans nest under them); afterwards the worker's own set is restored.
Only a rank whose nemo-lens built an exporter can capture: on the others nemo-lens installed no-op
providers, and spans go nowhere whatever the set says.

Each rank named by a request answers with ``telemetry/capture-ack-rank{R}-{id}.json``:
``id``, ``rank``, ``pid``, ``applied`` (bool), ``reason`` (why not, else null), ``groups`` (the set
during the window), ``previous`` (the set restored after it), ``start_ns`` and ``end_ns`` (the
requested window), ``applied_ns`` (taken just before the switch) and ``ended_ns`` (just after the
switch back; null while the capture runs). Every fine span of the capture starts between the two.

Never stops the worker: a bad request file is logged once and ignored, a bad request for this
rank is answered with its reason, and an error in the thread is logged once. Loaded by path (the
worker's interpreter may not have mlaunch), so it imports only the standard library at the top;
resolving a span-group spec loads mlaunch's own resolver (:mod:`mlaunch.model.spec`) when a
request arrives.
"""

from __future__ import annotations

import os
import sys
import threading
import time

# No `typing` import: this module loads at every worker start (typing alone costs ~5 ms).

# Copies of mlaunch.envcontract's names: this file runs in interpreters that cannot import mlaunch
# at start-up (tests/unit/test_lens_hook.py keeps them equal).
RUN_DIR = "MLAUNCH_RUN_DIR"
RUN_ID = "MEGATRON_OTEL_RUN_ID"
CAPTURE_REQUEST_FILE = "capture-request.json"
TELEMETRY_DIR = "telemetry"
CAPTURE_ACK_TEMPLATE = "capture-ack-rank{rank}-{id}.json"

#: The watcher thread's name (one per process).
THREAD_NAME = "mlaunch-lens-capture"
#: How often the request file is looked at (a ``stat``; read only when it changed).
POLL_S = 1.0
#: The longest window a request may ask for (a year: longer is a typo, or infinity).
MAX_SECONDS = 365 * 86400.0
#: What every log line of this module starts with (the worker's stderr, i.e. its rank log).
LOG_PREFIX = "mlaunch lens capture: "

_NS = 1_000_000_000


class Lens:
    """nemo-lens as this process has it, looked up in ``sys.modules``: never imported from here,
    so a worker that does not use nemo-lens never loads it."""

    def status(self) -> bool | None:
        """None: nemo-lens is not set up in this process (yet); False: set up with no exporter on
        this rank (no-op providers); True: set up with one."""
        state = sys.modules.get("nemo.lens.state")
        handle = sys.modules.get("nemo.lens.handle")
        trace = sys.modules.get("opentelemetry.trace")
        if state is None or handle is None or trace is None:
            return None
        provider = trace.get_tracer_provider()
        if type(provider).__name__ == "ProxyTracerProvider":
            return None  # setup_telemetry has not set a provider yet
        # build_providers installs the SDK's TracerProvider, build_noop_providers a no-op one.
        return hasattr(provider, "add_span_processor")

    def groups(self) -> frozenset[str]:
        """The enabled groups now. nemo-lens has a setter but no getter: the module-level set the
        setter replaces is read directly (probing names would lose groups mlaunch does not know)."""
        return frozenset(sys.modules["nemo.lens.state"]._ENABLED_GROUPS)

    def set_groups(self, groups: frozenset[str]) -> None:
        """nemo-lens's public setter (it takes its lock and replaces the set)."""
        sys.modules["nemo.lens.state"].set_enabled_span_groups(frozenset(groups))


class Request:
    """A live-capture request addressed to this rank, checked."""

    __slots__ = ("id", "groups", "start_ns", "end_ns")

    def __init__(self, rid: str, groups: frozenset[str], start_ns: int, end_ns: int) -> None:
        self.id, self.groups, self.start_ns, self.end_ns = rid, groups, start_ns, end_ns


class Refused(ValueError):
    """A request for this rank that cannot be applied (the reason goes into the ack)."""


def _load_mlaunch() -> None:
    """Make ``import mlaunch.<standard-library module>`` work: the mlaunch next to this file is
    loaded (the package object only) when the interpreter has none."""
    import importlib.util

    if "mlaunch" not in sys.modules and importlib.util.find_spec("mlaunch") is None:
        # Only the package object, from this file's own mlaunch: mlaunch.model is standard library.
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec_ = importlib.util.spec_from_file_location(
            "mlaunch", os.path.join(package, "__init__.py"), submodule_search_locations=[package]
        )
        module = importlib.util.module_from_spec(spec_)
        sys.modules["mlaunch"] = module
        spec_.loader.exec_module(module)


def resolve_groups(spec: str) -> frozenset[str]:
    """The group names of a span-group spec, by mlaunch's own resolver (presets, ``-group``,
    ``goodput``), loaded from the mlaunch next to this file when the interpreter has none."""
    _load_mlaunch()
    from mlaunch.model.spec import resolve

    return frozenset(g.value for g in resolve(spec))


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(f"{what} is {value!r}, not an integer")
    return value


def parse_request(body: object, *, run_id: str, rank: int, started_ns: int) -> Request | None:
    """The request for this rank (:class:`Request`), or None when it is none of this rank's
    business (no live capture, another run, other ranks, written before this process started).
    One for this rank that cannot be applied raises :class:`Refused` (``args``: the reason and
    the request id); a body that is not a request at all raises ValueError."""
    if not isinstance(body, dict):
        raise ValueError(f"{CAPTURE_REQUEST_FILE} holds {type(body).__name__}, not a JSON object")
    rid = body.get("id")
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"{CAPTURE_REQUEST_FILE} has no id")
    if "groups" not in body:
        return None  # a recorder dump or another kind of request: not a live capture
    created = body.get("created_ns")
    if isinstance(created, bool) or not isinstance(created, int):
        raise ValueError(f"request {rid}: created_ns is {created!r}, not an integer")
    if created < started_ns:
        return None  # left behind by an earlier run or incarnation
    if body.get("run_id") and run_id and body["run_id"] != run_id:
        return None
    ranks = body.get("ranks")
    if ranks is not None and (not isinstance(ranks, list) or rank not in ranks):
        return None
    try:
        groups = body["groups"]
        if not isinstance(groups, str):
            raise Refused(f"groups is {groups!r}, not a span-group spec")
        try:
            names = resolve_groups(groups)
        except Exception as exc:  # mlaunch's SpanSpecError, or no resolver to load
            raise Refused(f"groups {groups!r}: {exc}") from None
        seconds = body.get("seconds")
        if seconds is None:
            raise Refused(
                "nemo-lens workers capture by time, not by iteration (Megatron-LM's iteration"
                " counter is not visible to mlaunch): ask with --seconds"
            )
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not 0 < seconds <= MAX_SECONDS
        ):
            raise Refused(f"seconds is {seconds!r}, not a number in (0, {MAX_SECONDS:g}]")
        start = body.get("start_ns")
        start_ns = created if start is None else _int(start, "start_ns")
    except Refused as exc:
        raise Refused(str(exc), rid) from None
    return Request(rid, names, start_ns, start_ns + int(seconds * _NS))


class LensCapture:
    """The watcher's state, advanced by :meth:`tick` (the thread calls it; tests call it with
    their own clock)."""

    def __init__(
        self,
        run_dir: str,
        run_id: str,
        rank: int,
        started_ns: int,
        lens: Lens | None = None,
    ) -> None:
        self.request_path = os.path.join(run_dir, CAPTURE_REQUEST_FILE)
        self.ack_dir = os.path.join(run_dir, TELEMETRY_DIR)
        self.run_id, self.rank, self.started_ns = run_id, rank, started_ns
        self.lens = lens or Lens()
        self.seen: set[str] = set()
        self.pending: Request | None = None
        #: (request, the groups restored at its end, the groups during it, applied_ns) while a
        #: capture runs.
        self.active: tuple[Request, frozenset[str], frozenset[str], int] | None = None
        self._mtime: int | None = None
        self._last_poll: int | None = None
        self._logged: set[str] = set()

    # --- the loop --------------------------------------------------------------------------

    def tick(self, now_ns: int) -> float:
        """Look at the request file (at most once per :data:`POLL_S`), start or end a capture
        that is due; the seconds until the next call is useful."""
        if self._last_poll is None or now_ns - self._last_poll >= POLL_S * _NS:
            self._last_poll = now_ns
            self._poll()
        wait = POLL_S
        if self.active is not None:
            request, previous, during, applied_ns = self.active
            if now_ns >= request.end_ns:
                self.lens.set_groups(previous)
                ended_ns = time.time_ns()  # after the switch back: no captured span starts later
                self.active = None
                self._ack(request, True, None, during, previous, applied_ns, ended_ns)
            else:
                wait = min(wait, (request.end_ns - now_ns) / _NS)
        if self.pending is not None and self.active is None:
            wait = min(wait, self._start(self.pending, now_ns))
        return max(wait, 0.0)

    def _poll(self) -> None:
        try:
            mtime = os.stat(self.request_path).st_mtime_ns
        except OSError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        import json

        try:
            with open(self.request_path, encoding="utf-8") as f:
                body = json.load(f)
            request = parse_request(
                body, run_id=self.run_id, rank=self.rank, started_ns=self.started_ns
            )
        except Refused as exc:
            message, rid = exc.args
            if rid not in self.seen:
                self.seen.add(rid)
                self._log("refused", f"request {rid} not applied: {message}")
                self._ack_refused(rid, message)
            return
        except (OSError, ValueError) as exc:  # unreadable, not JSON, not a request
            self._log("bad-file", f"ignoring {self.request_path} ({exc})")
            return
        if request is None or request.id in self.seen:
            return
        self.seen.add(request.id)
        if self.active is not None or self.pending is not None:
            busy = (self.active[0] if self.active is not None else self.pending).id
            self._ack_refused(request.id, f"capture {busy} is pending or running on this rank")
            return
        self.pending = request

    def _start(self, request: Request, now_ns: int) -> float:
        """Apply ``request`` when it is due; the seconds to wait before looking again."""
        status = self.lens.status()
        if status is None:
            if now_ns >= request.end_ns:
                self.pending = None  # nemo-lens never came up in this process: not a lens worker
            return POLL_S
        self.pending = None
        if status is False:
            self._ack_refused(
                request.id,
                "nemo-lens built no exporter on this rank (the run's export strategy leaves it"
                " out): nothing it traces goes anywhere",
            )
            return POLL_S
        if now_ns >= request.end_ns:
            self._ack_refused(request.id, "the window had ended when this rank read the request")
            return POLL_S
        if now_ns < request.start_ns:
            self.pending = request
            return (request.start_ns - now_ns) / _NS
        previous = self.lens.groups()
        during = previous | request.groups
        applied_ns = time.time_ns()  # before the switch: every captured span starts after it
        self.lens.set_groups(during)
        self.active = (request, previous, during, applied_ns)
        self._ack(request, True, None, during, previous, applied_ns, None)
        return min(POLL_S, max(0.0, (request.end_ns - time.time_ns()) / _NS))

    # --- answers ---------------------------------------------------------------------------

    def ack_path(self, rid: str) -> str:
        """Where this rank answers request ``rid``."""
        return os.path.join(self.ack_dir, CAPTURE_ACK_TEMPLATE.format(rank=self.rank, id=rid))

    def _ack_refused(self, rid: str, reason: str) -> None:
        self._write_ack(
            {"id": rid, "applied": False, "reason": reason, "groups": None, "previous": None,
             "start_ns": None, "end_ns": None, "applied_ns": None, "ended_ns": None}
        )  # fmt: skip

    def _ack(
        self,
        request: Request,
        applied: bool,
        reason: str | None,
        groups: frozenset[str],
        previous: frozenset[str],
        applied_ns: int | None,
        ended_ns: int | None,
    ) -> None:
        self._write_ack(
            {"id": request.id, "applied": applied, "reason": reason, "groups": sorted(groups),
             "previous": sorted(previous), "start_ns": request.start_ns,
             "end_ns": request.end_ns, "applied_ns": applied_ns, "ended_ns": ended_ns}
        )  # fmt: skip

    def _write_ack(self, body: dict[str, object]) -> None:
        _load_mlaunch()
        from mlaunch.rundir.atomic import write_json

        body = {**body, "rank": self.rank, "pid": os.getpid()}
        path = self.ack_path(body["id"])
        try:
            write_json(path, dict(sorted(body.items())))  # a reader never sees half an ack
        except OSError as exc:
            self._log("ack", f"cannot write {path} ({exc})")

    def _log(self, kind: str, message: str) -> None:
        """One line on stderr, once per kind of problem per process."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        try:
            sys.stderr.write(f"{LOG_PREFIX}{message}\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr never stops the worker
            pass


class _Watcher(threading.Thread):
    def __init__(self, capture: LensCapture) -> None:
        super().__init__(name=THREAD_NAME, daemon=True)
        self.capture = capture

    def run(self) -> None:
        wait = POLL_S
        while True:
            time.sleep(wait)
            try:
                wait = self.capture.tick(time.time_ns())
            except Exception as exc:  # never into the worker; the thread keeps watching
                self.capture._log("error", f"watcher error ({type(exc).__name__}: {exc})")
                wait = POLL_S


def install(environ: object = None) -> LensCapture | None:
    """Start the watcher in a process that is a rank of an mlaunch run (``RANK`` and
    ``MLAUNCH_RUN_DIR`` set), once per process; None elsewhere (torchrun itself, tools)."""
    env = os.environ if environ is None else environ
    run_dir = env.get(RUN_DIR, "").strip()
    rank = env.get("RANK", "").strip()
    if not run_dir or not rank.isdigit():
        return None
    if any(t.name == THREAD_NAME for t in threading.enumerate()):
        return None
    capture = LensCapture(run_dir, env.get(RUN_ID, "").strip(), int(rank), time.time_ns())
    _Watcher(capture).start()
    return capture
