"""torch.profiler for a live capture (``mlaunch trace capture --profiler``).

Telemetry never imports torch, so the trainer hands it the two calls a capture makes
(``telemetry.set_profiler_hooks``): the profiler starts at the capture's first iteration and
stops after its last, on the training thread, at the iteration boundary (outside the step).
The Chrome trace goes to ``RUN_DIR/telemetry/profiler-rank<R>-<capture id>.json`` beside the
spans. torch writes ``distributedInfo`` (rank, world size, backend) itself when the process
group is up, which is what HTA groups traces by; the ``mlaunch`` key holds the capture id, the
run id, the iterations and the trace ids of the ``megatron.train`` blocks the window covers, so
the trace can be put beside the run's spans. Writing the trace takes the training thread a
moment once, at the window's end (the profiler's own cost while it runs is far larger).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mlaunch import telemetry

#: The key of the trace's top-level object that ties it to the run's spans.
METADATA_KEY = "mlaunch"


def _start(path: Path) -> tuple[Any, Path]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.start()
    return prof, path


def _stop(handle: tuple[Any, Path], metadata: dict[str, Any]) -> None:
    prof, path = handle
    prof.add_metadata_json(METADATA_KEY, json.dumps(metadata))
    prof.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def install() -> None:
    """Let live captures with ``--profiler`` run torch.profiler in this process."""
    telemetry.set_profiler_hooks(_start, _stop)
