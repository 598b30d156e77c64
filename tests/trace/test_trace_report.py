"""``mlaunch trace report``: a self-contained offline HTML report (issue 9)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.synthetic_traces import hand_example
from typer.testing import CliRunner

from mlaunch.trace.report import coalesce, collect

PROGRESS = [
    {"iteration": 1, "train_iters": 4, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.5,
     "tokens_per_sec": 1000.0, "step_ms": 130.0, "skipped": False},
    {"iteration": 2, "train_iters": 4, "loss": 3.5, "lr": 2e-3, "grad_norm": 1.25,
     "tokens_per_sec": 1300.0, "step_ms": 100.0, "skipped": False},
    {"iteration": 2, "eval_loss": 3.75},
]  # fmt: skip


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = hand_example()[0].write_run_dir(tmp_path / "run")
    (run / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROGRESS))
    return run


def _invoke(*args: str | Path):
    from mlaunch.cli import app

    return CliRunner().invoke(app, ["trace", "report", *map(str, args)])


def test_report_is_self_contained_with_every_section(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    r = _invoke(run_dir, "-o", out)
    assert r.exit_code == 0, r.output
    assert "21 spans, 2 ranks, 3 progress records" in r.output
    text = out.read_text()
    assert not re.search(r"""<script[^>]+src=|<link[^>]+href=["']https?:""", text)  # offline
    from plotly.offline import get_plotlyjs

    assert get_plotlyjs()[:500] in text  # plotly.js inlined
    for anchor in ("timeline", "spans", "curves", "goodput"):
        assert f'id="{anchor}"' in text
    assert "mlaunch run report: synthrun0001" in text
    assert "61.8%" in text  # overall goodput 970 / 1570 ms
    assert "eval loss" in text and "3.75" in text  # the eval curve's point
    assert "megatron.save_checkpoint.io_write" in text


def test_collect_gathers_timeline_and_progress(run_dir: Path) -> None:
    d = collect(run_dir)
    # rank 0's four steps: 260-390, 400-500, 500-600, 700-800 ms -> merged where they touch.
    steps = [(s / 1e6, e / 1e6) for s, e in d.timeline[0]["train step"]]
    assert steps == [(260, 390), (400, 600), (700, 800)]
    assert d.merged_counts[0]["train step"] == 4
    assert d.timeline[0]["first iteration"] == [(250 * 10**6, 400 * 10**6)]
    assert [r["iteration"] for r in d.progress] == [1, 2, 2]


def test_coalesce_caps_the_number_of_bars() -> None:
    steps = [(10 * i, 10 * i + 9) for i in range(1000)]  # 1 ns gaps
    bars = coalesce(steps, max_bars=10)
    assert len(bars) <= 10
    assert bars[0][0] == 0 and bars[-1][1] == 9999
    assert coalesce([(0, 5), (5, 8), (20, 30)], max_bars=10) == [(0, 8), (20, 30)]


def test_report_without_progress_says_so(tmp_path: Path) -> None:
    run = hand_example()[0].write_run_dir(tmp_path / "run")
    r = _invoke(run, "-o", tmp_path / "r.html")
    assert r.exit_code == 0 and "no progress.jsonl" in r.output
    assert "no progress.jsonl in this run directory" in (tmp_path / "r.html").read_text()


def test_bad_progress_record_names_its_line(run_dir: Path, tmp_path: Path) -> None:
    with open(run_dir / "progress.jsonl", "a") as f:
        f.write('{"loss": 1.0}\n')
    r = _invoke(run_dir, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"{run_dir / 'progress.jsonl'}:4:" in r.output
    assert not (tmp_path / "r.html").exists()
