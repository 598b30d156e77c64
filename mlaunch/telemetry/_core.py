"""This process's telemetry state, in one object, and the worker's identity, derived once.

:class:`Identity` is who this worker is for telemetry: the run id, the restart count and the
incarnation the trace ids are derived from, the ``megatron.train`` block size, the run directory
and the rank's place in the job. :func:`worker_identity` derives it once per ``setup`` (the one
call of ``choose_run_id``), and the same object is handed to the runtime (an exporting rank's
exporter), the flight recorder, the request watcher and the progress beat, so they can never
disagree about which traces or which run directory are this rank's.

:class:`Core` is everything ``mlaunch.telemetry`` holds between ``setup`` and ``shutdown``: the
handle, the runtime, a live capture's on-demand runtime, the identity, and the span groups by
route (exported, recorded, captured). The span constructors do not read it: the hot path reads
module globals of ``mlaunch.telemetry`` (a global lookup is what the disabled ``with span`` can
afford), which ``telemetry._publish`` derives from it after every change (``setup``, a live
capture's switch, ``shutdown``, a fork).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlaunch.model.groups import FINE_GRAINED_GROUPS

if TYPE_CHECKING:  # the types only: importing the telemetry API never loads pydantic
    from mlaunch.settings import TelemetrySettings

#: Every fine-grained group (the recorded path for these when exported, see ``_spans``).
ALL_FINE: frozenset[str] = frozenset(g.value for g in FINE_GRAINED_GROUPS)

#: torchrun's restart count, when the caller's resource does not carry ``dl.restart_count``.
_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class Identity:
    """Who this worker is for telemetry (see the module docstring)."""

    run_id: str
    #: The restart count (``dl.restart_count`` from the caller, else torchrun's).
    restart: int
    #: What the trace ids are derived from: the restart and Megatron-LM's ``nemo.lens.run_uuid``
    #: (a SLURM requeue changes it and starts torchrun's count at 0 again), so a resumed block
    #: never reuses an earlier incarnation's trace id.
    incarnation: str
    #: Iterations per ``megatron.train`` block (``save_interval``, else ``trace_segment_iters``).
    block_iters: int
    run_dir: Path
    rank: int
    world_size: int
    local_rank: int
    #: The caller's extra resource attributes (``setup``'s ``resource``), as given.
    resource: Mapping[str, Any] = field(default_factory=dict)


def worker_identity(
    settings: TelemetrySettings,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    resource: Mapping[str, Any] | None,
    run_dir: str | Path | None,
    save_interval: int,
    environ: Mapping[str, str],
) -> Identity:
    """This worker's :class:`Identity`: ``run_dir`` overrides ``MLAUNCH_RUN_DIR`` /
    ``./runs/<run_id>``; the run id is chosen as every rank of the job chooses it."""
    from mlaunch import envcontract
    from mlaunch.model.identity import RUN_UUID, run_identity
    from mlaunch.model.segments import block_iterations
    from mlaunch.model.spans import ResourceAttr
    from mlaunch.settings.run_id import choose_run_id, torchrun_shared_ids

    run_id = choose_run_id(settings.run_id, environ, shared=torchrun_shared_ids(environ))
    extra = dict(resource or {})
    raw = extra.get(ResourceAttr.RESTART_COUNT, environ.get(_RESTART_ENV, "0"))
    try:
        restart = int(raw)
    except (TypeError, ValueError):
        restart = 0
    return Identity(
        run_id=run_id,
        restart=restart,
        incarnation=f"{restart}/{run_identity(environ)[RUN_UUID]}",
        block_iters=block_iterations(save_interval, settings.trace_segment_iters),
        run_dir=Path(run_dir) if run_dir else envcontract.worker_run_dir(environ, run_id),
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        resource=extra,
    )


class Core:
    """Everything this process's telemetry holds (the module-level ``telemetry._CORE``)."""

    def __init__(self) -> None:
        #: The handle ``setup`` returned (None: not set up).
        self.handle: Any = None
        #: The settings ``setup`` was given (a live capture's on-demand runtime is built from
        #: them); None when not set up.
        self.settings: TelemetrySettings | None = None
        self.identity: Identity | None = None
        #: ``_runtime.Runtime`` on an exporting rank, else None.
        self.runtime: Any = None
        #: A live capture's runtime on a rank that exports nothing (built on demand, then idle
        #: until shutdown); it takes the spans while a capture runs (:attr:`capturing`).
        self.capture_runtime: Any = None
        #: Why this rank's telemetry is off although it was asked for (its setup failed), or
        #: None: the progress beat carries it to the launcher, which shows it on its console
        #: and in ``mlaunch status`` (a warning in the rank's own log alone would go unseen).
        self.off_reason: str | None = None
        #: The groups this rank exports (``Telemetry.enabled_groups``).
        self.exported: frozenset[str] = frozenset()
        #: The flight recorder's groups (those it keeps that this rank does not export).
        self.recorded: frozenset[str] = frozenset()
        #: The groups a running live capture adds (exported, marked with :attr:`capture_id`).
        self.captured: frozenset[str] = frozenset()
        self.capture_id = ""
        #: Whether a live capture is running (its groups are on).
        self.capturing = False
        #: ``set_profiler_hooks``: (start, stop), or None.
        self.profiler_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        #: When this process imported telemetry: a capture request written before it is not
        #: for it.
        self.started_ns = time.time_ns()

    def forget(self) -> None:
        """Back to not set up (shutdown, or a forked child); the profiler hooks, the process's
        start time and the reason telemetry is off stay."""
        self.handle = self.settings = self.identity = None
        self.runtime = self.capture_runtime = None
        self.exported = self.recorded = self.captured = frozenset()
        self.capture_id = ""
        self.capturing = False

    @property
    def active_runtime(self) -> Any:
        """The runtime spans go to now: this rank's own, else a running capture's."""
        if self.runtime is None and self.capturing:
            return self.capture_runtime
        return self.runtime

    def routes(self) -> tuple[frozenset[str], frozenset[str], frozenset[str], frozenset[str]]:
        """(enabled, fine, recorded, captured): the sets the span constructors route by. A
        captured group is exported while the capture runs, never recorded; the four are
        disjoint but for ``enabled``, their union (with the exported coarse groups)."""
        captured = self.captured if self.capturing else frozenset()
        recorded = self.recorded - captured
        enabled = self.exported | recorded | captured
        return enabled, self.exported & ALL_FINE, recorded, captured
