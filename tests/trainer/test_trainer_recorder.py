"""The flight recorder in the real trainer: a DP=2 torchrun job on gloo where rank 0 exports
nothing and rank 1 exports ``default``, both recording ``all``.

- One rank made slow at a chosen iteration (the test hook sleeps there): both ranks write the
  same iterations (the slow flag rides on the step's stats reduce), and the recorded spans nest
  under the exported ``megatron.train`` span in ``mlaunch trace summary``.
- An exception (on a PP=2 job) writes the ring before the error file; SIGTERM writes it with
  ``signal``; ``mlaunch trace capture --recorded`` makes every rank write it (``request``), a
  request left by an earlier run is ignored, and bad requests exit 2 with nothing written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.trace_cli import trace_cli
from support.trainer_runs import (
    TINY,
    clean_env,
    progress_lines,
    run_trainer,
    sigterm_after_steps,
    trainer_in_background,
    wait_for,
)

from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp.otlp_json import iter_spans, read_spans
from mlaunch.rundir import layout as lay
from mlaunch.trace.report import render_report

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

K = 4  # --otel-recorder-iters
SLOW_AT = 8


def recorder_env(**extra: str) -> dict[str, str]:
    return {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_EXPORTER": "file",
        "MEGATRON_OTEL_SPAN_GROUPS": "default",
        "MEGATRON_OTEL_EXPORT_STRATEGY": "single_rank",  # the last rank exports
        "MEGATRON_OTEL_RECORDER_GROUPS": "all",
        "MEGATRON_OTEL_RECORDER_ITERS": str(K),
        **extra,
    }


def dumps(run_dir: Path, rank: int) -> list[list[dict]]:
    """Each dump of one rank (one OTLP-JSON line each), as flat spans."""
    path = lay.recorder_file(run_dir, rank)
    return [list(iter_spans(json.loads(line))) for line in path.read_text().splitlines()]


def iterations(spans: list[dict]) -> set[int]:
    return {s["attributes"][Attr.ITERATION] for s in spans if s["name"] == SpanName.ITERATION}


def test_slow_rank_makes_every_rank_dump_the_same_iterations_nested_under_the_export(tmp_path):
    # The hook's 2 s step against tiny steps of tens of ms: a factor of 8 still catches it on a
    # loaded machine, where the default 2x also fires on an ordinary hiccup.
    env = recorder_env(MLAUNCH_TEST_SLOW_AT_ITERATION=str(SLOW_AT), MLAUNCH_TEST_SLOW_RANK="0",
                       MEGATRON_OTEL_RECORDER_SLOW_FACTOR="8")  # fmt: skip
    run = run_trainer(tmp_path, [*TINY, "--train-iters", "11"], nproc=2, env=env)
    assert run.returncode == 0, run.output[-3000:]
    d0, d1 = dumps(run.run_dir, 0), dumps(run.run_dir, 1)
    # A loaded machine may see another slow iteration: every rank then dumps again, together.
    assert len(d0) == len(d1) >= 1
    for a, b in zip(d0, d1, strict=True):
        assert iterations(a) == iterations(b)
        assert {s["attributes"][Attr.RECORDER_TRIGGER] for s in a + b} == {"slow_iteration"}
    slow = [i for i, d in enumerate(d0) if SLOW_AT in iterations(d)]
    assert slow, [sorted(iterations(d)) for d in d0]
    # The dump after the step whose reduce carried the flag: the ring's K iterations (the slow
    # one and those before it) and the step just finished. (A hiccup dump just before it empties
    # the ring, so the slow iteration may come in that one, with the iterations before it.)
    held = sorted(iterations(d0[slow[0]]))
    assert SLOW_AT in held and held[-1] <= SLOW_AT + 1, held
    assert held == list(range(held[0], held[-1] + 1)) and len(held) <= K + 1, held

    # Fine spans on both ranks; nothing recorded was exported.
    for d in (d0, d1):
        names = {s["name"] for dump in d for s in dump}
        assert "megatron.layer.forward" in names or any("layer" in n for n in names), names
        assert any("microbatch" in n for n in names), names
    exported = read_spans(run.run_dir / "telemetry" / "traces-rank1.jsonl")
    assert SpanName.ITERATION not in {s["name"] for s in exported}
    assert not (run.run_dir / "telemetry" / "traces-rank0.jsonl").exists()
    # Recorded iterations are children of the exported megatron.train of their block, on both
    # ranks (the same deterministic trace ids; rank 0 records its train span too).
    trains = {s["span_id"]: s for s in exported if s["name"] == SpanName.TRAIN}
    for s in d1[slow[0]]:
        if s["name"] == SpanName.ITERATION:
            assert s["parent_span_id"] in trains
            assert s["trace_id"] == trains[s["parent_span_id"]]["trace_id"]
    train_traces = {s["trace_id"] for s in trains.values()}
    assert {s["trace_id"] for s in d0[slow[0]]} <= train_traces
    # Rank 0 exports nothing: its own megatron.train, still open at the dump, is written with it
    # (marked open, once), so its recorded iterations nest under it.
    rank0 = [s for d in d0 for s in d]
    ids0 = {s["span_id"]: s for s in rank0}
    assert len(ids0) == len(rank0)  # no span written twice
    open_trains = [s for s in rank0 if s["attributes"].get(Attr.RECORDER_OPEN) is True]
    assert [s["name"] for s in open_trains] == [SpanName.TRAIN]
    for s in d0[slow[0]]:
        if s["name"] == SpanName.ITERATION:
            assert ids0[s["parent_span_id"]]["name"] == SpanName.TRAIN

    code, out = trace_cli("summary", run.run_dir)
    assert code == 0, out
    assert SpanName.ITERATION in out
    # The report marks each dump on its timeline, over the iterations it holds.
    marks = [m for m in render_report(run.run_dir).marks if m.kind == "recorder"]
    assert len(marks) == len(d0), marks
    assert {m.label for m in marks} == {"slow_iteration"}
    assert any(m.iterations and m.iterations[0] <= SLOW_AT <= m.iterations[1] for m in marks)
    assert all(m.ranks == (0, 1) for m in marks)


def test_exception_dumps_before_the_error_file_on_a_pp2_job(tmp_path):
    env = recorder_env(
        MLAUNCH_TEST_FAIL_AT_ITERATION="3",
        MLAUNCH_TEST_FAIL_RANK="1",
        MEGATRON_OTEL_RECORDER_SLOW_FACTOR="1000",  # only the exception writes here
    )
    args = [*TINY, "--train-iters", "5", "--pipeline-model-parallel-size", "2"]
    run = run_trainer(tmp_path, args, nproc=2, env=env)
    assert run.returncode != 0
    error = run.run_dir / lay.ERROR_FILE.name(1)
    recorded = lay.recorder_file(run.run_dir, 1)
    assert error.is_file() and recorded.is_file()
    assert recorded.stat().st_mtime_ns <= error.stat().st_mtime_ns
    spans = [s for d in dumps(run.run_dir, 1) for s in d]
    assert {s["attributes"][Attr.RECORDER_TRIGGER] for s in spans} == {"exception"}
    assert iterations(spans) == {1, 2, 3}
    failed = [s for s in spans if s["name"] == SpanName.ITERATION and s["status_code"] == 2]
    assert [s["attributes"][Attr.ITERATION] for s in failed] == [3]
    # The last stage's cross-stage receive spans are recorded too (without their links).
    assert SpanName.PP_RECV_FORWARD_LINKED in {s["name"] for s in spans}


def test_sigterm_dumps_with_the_signal_trigger(tmp_path):
    run_dir = tmp_path / "run"
    env = clean_env(run_dir, **recorder_env(MEGATRON_OTEL_RECORDER_SLOW_FACTOR="1000"))
    code, output = sigterm_after_steps(tmp_path, run_dir, [*TINY, "--train-iters", "100000"], env)
    assert code == 0, output[-3000:]
    progress = run_dir / "progress.jsonl"
    last = json.loads(progress.read_text().splitlines()[-1])["iteration"]
    spans = [s for d in dumps(run_dir, 0) for s in d]
    assert {s["attributes"][Attr.RECORDER_TRIGGER] for s in spans} == {"signal"}
    held = iterations(spans)
    # One process exports rank 0 here (world of one); what it records is step and finer.
    assert max(held) == last and len(held) == min(K + 1, last)


def test_capture_recorded_dumps_every_rank_and_a_stale_request_is_ignored(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    request = run_dir / lay.CAPTURE_REQUEST_FILE
    # Left behind by an earlier run in the same directory: never applies to this one.
    request.write_text(json.dumps({"id": "stale", "created_ns": 1, "recorded": True}))
    # No slow trigger on a loaded machine: only the request may write here.
    env = recorder_env(MEGATRON_OTEL_RECORDER_SLOW_FACTOR="1000")
    with trainer_in_background(tmp_path, run_dir, [*TINY, "--train-iters", "100000"], env):
        wait_for(lambda: progress_lines(run_dir) >= 3, "progress")
        time.sleep(2.5)  # both watchers have read the stale request by now
        assert not any(lay.recorder_file(run_dir, r).exists() for r in (0, 1))

        code, out = trace_cli("capture", str(run_dir), "--ranks", "x", "--recorded")
        assert code == 2 and "--ranks" in out and "stale" in request.read_text()
        code, out = trace_cli("capture", str(run_dir))
        assert code == 2 and "--recorded" in out and "stale" in request.read_text()

        code, out = trace_cli("capture", str(run_dir), "--recorded")
        assert code == 0, out
        assert "requested" in out and "stale" not in request.read_text()
        wait_for(
            lambda: all(lay.recorder_file(run_dir, r).exists() for r in (0, 1)),
            "both ranks' recorder dumps",
        )
    for rank in (0, 1):
        first = dumps(run_dir, rank)[0]
        assert {s["attributes"][Attr.RECORDER_TRIGGER] for s in first} == {"request"}
        assert SpanName.ITERATION in {s["name"] for s in first}


def test_capture_of_a_finished_run_exits_2_and_writes_nothing(tmp_path):
    run = run_trainer(tmp_path, [*TINY, "--train-iters", "2"], plain=True, env=recorder_env())
    assert run.returncode == 0, run.output[-3000:]
    code, out = trace_cli("capture", str(run.run_dir), "--recorded")
    assert code == 2 and "completed" in out
    assert not (run.run_dir / lay.CAPTURE_REQUEST_FILE).exists()
    code, out = trace_cli("capture", str(tmp_path / "nope"), "--recorded")
    assert code == 2
