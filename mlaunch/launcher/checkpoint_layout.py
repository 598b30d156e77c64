"""Refusing before launch to resume from a checkpoint saved with another layout (standard library
only: the launcher never imports torch)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlaunch.rundir import layout as lay
from mlaunch.settings import Problem, Settings, flag_name

#: Checkpoint files the launcher reads (stdlib only, the launcher never imports torch), named by
#: the run-directory schema as the trainer's are.
CHECKPOINT_TRACKER_FILE = lay.CHECKPOINT_TRACKER_FILE
CHECKPOINT_MANIFEST_FILE = lay.CHECKPOINT_MANIFEST_FILE
#: Settings that fix the shape of what a checkpoint holds: resuming with another value of any of
#: them cannot load its tensors (compared when the checkpoint's run left its ``resolved.json``).
CHECKPOINT_LAYOUT_SETTINGS = (
    "parallelism.pipeline_model_parallel_size",
    "parallelism.tensor_model_parallel_size",
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.seq_length",
    "model.untie_embeddings",
)


def _newest_manifest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The manifest of the checkpoint a resume would start from (the marker's, else the newest
    committed one), or None when there is none to read."""
    iter_dir = lay.CHECKPOINT_ITER_DIR
    try:
        found = [it for p in root.iterdir() if (it := iter_dir.parse(p.name)) is not None]
        marker = (
            (root / CHECKPOINT_TRACKER_FILE).read_text().strip()
            if (root / CHECKPOINT_TRACKER_FILE).is_file()
            else ""
        )
    except OSError:
        return None
    order = sorted(found, reverse=True)
    if marker.isdigit() and int(marker) in order:
        order.remove(int(marker))
        order.insert(0, int(marker))
    for it in order:
        path = root / iter_dir.name(it) / CHECKPOINT_MANIFEST_FILE
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # the trainer falls back past an invalid one; so does this check
        if isinstance(manifest, dict):
            return path, manifest
    return None


def resume_iteration(root: Path) -> int | None:
    """The iteration of the checkpoint in ``root`` a resume starts from (the marker's, else the
    newest committed one with a readable manifest), or None when there is none: the trainer's
    own choice, read ahead with the standard library (it may still fall back past a checkpoint
    whose tensors fail to load)."""
    found = _newest_manifest(root)
    return None if found is None else lay.CHECKPOINT_ITER_DIR.parse(found[0].parent.name)


def checkpoint_layout_problems(
    settings: Settings, targs: Sequence[str], cwd: Path
) -> list[Problem]:
    """Refuse before launch to resume from a checkpoint saved with another layout (pipeline
    stages from its manifest; tensor parallelism and model shape from the ``resolved.json`` of
    the run that saved it, when the checkpoint is that run's ``checkpoints/``): the workers would
    otherwise each die in ``torch.load`` after start-up."""
    if "--load" not in targs[:-1]:
        return []
    load = Path(targs[targs.index("--load") + 1]).expanduser()
    root = load if load.is_absolute() else cwd / load
    found = _newest_manifest(root)
    if found is None:
        return []
    manifest_path, manifest = found
    theirs: dict[str, Any] = {}
    with contextlib.suppress(TypeError, ValueError):
        theirs["parallelism.pipeline_model_parallel_size"] = int(manifest.get("pipeline_stages", 1))
    if root.name == lay.CHECKPOINTS_DIR:
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            table = json.loads((root.parent / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
            for path in CHECKPOINT_LAYOUT_SETTINGS:
                entry = table["settings"].get(path)
                if isinstance(entry, dict) and "value" in entry:
                    theirs.setdefault(path, entry["value"])
    differ = []
    for path in CHECKPOINT_LAYOUT_SETTINGS:
        section, _, fld = path.partition(".")
        ours = getattr(getattr(settings, section), fld)
        if path in theirs and theirs[path] != ours:
            differ.append(f"{flag_name(path)} {theirs[path]} (now {ours})")
    if not differ:
        return []
    if settings.training.load is not None:
        label, fix = settings.label("training.load"), "give --load a checkpoint of this layout"
    elif settings.training.save is not None:
        label = settings.label("training.save")
        fix = "give --save an empty directory"
    else:
        label, fix = settings.label("launch.run_dir"), "give a new --run-dir (or --save DIR)"
    return [
        (
            label,
            f"{root} holds a checkpoint saved with {', '.join(differ)} ({manifest_path.parent.name});"
            f" this run cannot resume from it: {fix}, or run with that layout",
        )
    ]


def _earlier_run(run_dir: Path, run_id: str) -> tuple[str, int] | None:
    """(run id, iterations recorded) of another run that left its records in ``run_dir``, or
    None. A record of this same run id is not another run: a SLURM requeue (the run id is the
    job id) and every node of a multi-node job share it."""
    try:
        table = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
        theirs = str(table["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if theirs == run_id:
        return None
    try:
        with (run_dir / lay.PROGRESS_FILE).open("rb") as f:
            iterations = sum(1 for line in f if line.strip())
    except OSError:
        iterations = 0
    traces = any((run_dir / lay.TELEMETRY_DIR).glob(lay.TRACES_FILE_GLOB))
    return (theirs, iterations) if iterations or traces else None


def rerun_problems(
    settings: Settings, targs: Sequence[str], run_dir: Path, run_id: str
) -> list[Problem]:
    """Refuse a second run of mlaunch's trainer in a run directory that holds another run's
    records and no checkpoint to resume from: it would start at iteration 1 and append to the
    first run's ``progress.jsonl`` and traces, which every reader would then count as one run.
    With a checkpoint the rerun resumes (``--load`` defaults to it) and continues that run."""
    if "--load" in targs[:-1]:
        return []
    found = _earlier_run(run_dir, run_id)
    if found is None:
        return []
    theirs, iterations = found
    what = f"{iterations} iteration(s) in {lay.PROGRESS_FILE}" if iterations else "its traces"
    return [
        Problem(
            settings.label("launch.run_dir"),
            f"{run_dir} holds run {theirs} ({what}) and no checkpoint to resume from: this run"
            " would start over and mix its records with that run's. Give another --run-dir (or"
            " remove that run's files); to make runs resumable, save checkpoints"
            " (--save-interval N)",
            "conflict",
        )
    ]
