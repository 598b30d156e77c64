"""examples/my_train.py, launched by `mlaunch train --script` as the example's docstring says,
gives a report that shows the script's own span and its training curves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.trainer_runs import clean_env

from mlaunch.trace.report import write_report

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_train.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_example_script_run_gives_a_report_with_its_own_span(tmp_path: Path) -> None:
    run_dir = tmp_path / "my-run"
    env = clean_env(run_dir)
    env.pop("MLAUNCH_RUN_DIR")  # mlaunch train chooses it from --run-dir
    cmd = [sys.executable, "-m", "mlaunch", "train", "--script", str(EXAMPLE), "--megatron-args",
           "--nproc-per-node", "2", "--train-iters", "7", "--otel-span-groups", "per_step",
           "--otel-export-strategy", "all_ranks", "--run-dir", str(run_dir)]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

    page = write_report(run_dir)
    text = page.read_text()
    assert re.search(r"<td[^>]*>my_train.allreduce</td><td[^>]*>other</td>", text)
    figs = json.loads(re.search(r'id="report-figures">(.*?)</script>', text, re.S).group(1))
    other = next(t for t in figs["timeline"]["data"] if t["name"] == "other")
    assert len(other["x"]) == 2 * 7  # 7 iterations: a short run is shown whole; 2 ranks
    assert all("ranks = 2" in h for h in other["hovertext"])  # the span's own attribute
    loss = figs["chart-loss"]["data"][0]
    assert loss["x"] == list(range(1, 8)) and loss["y"][-1] < loss["y"][0]
    assert "rank 0 · PP 0" in figs["timeline"]["layout"]["yaxis"]["ticktext"]
