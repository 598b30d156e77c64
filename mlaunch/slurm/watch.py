"""``mlaunch status --watch``: what a live view of a running job shows, read from its run
directory (shared with the login node under SLURM) every refresh, never from the workers.

Each snapshot reads only the tails of the files it needs (bounded work whatever the run's
length): the job's state (:func:`mlaunch.slurm.status.job_status`), each rank's newest
spans (``telemetry/traces-rank<R>.jsonl``: its iteration, step time, tokens/s and the span it
last finished; step time and tokens/s from its ``megatron.training.*`` metrics when it exports no
step spans), ``progress.jsonl`` (the loss-owning rank's steps, for rolling goodput and the
time since the last progress), the recent waits (:mod:`mlaunch.trace.stragglers` over the same
tails: the current straggler), the hang timeout the launch resolved and the ``hang`` object of
the status (when the launcher reported one), a pending capture request and flight-recorder
dumps being written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.launcher.run_status import LIVE_STATES, JobStatus
from mlaunch.model.spans import STEP_SPAN, Attr, ResourceAttr
from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import ProgressStep, read_progress_tail
from mlaunch.slurm.status import job_status

#: Seconds between refreshes.
REFRESH_S = 2.0
#: Bytes read from the end of each rank's traces file per refresh.
TAIL_BYTES = 512 << 10
#: Bytes read from the end of each rank's metrics file per refresh (a few exports).
METRICS_TAIL_BYTES = 64 << 10
#: Seconds of progress records rolling goodput is measured over.
GOODPUT_WINDOW_S = 60.0
#: The setting of the launch's hang timeout in ``resolved.json`` (``[launch] hang_timeout``).
HANG_TIMEOUT_SETTING = "launch.hang_timeout"


@dataclass
class RankLive:
    """One rank's newest step and span, from its traces file's tail."""

    rank: int
    iteration: int | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    span: str | None = None
    """The span it most recently finished (or, from a hang report, the one it is in)."""
    span_age_s: float | None = None
    step_age_s: float | None = None
    """Seconds since its newest step ended (its last progress)."""
    current: bool = False
    """``span`` is the span the rank is in now (a hang report says so), not its last one."""


@dataclass
class Snapshot:
    """Everything one refresh of the watch shows."""

    status: JobStatus
    ranks: list[RankLive] = field(default_factory=list)
    goodput: float | None = None
    goodput_window_s: float | None = None
    iteration: int | None = None
    train_iters: int | None = None
    since_progress_s: float | None = None
    hang_timeout: str | None = None
    """The resolved ``hang_timeout`` (seconds, ``auto`` or ``off``); None when the launch had none."""
    hang: dict[str, Any] | None = None
    straggler: dict[str, Any] | None = None
    """The top row of ``trace stragglers`` over the recent tails (rank, phase, caused_wait_s)."""
    captures: list[dict[str, Any]] = field(default_factory=list)
    """The launch's captures with their phases (``status --json``'s ``captures``)."""
    recorder_writing: list[int] = field(default_factory=list)
    recorder_dumps: list[int] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.status.state in LIVE_STATES

    @property
    def capture(self) -> dict[str, Any] | None:
        """The newest capture of the launch."""
        return self.captures[-1] if self.captures else None


@dataclass
class WatchState:
    """What the watch remembers between refreshes (to tell a recorder file that is growing)."""

    recorder_sizes: dict[int, int] = field(default_factory=dict)


def _tail_reader(path: Path, rank: int, limit: int) -> Any:
    """A trace reader over the last ``limit`` bytes of ``path``, from a line boundary."""
    from mlaunch.trace.reader import TraceFile, TraceReader

    size = path.stat().st_size
    offset = 0
    if size > limit:
        with path.open("rb") as fh:
            fh.seek(size - limit)
            fh.readline()  # the rest of a line cut by the seek
            offset = fh.tell()
    return TraceReader([TraceFile(path, rank)], skip_invalid=True, starts={path: (offset, 0)})


def _rank_tails(run_dir: Path, now: float) -> tuple[list[RankLive], Any]:
    """Each rank's newest step and span, and the stragglers aggregate of the same tails."""
    from mlaunch.trace.stragglers import StragglerAggregator

    agg = StragglerAggregator()
    out: list[RankLive] = []
    for path in sorted((run_dir / lay.TELEMETRY_DIR).glob(lay.TRACES_FILE_GLOB)):
        named = lay.parse_telemetry_file(path.name)
        if named is None or named.rank is None or named.spool:
            continue
        live = RankLive(named.rank)
        newest_end = -1
        step_end = -1
        try:
            reader = _tail_reader(path, named.rank, TAIL_BYTES)
            for res, spans, flagged in reader:
                agg.add(res, spans, flagged)
                tokens = _tokens_per_iteration(res.attrs)
                for s in spans:
                    end = s["endTimeUnixNano"]
                    if end > newest_end:
                        newest_end, live.span = end, s["name"]
                    if s["name"] == STEP_SPAN and end > step_end:
                        step_end = end
                        d = max(1, end - s["startTimeUnixNano"])
                        live.step_ms = d / 1e6
                        live.tokens_per_s = tokens / (d / 1e9) if tokens else None
                        live.iteration = _iteration(s)
        except (OSError, ValueError):
            continue  # a file rotated or cut mid-read: the next refresh reads it again
        if newest_end >= 0:
            live.span_age_s = max(0.0, now - newest_end / 1e9)
            if step_end >= 0:
                live.step_age_s = max(0.0, now - step_end / 1e9)
            out.append(live)
    _metrics_fill(run_dir, out)
    return out, agg


