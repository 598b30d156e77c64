"""The flight recorder in a ``--script`` worker that uses ``mlaunch.telemetry``: ``mlaunch train
--script`` once refused every ``--otel-recorder-*`` setting for scripts, though only nemo-lens
workers lack the recorder. Two ranks under real torchrun; ``mlaunch trace capture --recorded``
from a second process while the script runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch, progress

from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "telemetry_script.py"


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    """Poll ``predicate`` until true (a hang fails with ``what``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_script_using_mlaunch_telemetry_gets_the_recorder_and_dumps_on_request(tmp_path):
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    proc = mlaunch(
        "--script", str(SCRIPT), "--nproc-per-node", "2", "--device", "cpu",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-span-groups", "per_step",
        "--otel-export-strategy", "all_ranks", "--otel-recorder-groups", "all",
        cwd=tmp_path, env=clean_env(SCRIPT_STOP_FILE=str(stop)),
    )  # fmt: skip
    try:
        wait_for(lambda: len(progress(run_dir)) >= 3 or proc.poll() is not None, "iterations")
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        ask = subprocess.run(
            [sys.executable, "-m", "mlaunch", "trace", "capture", str(run_dir), "--recorded"],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert ask.returncode == 0, ask.stdout + ask.stderr
        files = [lay.recorder_file(run_dir, r) for r in range(2)]
        wait_for(lambda: all(f.exists() and f.stat().st_size for f in files), "both dumps")
    finally:
        stop.touch()
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    # What the summary said (also in resolved.json): nemo-lens workers would not have it.
    resolved = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text())
    assert any("no flight recorder" in t for t in resolved["reference"]["translations"])
    for f in files:
        spans = read_spans(f)
        assert spans and {s["attributes"]["mlaunch.recorder.trigger"] for s in spans} == {"request"}
        # layer is recorded (per_step does not export it); step is exported, never recorded
        names = {s["name"] for s in spans}
        assert SpanName.LAYER_FORWARD in names and SpanName.ITERATION not in names
