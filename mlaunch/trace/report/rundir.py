"""The run directory around a trace: where the report goes, and the files beside the traces
(``progress.jsonl`` for the training curves, ``resolved.json`` for the header)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlaunch import envcontract

#: Where ``write_report`` puts the report when no output path is given (inside the run directory).
REPORT_FILE = "report.html"


def run_directory(path: Path) -> Path:
    """The run directory behind ``path``: itself, or the one holding a traces file or the
    ``telemetry/`` directory given instead (where progress.jsonl and resolved.json live)."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    return d.parent if d.name == envcontract.TELEMETRY_DIR else d


def default_output(path: Path) -> Path:
    """``RUN_DIR/report.html`` for a run directory, or a file or telemetry directory in it."""
    return run_directory(path) / REPORT_FILE


def read_progress(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of ``progress.jsonl`` (the last one per iteration and kind, so a resumed run's
    repeats count once) and the number of unreadable lines skipped (a crash can cut the last)."""
    path = run_dir / envcontract.PROGRESS_FILE
    if not path.is_file():
        return [], 0
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                it = int(rec["iteration"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            (evals if "eval_loss" in rec else train)[it] = rec
    return [train[i] for i in sorted(train)] + [evals[i] for i in sorted(evals)], bad


def read_resolved(run_dir: Path) -> dict[str, Any]:
    """``resolved.json`` as ``mlaunch train`` wrote it, or {} (plain torchrun runs have none)."""
    try:
        data = json.loads((run_dir / envcontract.RESOLVED_JSON_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
