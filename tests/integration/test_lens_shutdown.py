"""What the two nemo-lens versions do with a span still open when a Megatron-LM worker stops, and
what mlaunch's readers make of it.

Megatron-LM's SIGTERM handler (``training.py``, telemetry exporting) ends its ``megatron.train``
block and start-up and shuts telemetry down. A span inside them still open then (the iteration a
stopped job was in) is dropped by nemo-lens 0.1.0; 0.2.0 (what Megatron-LM pins) ends it at
shutdown marked ``nemo.span.truncated`` (an attribute and an event). mlaunch's readers count such
spans as truncated (``trace summary``, the span store) and goodput reads their times as written.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import pytest
from support.launch_runs import TIMEOUT_S, clean_env, finish, mlaunch
from support.trace_cli import trace_cli

from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.nemo_lens, pytest.mark.slow]

#: nemo-lens's mark (``nemo.lens.semconv.NEMO_SPAN_TRUNCATED``, 0.2.0), attribute and event.
TRUNCATED = "nemo.span.truncated"


def _hung(report: Path, proc) -> None:
    """Until the worker says it is inside its hung iteration (or the launcher ended)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(report.read_text()).get("hung"):
                return
        time.sleep(0.1)
    raise AssertionError(f"the worker never hung: {proc.communicate(timeout=60)[0][-4000:]}")


def test_the_iteration_a_stopped_worker_was_in_is_exported_truncated_by_0_2_0_only(
    lens_worker_script: Path, lens_version: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    env = clean_env(LENS_WORKER_HANG_AT="2", OTEL_BSP_SCHEDULE_DELAY="100")
    proc = mlaunch("--script", str(lens_worker_script), "--run-dir", str(run_dir),
                   "--nproc-per-node", "1", "--train-iters", "4", "--otel-span-groups",
                   "per_step", cwd=tmp_path, env=env)  # fmt: skip
    _hung(run_dir / "lens-worker-rank0.json", proc)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code != 0, out  # interrupted

    spans = read_spans(lay.traces_file(run_dir, 0))
    steps = {s["attributes"][Attr.ITERATION]: s for s in spans if s["name"] == SpanName.ITERATION}
    truncated = [s for s in spans if s["attributes"].get(TRUNCATED)]
    # the block the handler ended itself is whole in both versions
    assert [s["attributes"].get(TRUNCATED) for s in spans if s["name"] == SpanName.TRAIN] == [None]
    if lens_version == "0.1.0":
        assert sorted(steps) == [1] and truncated == []  # iteration 2 is lost
    else:
        assert sorted(steps) == [1, 2]
        assert truncated == [steps[2]]
        events = [e for e in steps[2]["events"] if e["name"] == TRUNCATED]
        assert events and events[0]["attributes"][f"{TRUNCATED}.reason"]

    # mlaunch's readers: the summary counts it as truncated, besides the launcher's own job and
    # attempt spans (which the interrupted launcher ends marked the same way)
    launcher = read_spans(lay.launcher_traces_file(run_dir, 0))
    assert {s["name"] for s in launcher if s["attributes"].get(TRUNCATED)} == {
        SpanName.JOB,
        SpanName.JOB_ATTEMPT,
    }
    code, text = trace_cli("summary", run_dir, "--json")
    assert code == 0, text
    summary = json.loads(text)
    assert summary["truncated"] == len(truncated) + 2
    by_name = {s["name"]: s for s in summary["spans"]}
    assert by_name[SpanName.ITERATION]["count"] == len(steps)
    assert by_name[SpanName.ITERATION]["truncated"] == len(truncated)
