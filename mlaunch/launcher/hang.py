"""The launcher's hang watchdog (``mlaunch train --hang-timeout SECONDS|auto|off``).

Progress, in the order the watchdog trusts it (any one moving is progress):

- the progress beats of every process that set up ``mlaunch.telemetry`` under ``mlaunch train``
  (``heartbeat/rank{R}.json``: the iteration each rank last started; written off the
  training thread at most once a second, telemetry on or off): mlaunch's trainer and
  ``mlaunch.telemetry`` scripts;
- ``progress.jsonl`` (mlaunch's trainer, every log interval);
- the ``megatron.train.iteration`` spans the launcher's embedded OTLP receiver gets (Megatron-LM
  and nemo-lens workers; only from the ranks that export);
- when none of these has said anything in this attempt, the growth of the workers' own output
  (torchrun's per-rank logs), against the start-up bound only.

``auto``: the larger of :data:`AUTO_MIN_S` and 10x the median seconds per iteration once 5
iterations have run; before the first iteration of an attempt the start-up bound applies
(:data:`AUTO_STARTUP_S`; with a number of seconds, the larger of it and :data:`STARTUP_MIN_S`).

On a hang: :func:`mlaunch.launcher.hang_report.collect`, then (``stop``) SIGTERM to every local
worker, SIGKILL after :data:`STOP_GRACE_S`: torchrun restarts the group while restarts are left.
No torch import here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlaunch.launcher.hang_report import HangReport, Worker, collect, write_merged
from mlaunch.model.spans import STEP_SPAN
from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import ProgressRecord, ProgressStep, read_hang_reports, read_heartbeat

if TYPE_CHECKING:  # the type only: importing this module never loads the settings layer
    from mlaunch.launcher.plan import LaunchPlan

#: ``auto``'s floor, and its multiple of the median iteration time.
AUTO_MIN_S = 300.0
AUTO_FACTOR = 10.0
#: Iterations ``auto`` waits for before it trusts the median.
AUTO_WARMUP_ITERS = 5
#: Start-up (no iteration yet in this attempt): ``auto``'s bound, and the floor under a number
#: of seconds (imports, rendezvous, model build and a checkpoint load take minutes on big jobs).
AUTO_STARTUP_S = 1800.0
STARTUP_MIN_S = 600.0
#: How often the watchdog reads its sources (the follower polls faster).
CHECK_S = 1.0
#: How long stopped workers get between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0
#: Multi-node ``stop``: how long a node waits for the other nodes' reports before it stops its
#: workers (their watchdogs look once a second and collect in about a second).
PEER_WAIT_S = 15.0


def local_workers(torchrun_pid: int) -> list[Worker]:
    """The worker processes torchrun's agent started on this node (its children with ``RANK``
    in their environment; a worker's own children, e.g. data-loader processes, are not)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            if int(text[text.rindex(")") + 2 :].split()[1]) != torchrun_pid:
                continue
            pid = int(stat.parent.name)
            env = dict(
                item.split("=", 1)
                for item in (stat.parent / "environ").read_bytes().decode("utf-8", "replace")
                .split("\0") if "=" in item
            )  # fmt: skip
            if "RANK" in env:
                out.append(Worker(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), pid))
    return sorted(out, key=lambda w: w.rank)


