"""The run directory around a trace: where the report goes, and the files beside the traces
(``progress.jsonl`` for the training curves, ``resolved.json`` for the header)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import ProgressEval, read_progress_record

# Their home is the reader (its advice reads resolved.json too); re-exported for the report.
from mlaunch.trace.reader import read_resolved as read_resolved
from mlaunch.trace.reader import run_directory as run_directory
from mlaunch.trace.report.curve import Curve


def default_output(path: Path) -> Path:
    """``RUN_DIR/report.html`` for a run directory, or a file or telemetry directory in it."""
    return run_directory(path) / lay.REPORT_FILE


#: The fields of a training record of ``progress.jsonl`` (:class:`~mlaunch.ProgressStep`)
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
    path = run_dir / lay.PROGRESS_FILE
    if not path.is_file():
        return prog, 0
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            rec = read_progress_record(raw)
            if rec is None or not isinstance(rec.iteration, int):
                bad += 1
                continue
            if isinstance(rec, ProgressEval):
                prog.evals.add(rec.iteration, rec.eval_loss)
                continue
            prog.has_train = True
            for k, curve in prog.train.items():
                curve.add(rec.iteration, getattr(rec, k))
    return prog, bad