def _metrics_fill(run_dir: Path, ranks: list[RankLive]) -> None:
    """Step time and tokens/s from each rank's newest ``megatron.training.*`` metrics where its
    traces show no step: a Megatron-LM worker with the ``default`` groups exports no step spans,
    and records these metrics under the names mlaunch's trainer uses (the embedded receiver
    writes them to ``telemetry/metrics-rank<R>.jsonl``)."""
    from mlaunch.trace.metrics import read_metric_points

    by_rank = {r.rank: r for r in ranks}
    for rank, points in read_metric_points(run_dir, tail_bytes=METRICS_TAIL_BYTES).items():
        live = by_rank.get(rank)
        if live is None:
            live = by_rank[rank] = RankLive(rank)
            ranks.append(live)
        if live.step_ms is None and points.get("step_ms"):
            live.step_ms = points["step_ms"][-1][1]
        if live.tokens_per_s is None and points.get("tokens_per_sec"):
            live.tokens_per_s = points["tokens_per_sec"][-1][1]
    ranks.sort(key=lambda r: r.rank)


def _tokens_per_iteration(attrs: dict[str, Any]) -> int | None:
    try:
        return int(attrs[ResourceAttr.BATCH_SIZE]) * int(attrs[ResourceAttr.SEQUENCE_LENGTH])
    except (KeyError, TypeError, ValueError):
        return None


def _iteration(span: dict[str, Any]) -> int | None:
    from mlaunch.otlp.otlp_json import attributes

    it = attributes(span.get("attributes")).get(Attr.ITERATION)
    return int(it) if isinstance(it, int | float) else None


def _progress_records(run_dir: Path, limit: int = 256 << 10) -> list[ProgressStep]:
    """The timed training records in the last ``limit`` bytes of ``progress.jsonl``."""
    return [r for r in read_progress_tail(run_dir, limit) if isinstance(r.time, int | float)]


def rolling_goodput(
    records: list[ProgressStep], now: float, started: float | None, window_s: float
) -> tuple[float | None, float | None]:
    """Step time over wall time in the last ``window_s`` (or since the launch, if later):
    (goodput, window). None when no step ended in the window."""
    begin = now - window_s
    if started is not None:
        begin = max(begin, started)
    wall = now - begin
    steps = [
        r.step_ms / 1e3 for r in records if r.time >= begin and isinstance(r.step_ms, int | float)
    ]
    if not steps or wall <= 0:
        return None, None
    return min(1.0, sum(steps) / wall), wall


