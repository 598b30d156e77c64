"""The span store of a ``--script`` run whose two workers export to the launcher's embedded OTLP
receiver (real torchrun, ``mlaunch.telemetry`` in the workers): it is in the run directory when
``mlaunch train`` returns, before any ``mlaunch trace`` command, and it holds what a store built
afresh from the same run's OTLP-JSON holds, row for row."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.full_disk import full_disk_site
from support.launch_runs import clean_env, finish, mlaunch, progress
from support.trace_compare import json_store_rows, store_rows

from mlaunch.rundir import layout as lay
from mlaunch.trace.reader import discover
from mlaunch.trace.store import open_store
from mlaunch.trace.store_layout import is_fresh, load_manifest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "telemetry_script.py"


def test_the_receivers_run_has_its_store_when_train_returns(tmp_path: Path) -> None:
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    proc = mlaunch(
        "--script", str(SCRIPT), "--nproc-per-node", "2", "--device", "cpu",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-export-strategy", "all_ranks",
        cwd=tmp_path, env=clean_env(SCRIPT_STOP_FILE=str(stop), MLAUNCH_TEST_STORE_MIN_BYTES="0"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(progress(run_dir)) < 5 and proc.poll() is None:
            assert time.monotonic() < deadline, "no iterations"
            time.sleep(0.1)
    finally:
        stop.touch()
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    stats = json.loads(lay.receiver_stats_file(run_dir).read_text())
    assert stats["mode"] == "embedded" and stats["signals"]["traces"]["written_items"] > 0
    man = load_manifest(run_dir)
    assert man is not None and is_fresh(run_dir, man, discover(run_dir)), "no store at the end"
    assert man.spans >= stats["signals"]["traces"]["written_items"]  # + the launcher's job trace
    assert "span store" not in out
    assert store_rows(open_store(run_dir)) == json_store_rows(run_dir, tmp_path / "fresh")


def test_a_full_disk_at_the_run_end_build_keeps_the_exit_code_and_the_json(
    tmp_path: Path,
) -> None:
    """mlaunch's trainer (file exporter, no receiver): the launcher's run-end build meets a full
    disk (every Parquet write of its store process fails with ENOSPC): the run still exits 0,
    says so in one line, leaves every span in the JSON, and the next read builds the store."""
    from support.trace_cli import invoke_trace

    from mlaunch.otlp.otlp_json import read_spans

    site = full_disk_site(tmp_path)
    run_dir = tmp_path / "run"
    code, out = finish(mlaunch("--train-iters", "3", "--run-dir", str(run_dir), cwd=tmp_path,
                               env=clean_env(PYTHONPATH=str(site),
                                             MLAUNCH_TEST_STORE_MIN_BYTES="0")))  # fmt: skip
    assert code == 0, out[-4000:]
    lines = [line for line in out.splitlines() if "span store" in line]
    assert len(lines) == 1 and "No space left on device" in lines[0], lines
    assert load_manifest(run_dir) is None
    steps = [s for r in (0, 1) for s in read_spans(lay.traces_file(run_dir, r))
             if s["name"] == "megatron.train.iteration"]  # fmt: skip
    assert len(steps) == 6
    r = invoke_trace("summary", run_dir, "--json")
    assert r.exit_code == 0, r.output
    assert load_manifest(run_dir) is not None
