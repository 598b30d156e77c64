"""The run directory around a trace: where the report goes, and the files beside the traces
(``progress.jsonl`` for the training curves, ``resolved.json`` for the header)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract
from mlaunch.trace.report.curve import Curve


def run_directory(path: Path) -> Path:
    """The run directory behind ``path``: itself, or the one holding a traces file or the
    ``telemetry/`` directory given instead (where progress.jsonl and resolved.json live)."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    return d.parent if d.name == envcontract.TELEMETRY_DIR else d


def default_output(path: Path) -> Path:
    """``RUN_DIR/report.html`` for a run directory, or a file or telemetry directory in it."""
    return run_directory(path) / envcontract.REPORT_FILE


#: The fields of a training record of ``progress.jsonl`` (:class:`~mlaunch.envcontract.ProgressStep`)
#: the curves draw.
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_sec", "step_ms")


@dataclass
class Progress:
    """The curves of ``progress.jsonl``: one per :data:`TRAIN_KEYS` from the training records,
    one of ``eval_loss`` from the eval records, each bounded (:class:`~.curve.Curve`), so the
    file is read as a stream at any length."""

    train: dict[str, Curve] = field(default_factory=lambda: {k: Curve() for k in TRAIN_KEYS})
    evals: Curve = field(default_factory=Curve)
    #: Whether the file has any training record (else the curves come from the step spans).
    has_train: bool = False


def read_progress(run_dir: Path) -> tuple[Progress, int]:
    """The curves of ``progress.jsonl`` (the last record per iteration and kind, so a resumed
    run's repeats count once) and the number of unreadable lines skipped (a crash can cut the
    last; a line that is no record, or has no whole-number iteration, is skipped too)."""
    prog = Progress()
    path = run_dir / envcontract.PROGRESS_FILE
    if not path.is_file():
        return prog, 0
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            rec = envcontract.read_progress_record(raw)
            if rec is None or not isinstance(rec.iteration, int):
                bad += 1
                continue
            if isinstance(rec, envcontract.ProgressEval):
                prog.evals.add(rec.iteration, rec.eval_loss)
                continue
            prog.has_train = True
            for k, curve in prog.train.items():
                curve.add(rec.iteration, getattr(rec, k))
    return prog, bad


def read_resolved(run_dir: Path) -> dict[str, Any]:
    """``resolved.json`` as ``mlaunch train`` wrote it, or {} (plain torchrun runs have none)."""
    try:
        data = json.loads((run_dir / envcontract.RESOLVED_JSON_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