def hang_timeout(run_dir: Path) -> str | None:
    """The hang timeout the launch resolved (``resolved.json``), as written; None without one."""
    try:
        data = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
        value = data["settings"][HANG_TIMEOUT_SETTING]["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if value is None else str(value)


def _recorders(run_dir: Path, state: WatchState) -> tuple[list[int], list[int]]:
    """(ranks whose recorder file grew since the last refresh, ranks with any dump)."""
    growing, present = [], []
    for path in (run_dir / lay.TELEMETRY_DIR).glob(lay.RECORDER_FILE.glob):
        rank = lay.RECORDER_FILE.parse(path.name)
        if rank is None:
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        present.append(rank)
        if rank in state.recorder_sizes and size > state.recorder_sizes[rank]:
            growing.append(rank)
        state.recorder_sizes[rank] = size
    return sorted(growing), sorted(present)


def snapshot(target: str, cwd: Path, state: WatchState, now: float | None = None) -> Snapshot:
    """One refresh of the watch. Raises ``StatusInputError`` as ``job_status`` does."""
    st = job_status(target, cwd)
    now = time.time() if now is None else now
    snap = Snapshot(st)
    snap.hang = st.as_json().get("hang")  # the launcher's hang report, when it made one
    if st.run_dir is None:
        return snap
    run_dir = Path(st.run_dir)
    started = st.launcher.started if st.launcher is not None else None
    if started is None and st.slurm:
        started = _slurm_start(st.slurm)
    snap.ranks, agg = _rank_tails(run_dir, now)
    records = _progress_records(run_dir)
    snap.goodput, snap.goodput_window_s = rolling_goodput(records, now, started, GOODPUT_WINDOW_S)
    if records:
        snap.iteration = records[-1].iteration
        snap.train_iters = records[-1].train_iters
    ends = [r.time for r in records[-1:]]
    ends += [now - r.step_age_s for r in snap.ranks if r.step_age_s is not None]
    # A finished run has no hang suspicion: its last progress is simply its end.
    suspect = st.run is not None and st.run.hang_suspected()
    snap.since_progress_s = max(0.0, now - max(ends)) if ends and suspect else None
    snap.hang_timeout = hang_timeout(run_dir) if suspect else None
    wd = st.watchdog
    if suspect and isinstance(wd, dict) and isinstance(wd.get("timeout_s"), int | float):
        # The bound the launcher's watchdog applies now (auto's 10x median, or the start-up
        # bound before the first iteration), not only the setting as written.
        phase = "start-up, " if wd.get("starting") else ""
        snap.hang_timeout = f"{wd['timeout_s']:g} s ({phase}{wd.get('setting')})"
    snap.straggler = _straggler(agg)
    snap.captures = st.captures
    snap.recorder_writing, present = _recorders(run_dir, state)
    if not st.live:
        snap.recorder_writing = []  # nothing is being written after the run
    snap.recorder_dumps = sorted(set(present) | {d["rank"] for d in st.dumps})
    if snap.hang:
        current = {r.get("rank"): r for r in snap.hang.get("ranks") or [] if isinstance(r, dict)}
        for live in snap.ranks:
            if (h := current.get(live.rank)) and h.get("span"):
                live.span, live.current = str(h["span"]), True
    return snap


def _slurm_start(slurm: dict[str, Any]) -> float | None:
    """The start of the job's current incarnation, from ``scontrol``'s StartTime."""
    try:
        return time.mktime(time.strptime(str(slurm.get("start")), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _straggler(agg: Any) -> dict[str, Any] | None:
    """The rank that caused the most waits in the recent tails (None: no waits, or one rank)."""
    from mlaunch.trace.reader import TraceInputError

    ranks = {k: v for k, v in agg.ranks.items() if v.spans or v.steps}
    if len(ranks) < 2:
        return None
    try:
        result = agg.finish()
    except (TraceInputError, ValueError, KeyError):
        return None
    if not result.ranks or result.ranks[0].caused_wait_s <= 0:
        return None
    top = result.ranks[0]
    return {
        "rank": top.rank, "phase": top.phase, "caused_wait_s": top.caused_wait_s,
        "iterations": top.iterations, "of_s": result.total_wait_s,
    }  # fmt: skip
