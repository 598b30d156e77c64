"""The CLI's surface, pinned: every command's ``--help`` text (at 100 columns) and the shape of
every ``--json`` output (its keys and value types, not its values) equal the recorded ones in
``tests/unit/golden/``. A restructuring must leave both byte-identical; a deliberate change is
reviewed by regenerating them (``MLAUNCH_REGEN_GOLDEN=1 pytest tests/unit/test_cli_surface.py``)
and reading the diff."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.help_pages import help_pages

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("MLAUNCH_REGEN_GOLDEN") == "1"
SCRUB = ("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "MLAUNCH_", "TORCHELASTIC_")
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "4", "--log-interval", "2", "--eval-iters", "0",
]  # fmt: skip


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    return {**base, "PYTHONPATH": str(REPO), "COLUMNS": "100", "TERM": "dumb",
            "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip


def mlaunch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", *args],
        capture_output=True, text=True, timeout=180, env=env(), cwd=cwd,
    )  # fmt: skip


def shape(value: Any) -> Any:
    """Keys and JSON types; a list is the union of its elements' shapes."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        merged: Any = None
        for item in value:
            merged = merge(merged, shape(item))
        return [merged] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__


def merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: merge(a.get(k), b.get(k)) if k in a and k in b else a.get(k, b.get(k))
                for k in sorted({*a, *b})}  # fmt: skip
    if a == b:
        return a
    return "|".join(sorted(set(str(a).split("|")) | set(str(b).split("|"))))


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGEN:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"{path} missing: regenerate with MLAUNCH_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed (MLAUNCH_REGEN_GOLDEN=1 to accept)"


def test_every_help_text_is_unchanged() -> None:
    pages = [
        f"=== mlaunch {' '.join(path)} --help\n{out}" for path, out in help_pages(env()).items()
    ]
    check("help.txt", "\n".join(pages))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny ``mlaunch train`` run (one worker, every span group, file exporter)."""
    cwd = tmp_path_factory.mktemp("surface")
    proc = mlaunch("train", *TINY, "--otel-span-groups", "all", "--run-dir", "run", cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return cwd / "run"


@pytest.mark.slow
def test_every_json_shape_is_unchanged(run_dir: Path, tmp_path: Path) -> None:
    commands = {
        "groups list": ["groups", "list", "--json"],
        "groups resolve": ["groups", "resolve", "all,-layer", "--json"],
        "doctor": ["doctor", "--json"],
        "status": ["status", str(run_dir), "--json"],
        "runs": ["runs", str(run_dir.parent), "--json"],
        "trace summary": ["trace", "summary", str(run_dir), "--json"],
        "trace goodput": ["trace", "goodput", str(run_dir), "--json"],
    }
    shapes = {}
    for name, args in commands.items():
        proc = mlaunch(*args, cwd=tmp_path)
        assert proc.stdout.strip(), (name, proc.returncode, proc.stderr[-2000:])
        # doctor's exit status depends on the machine (a failing check); the others' do not
        exit_code = None if name == "doctor" else proc.returncode
        shapes[name] = {"exit": exit_code, "shape": shape(json.loads(proc.stdout))}
    path = GOLDEN / "json_shapes.json"
    if REGEN:
        path.write_text(json.dumps(shapes, indent=1, sort_keys=True) + "\n")
        return
    recorded = json.loads(path.read_text())
    assert recorded.keys() == shapes.keys()
    for name, got in shapes.items():
        assert same_shape(got, recorded[name]), (name, got, recorded[name])


def same_shape(a: Any, b: Any) -> bool:
    """Equal shapes, where an empty list matches any list: whether a run has stragglers (say)
    depends on its timing, not on the output's format."""
    if isinstance(a, list) and isinstance(b, list):
        return not a or not b or same_shape(a[0], b[0])
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_shape(a[k], b[k]) for k in a)
    return a == b
