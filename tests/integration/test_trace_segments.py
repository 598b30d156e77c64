"""Trace segmentation on real ``mlaunch train`` runs: the one sentence every view prints
(``mlaunch.model.segments.TRACE_SEGMENTS``: the flag's help, ``groups list``, the span tree,
the docs) predicts how many traces each rank writes, and so does the launch summary's
``traces`` row. ``--save-interval 10 --otel-trace-segment-iters 1000`` gave 3 traces while the
flag's help said "every 1000 iterations"."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch

from mlaunch.model.segments import TRACE_SEGMENTS, block_iterations, train_block
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS = 20
REPO = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    """``text`` with every run of whitespace (a wrapped line, a table's frame) as one space."""
    return " ".join(re.sub(r"[│╭╮╰╯─>]", " ", text).split())


def _cli(*args: str, columns: int = 100) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "mlaunch", *args], capture_output=True, text=True, timeout=120,
        env=clean_env(COLUMNS=str(columns)),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_description_of_segmentation_is_the_one_sentence() -> None:
    sentence = _flat(TRACE_SEGMENTS)
    assert "--save-interval" in sentence and "--otel-trace-segment-iters" in sentence
    help_text = _flat(_cli("train", "--help", columns=200))
    assert f"--otel-trace-segment-iters INT {sentence}" in help_text
    assert f"trace segments: {sentence}" in _flat(_cli("groups", "list"))
    assert sentence in _flat(_cli("groups", "resolve", "per_step")).replace("│ ", "")
    assert sentence in _flat((REPO / "docs" / "telemetry.md").read_text())


@pytest.mark.parametrize(
    ("flags", "by_saves"),
    [
        # The case of the issue: saves win over the segment length.
        (["--save-interval", "10", "--otel-trace-segment-iters", "1000"], True),
        (["--otel-trace-segment-iters", "7"], False),
    ],
    ids=["saves-win", "no-saves"],
)
def test_the_rule_predicts_the_traces_of_a_real_run(
    tmp_path: Path, flags: list[str], by_saves: bool
) -> None:
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--run-dir", str(run_dir), "--train-iters", str(ITERS), "--eval-interval", "0",
        "--otel-enabled", "--otel-export-strategy", "all_ranks", *flags,
        cwd=tmp_path, env=clean_env(COLUMNS="200"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out
    # What the sentence says: save interval when the run saves, else the segment length.
    save = int(flags[1]) if by_saves else 0
    per = block_iterations(save, int(flags[-1]))
    expected = 1 + train_block(ITERS, per) + 1  # start-up, then one trace per block
    assert expected == (3 if by_saves else 4)
    # The launch summary says the same before anything runs.
    assert f"traces {expected} per worker start" in _flat(out), out
    files = sorted((run_dir / "telemetry").glob("traces-rank*.jsonl"))
    assert len(files) == 2
    for f in files:
        assert len({s["trace_id"] for s in read_spans(f)}) == expected, f
