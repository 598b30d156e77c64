"""``mlaunch trace capture``: write a request into a running run's directory, which every worker
reads at most once a second off its training thread (``mlaunch.telemetry._recorder``).

The request carries its creation time and the run id when the run directory names one: a worker
started after the request was written (a later run in the same directory, a restart, a requeue)
ignores it, so a request left behind never applies to a later run or incarnation. It works for a
multi-node job whose run directory is shared (SLURM runs already need a shared ``--save``); with
a run directory local to each node, run the command on every node.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.launcher.status import StatusInputError, job_status

#: Run states in which no worker is left to read a request.
FINISHED_STATES = frozenset({"completed", "failed", "preempted", "cancelled", "timeout"})


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

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "run_dir": str(self.run_dir),
            "ranks": "all" if self.ranks is None else self.ranks,
            "recorded": self.recorded,
            "iteration": self.iteration,
            "request_file": str(self.run_dir / ec.CAPTURE_REQUEST_FILE),
        }


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


def _world_size(run_dir: Path) -> int | None:
    try:
        data = json.loads((run_dir / ec.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
        return int(data["settings"]["launch"]["nproc_per_node"]) * int(
            data["settings"]["launch"]["nnodes"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run_id(run_dir: Path) -> str | None:
    try:
        data = json.loads((run_dir / ec.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("run_id") if isinstance(data, dict) else None
    return str(value) if value else None


def request_capture(target: str, cwd: Path, *, recorded: bool, ranks: str) -> CaptureRequest:
    """Validate and write the request; raises :class:`CaptureInputError` (nothing written)."""
    if not recorded:
        raise CaptureInputError("nothing to capture: pass --recorded (dump the flight recorders)")
    wanted = parse_ranks(ranks)
    try:
        st = job_status(target, cwd)
    except StatusInputError as exc:
        raise CaptureInputError(str(exc)) from None
    if st.run_dir is None:
        raise CaptureInputError(f"{target}: no run directory found for it")
    run_dir = Path(st.run_dir)
    if st.state in FINISHED_STATES:
        raise CaptureInputError(f"{run_dir}: the run has {st.state}; no worker is left to capture")
    if not st.progress:
        raise CaptureInputError(
            f"{run_dir}: no training progress yet ({ec.PROGRESS_FILE}); capture once it trains"
        )
    world = _world_size(run_dir)
    if wanted is not None and world is not None and (bad := [r for r in wanted if r >= world]):
        raise CaptureInputError(
            f"--ranks: rank {bad[0]} is not in this run (world size {world}: ranks 0-{world - 1})"
        )
    req = CaptureRequest(
        id=secrets.token_hex(6),
        run_dir=run_dir,
        ranks=wanted,
        recorded=recorded,
        iteration=st.progress.get("iteration"),
    )
    body = {
        "id": req.id,
        "created_ns": time.time_ns(),
        "run_id": _run_id(run_dir),
        "ranks": wanted,
        "recorded": recorded,
    }
    path = run_dir / ec.CAPTURE_REQUEST_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(body) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a worker never reads half a request
    return req


def lens_capture_ranks(run_dir: Path) -> tuple[list[int], dict[int, str]]:
    """For a run whose workers trace through nemo-lens (``--script``/``--module``): ``(the ranks
    that will capture, {rank: why it cannot})``, from the run's ``resolved.json``.

    A nemo-lens worker can switch groups only where nemo-lens built an exporter: on the ranks the
    export strategy leaves out it installed no-op providers, so nothing traced there goes anywhere
    (mlaunch's own trainer starts an exporter on demand instead). Both empty when the run directory
    has no readable ``resolved.json``.
    """
    try:
        data = json.loads((Path(run_dir) / ec.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
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
        off = "telemetry is off in this run (--otel-enabled was not given)"
    elif value("telemetry.traces_enabled") is False:
        off = "traces are off in this run (TRACES_ENABLED=false)"
    elif value("telemetry.otel.sdk_disabled"):
        off = "OTEL_SDK_DISABLED is set in this run"
    if off is not None:
        return [], {r: off for r in range(world)}
    strategy = value("telemetry.export_strategy") or "single_rank"
    why = (
        f"it does not export under the run's export strategy {strategy!r}: nemo-lens built no"
        " exporter there (use --otel-export-strategy all_ranks at launch to capture every rank)"
    )
    return exporting, {r: why for r in range(world) if r not in exporting}