def stop_workers(workers: list[Worker], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every worker, SIGKILL the ones still alive after ``grace_s``."""
    for w in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(w.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(workers)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [w for w in alive if _alive(w.pid)]
    for w in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(w.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class _Seen:
    """The latest (iteration, time) of one source and rank."""

    iteration: int
    time: float


class Watchdog:
    """Follows the progress sources and declares a hang; one per launch (:meth:`attempt_started`
    at each restart). :meth:`check` is called from the follower's loop."""

    def __init__(
        self, plan: LaunchPlan, started: float, receiver: Any = None, *, nccl_env: bool = False
    ) -> None:
        launch = plan.settings.launch
        self.plan = plan
        self.enabled = launch.hang_timeout != "off"
        self.fixed = launch.hang_timeout_s
        self.action = launch.on_hang
        self.node = launch.node_rank
        self.nccl_env = nccl_env
        self.receiver = receiver
        self.attempt = 0
        self.reports: list[HangReport] = []
        """Every hang of this launch (the last one names the final attempt's, when it hung)."""
        self._samples: deque[float] = deque(maxlen=50)
        self._seen: dict[tuple[str, int], _Seen] = {}
        self._beats: set[int] = set()
        self._next_check = 0.0
        self._workers: list[Worker] = []
        self._workers_at = 0.0
        self._log_size = -1
        self._attempt_start(started)

    # ---- the follower's calls ---------------------------------------------------------------

    def attempt_started(self, attempt: int, when: float) -> None:
        """torchrun restarted the group: start-up again, the median kept."""
        self.attempt = attempt
        self._attempt_start(when)

    def record(self, record: ProgressRecord) -> None:
        """A progress.jsonl record (mlaunch's trainer)."""
        if isinstance(record, ProgressStep) and isinstance(record.iteration, int):
            t = record.time
            self._observe(
                "progress", 0, record.iteration, t if isinstance(t, int | float) else time.time()
            )

    def timeout_s(self) -> float:
        """The bound that applies now."""
        if not self._iterated:
            return AUTO_STARTUP_S if self.fixed is None else max(self.fixed, STARTUP_MIN_S)
        if self.fixed is not None:
            return self.fixed
        if self._iterations >= AUTO_WARMUP_ITERS and self._samples:
            return max(AUTO_MIN_S, AUTO_FACTOR * statistics.median(self._samples))
        return AUTO_MIN_S

    def check(self, torchrun_pid: int, now: float | None = None) -> HangReport | None:
        """Read the sources; on a hang collect, judge, report (and stop, with ``stop``)."""
        if not self.enabled:
            return None
        now = time.time() if now is None else now
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_S
        self._read_sources(torchrun_pid, now)
        if self._reported:
            return None  # this silence is reported; progress re-arms the watchdog
        silent = now - self._last_progress
        bound = self.timeout_s()
        if silent <= bound:
            return None
        workers = self._local_workers(torchrun_pid, now, force=True)
        if not workers:
            return None  # between attempts: nothing to inspect
        detected = time.monotonic()
        report = HangReport(
            detected_at=now, node=self.node, attempt=self.attempt, timeout_s=round(bound, 1),
            silent_s=round(silent, 1), source=self._source(), action=self.action,
        )  # fmt: skip
        mlaunch_ranks = {w.rank for w in workers if w.rank in self._beats}
        collect(report, self.plan.run_dir, self.plan.run_id, workers, mlaunch_ranks,
                self.nccl_env, detected, self._began)  # fmt: skip
        self.reports.append(report)
        self._reported = True
        return report

    def state(self) -> dict[str, Any]:
        """What the watchdog is watching now (the launcher's record carries it, so ``mlaunch
        status`` and a live view can show the time since progress against the bound)."""
        return {
            "setting": self.plan.settings.launch.hang_timeout,
            "timeout_s": round(self.timeout_s(), 1) if self.enabled else None,
            "last_progress": round(self._last_progress, 3),
            "starting": not self._iterated,
            "source": self._source() if self._sources else None,
            "attempt": self.attempt,
        }

    def stop(self, torchrun_pid: int) -> None:
        """Stop the hung attempt's workers (``stop``), once every node has written its report
        (or :data:`PEER_WAIT_S` has passed): stopping this node's workers breaks the others'
        collectives, and a peer node whose workers died before it looked would have nothing
        left to inspect."""
        self.settle()
        stop_workers(self._local_workers(torchrun_pid, time.time(), force=True))

    def settle(self) -> None:
        """On a multi-node job, wait for every node's report (at most :data:`PEER_WAIT_S`), then
        rewrite the merged ``report.json`` from all of them: each node merged what was there when
        it wrote its own report, and the node that wrote last may have seen only itself."""
        if self.plan.settings.launch.nnodes > 1 and self.reports:
            self._await_peers()
            write_merged(self.plan.run_dir)

    def _await_peers(self) -> None:
        nnodes = self.plan.settings.launch.nnodes
        if nnodes <= 1 or not self.reports:
            return
        mine = self.reports[-1]
        deadline = time.monotonic() + PEER_WAIT_S
        while time.monotonic() < deadline:
            # Every node's report of this hang (detected within a timeout of this node's).
            peers = read_hang_reports(self.plan.run_dir, mine.detected_at - mine.timeout_s + 1)
            done = len({r.node for r in peers if r.attempt == mine.attempt and r.node is not None})
            if done >= nnodes:
                return
            time.sleep(0.2)

    # ---- internals --------------------------------------------------------------------------

    def _attempt_start(self, when: float) -> None:
        self._began = when
        self._last_progress = when
        self._iterated = False
        self._iterations = 0
        self._first: dict[tuple[str, int], int] = {}
        self._reported = False
        self._sources: set[str] = set()
        self._workers = []

    def _observe(self, source: str, rank: int, iteration: int, t: float, dur: float = 0) -> None:
        key = (source, rank)
        prev = self._seen.get(key)
        self._seen[key] = _Seen(iteration, t)
        if dur > 0:
            self._samples.append(dur)
        elif prev is not None and iteration > prev.iteration and t > prev.time:
            self._samples.append((t - prev.time) / (iteration - prev.iteration))
        if prev is None or iteration != prev.iteration:
            self._last_progress = time.time()
            self._reported = False
            self._iterated = True
            self._sources.add(source)
            # Iterations run in this attempt, as the source that saw most says (not summed
            # over ranks: two ranks' beats of one iteration are one iteration).
            first = self._first.setdefault(key, iteration if prev is None else prev.iteration)
            self._iterations = max(self._iterations, iteration - first)

    def _local_workers(self, torchrun_pid: int, now: float, force: bool = False) -> list[Worker]:
        if force or not self._workers or now - self._workers_at > 5 * CHECK_S:
            self._workers = local_workers(torchrun_pid)
            self._workers_at = now
        return self._workers

    def _read_sources(self, torchrun_pid: int, now: float) -> None:
        for w in self._local_workers(torchrun_pid, now):
            beat = read_heartbeat(self.plan.run_dir, w.rank)
            if beat is None or beat.pid != w.pid:
                continue  # none yet, or an earlier attempt's worker wrote it
            self._beats.add(w.rank)
            if beat.iteration is not None and isinstance(beat.time, float):
                self._observe("heartbeat", w.rank, beat.iteration, beat.time)
        if self.receiver is not None:
            for rank, iteration, start_ns, end_ns in self.receiver.take_iterations():
                self._observe(
                    "receiver", -1 if rank is None else rank, iteration + 1, end_ns / 1e9,
                    (end_ns - start_ns) / 1e9,
                )  # fmt: skip
        if not self._sources:
            size = self._output_size()
            if size != self._log_size:
                if self._log_size >= 0:
                    self._last_progress = now
                self._log_size = size

    def _output_size(self) -> int:
        total = 0
        for path in self.plan.log_dir.glob("*/attempt_*/*/std*.log"):
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def _source(self) -> str:
        names = {
            "heartbeat": "mlaunch.telemetry progress beats",
            "progress": lay.PROGRESS_FILE,
            "receiver": f"{STEP_SPAN} spans (embedded receiver)",
        }
        found = [names[s] for s in sorted(self._sources)]
        return ", ".join(found) if found else "worker output (no iteration source)"
