"""Live capture (``mlaunch trace capture --groups SPEC --iterations N | --seconds S``) on real
torchrun jobs on gloo, sent from a second process while the job trains.

The runs use the default export strategy with ``default`` groups: one rank exports, the other
exports nothing, so every capture also covers a rank whose exporter starts on demand.
- ``all`` for 5 iterations (DP=2 and PP=2): layer and microbatch spans on every rank, for
  exactly the same 5 iterations (the one the command printed and the 4 after it) and none
  outside, each marked with the capture id, nested under the iteration spans of the same trace
  ids on both ranks; ``mlaunch trace report`` marks the window on its timeline.
- ``--seconds``: every rank starts at the printed iteration and ends on its own clock; a request
  left by an earlier run is ignored; bad requests exit 2 and leave the request file as it was,
  and so does a capture while another one runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.trace_cli import trace_cli
from support.trainer_runs import TINY, progress_lines, trainer_in_background, wait_for

from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import Attr, SpanName, span_def
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay
from mlaunch.trace.report import render_report

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ENV = {
    "MEGATRON_OTEL_ENABLED": "1",
    "MEGATRON_OTEL_EXPORTER": "file",
    "MEGATRON_OTEL_SPAN_GROUPS": "default",
}
LONG = [*TINY, "--train-iters", "100000"]
FINE = (SpanGroup.LAYER, SpanGroup.MICROBATCH)


def capture(run_dir: Path, *args: str) -> tuple[int, str]:
    """``mlaunch trace capture RUN ARGS`` in a second process (as a user in another terminal)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "capture", str(run_dir), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def spans_by_rank(run_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for rank in (0, 1):
        path = lay.traces_file(run_dir, rank)
        out[rank] = read_spans(path) if path.exists() else []
    return out


def iteration_of(span: dict, by_id: dict[str, dict]) -> int | None:
    """The iteration a span ran in: its nearest ``megatron.train.iteration`` ancestor's."""
    node: dict | None = span
    while node is not None:
        if node["name"] == SpanName.ITERATION:
            return node["attributes"][Attr.ITERATION]
        node = by_id.get(node["parent_span_id"])
    return None


def group_of(name: str) -> SpanGroup | None:
    try:
        return span_def(name).group
    except KeyError:
        return None


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_capture_all_for_5_iterations_gives_fine_spans_on_every_rank_for_exactly_those(
    tmp_path, layout
):
    run_dir = tmp_path / "run"
    args = [*LONG, "--pipeline-model-parallel-size", "2"] if layout == "pp2" else LONG
    with trainer_in_background(tmp_path, run_dir, args, ENV):
        wait_for(lambda: progress_lines(run_dir) >= 3, "progress")
        code, out = capture(run_dir, "--groups", "all", "--iterations", "5", "--wait", "--json")
        assert code == 0, out
    result = json.loads(out)
    start, cid = result["start_iteration"], result["id"]
    assert result["end_iteration"] == start + 4 and result["complete"] is True
    assert result["expected_ranks"] == [0, 1]
    # The default strategy exports one rank; the other started its exporter for the capture.
    assert len(result["exporter_started"]) == 1
    for rank in (0, 1):
        ack = result["outcome"][str(rank)]
        assert (ack["state"], ack["first_iteration"], ack["last_iteration"]) == (
            "done", start, start + 4,
        )  # fmt: skip

    window = set(range(start, start + 5))
    trace_ids = {}
    for rank, spans in spans_by_rank(run_dir).items():
        by_id = {s["span_id"]: s for s in spans}
        fine = [s for s in spans if group_of(s["name"]) in FINE]
        for group in FINE:
            assert any(group_of(s["name"]) == group for s in fine), (rank, group)
        assert {iteration_of(s, by_id) for s in fine} == window, rank
        assert {s["attributes"].get(Attr.CAPTURE_ID) for s in fine} == {cid}
        iters = [s for s in spans if s["name"] == SpanName.ITERATION]
        assert sorted(s["attributes"][Attr.ITERATION] for s in iters) == sorted(window)
        trace_ids[rank] = {s["attributes"][Attr.ITERATION]: s["trace_id"] for s in iters}
    # The same deterministic trace ids on both ranks (the run's block traces).
    assert trace_ids[0] == trace_ids[1]

    # The report shows the window (a band over it, named by the capture) with every rank's
    # layer spans in it.
    report = render_report(run_dir)
    captures = [m for m in report.marks if m.kind == "capture"]
    assert [(m.label, m.iterations, m.ranks) for m in captures] == [
        (cid, (start, start + 4), (0, 1))
    ]
    assert f"capture:{cid}" in report.html
    assert any(cid in note for note in report.notes)
    assert any(start <= a <= start + 4 for a, _ in report.window), report.window


def test_capture_seconds_stale_and_bad_requests_on_a_running_job(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    request = run_dir / lay.CAPTURE_REQUEST_FILE
    # Left behind by an earlier run in the same directory: never applies to this one.
    request.write_text(
        json.dumps(
            {
                "id": "stale",
                "created_ns": 1,
                "groups": "all",
                "iterations": 3,
                "start_iteration": 1,
            },
        )  # fmt: skip
    )
    with trainer_in_background(tmp_path, run_dir, LONG, ENV):
        wait_for(lambda: progress_lines(run_dir) >= 3, "progress")
        acks = [lay.capture_ack_file(run_dir, r) for r in (0, 1)]
        wait_for(lambda: all(a.exists() for a in acks), "both ranks listening")
        for ack in acks:
            assert json.loads(ack.read_text())["state"] == "listening"

        before = request.read_bytes()
        for bad, needle in (
            (["--groups", "all", "--iterations", "0"], "--iterations 0"),
            (["--groups", "all", "--iterations", "2", "--seconds", "1"], "exactly one"),
            (["--groups", "all"], "exactly one"),
            (["--iterations", "3"], "--groups"),
            ([], "nothing to capture"),
            (["--groups", "al", "--iterations", "3"], "al"),
            (["--groups", "all", "--iterations", "3", "--ranks", "5"], "rank 5"),
        ):
            code, out = capture(run_dir, *bad)
            assert code == 2 and needle in out and "Traceback" not in out, (bad, out)
            assert len(out.strip().splitlines()) == 1, out
            assert request.read_bytes() == before

        code, out = capture(
            run_dir, "--groups", "step,microbatch,layer", "--seconds", "2", "--wait", "--json"
        )
        assert code == 0, out
        result = json.loads(out)
        start, cid = result["start_iteration"], result["id"]
        outcome = {int(r): a for r, a in result["outcome"].items()}
        for ack in outcome.values():
            assert ack["state"] == "done" and ack["first_iteration"] == start
            assert ack["last_iteration"] >= start

        # A long capture is running: another one is refused and the request stays as it is.
        code, out = capture(run_dir, "--groups", "layer", "--iterations", "100000")
        assert code == 0, out
        before = request.read_bytes()
        code, out = trace_cli("capture", str(run_dir), "--groups", "all", "--iterations", "2")
        assert code == 2 and "still running" in out, out
        assert request.read_bytes() == before
    for rank, spans in spans_by_rank(run_dir).items():
        by_id = {s["span_id"]: s for s in spans}
        ours = [s for s in spans if s["attributes"].get(Attr.CAPTURE_ID) == cid]
        assert {group_of(s["name"]) for s in ours} >= {SpanGroup.LAYER, SpanGroup.MICROBATCH}
        window = set(range(start, outcome[rank]["last_iteration"] + 1))
        assert {iteration_of(s, by_id) for s in ours} == window, rank
        assert not [s for s in spans if s["attributes"].get(Attr.CAPTURE_ID) == "stale"]


def test_capture_with_profiler_writes_a_readable_trace_tagged_with_the_run_trace_ids(tmp_path):
    run_dir = tmp_path / "run"
    with trainer_in_background(tmp_path, run_dir, LONG, ENV):
        wait_for(lambda: progress_lines(run_dir) >= 3, "progress")
        code, out = capture(
            run_dir, "--groups", "step", "--iterations", "2", "--profiler", "--wait", "--json"
        )
        assert code == 0, out
    result = json.loads(out)
    cid, start = result["id"], result["start_iteration"]
    spans = spans_by_rank(run_dir)
    for rank in (0, 1):
        ack = result["outcome"][str(rank)]
        path = Path(ack["profiler_file"])
        assert path == lay.profiler_trace_file(run_dir, rank, cid) and ack["note"] == ""
        doc = json.loads(path.read_text())
        assert doc["traceEvents"], rank
        assert doc["distributedInfo"]["rank"] == rank
        meta = doc["mlaunch"]
        assert (meta["mlaunch.capture.id"], meta["rank"]) == (cid, rank)
        assert (meta["first_iteration"], meta["last_iteration"]) == (start, start + 1)
        # The trace ids of the captured iteration spans: the profile sits beside them.
        steps = [s for s in spans[rank] if s["attributes"].get(Attr.CAPTURE_ID) == cid]
        assert steps and {s["trace_id"] for s in steps} <= set(meta["trace_ids"])
