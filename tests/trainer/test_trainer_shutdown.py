"""How the trainer ends when it does not end normally: a rank that raises (the test hook) and a
SIGTERM (finish the iteration, checkpoint, flush telemetry, exit 0)."""

from __future__ import annotations

import json

import pytest
from support.trainer_runs import TINY, clean_env, run_trainer, sigterm_after_steps, telemetry_env

from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_failing_rank_exits_nonzero_with_the_exception_on_its_span_and_in_its_error_file(
    tmp_path,
):
    env = {
        **telemetry_env("per_step"),
        "MLAUNCH_TEST_FAIL_AT_ITERATION": "2",
        "MLAUNCH_TEST_FAIL_RANK": "1",
    }
    run = run_trainer(tmp_path, [*TINY, "--train-iters", "4"], nproc=2, env=env)
    assert run.returncode != 0
    assert "injected failure at iteration 2" in run.output  # torchelastic's error report (record)

    error = json.loads((run.run_dir / "error-rank1.json").read_text())
    assert error["rank"] == 1 and error["exception_type"] == "RuntimeError"
    assert "injected failure at iteration 2" in error["message"]
    assert "_maybe_fail" in error["traceback"]

    spans = read_spans(run.run_dir / "telemetry" / "traces-rank1.jsonl")
    step = [
        s for s in spans if s["name"] == SpanName.ITERATION and s["attributes"][Attr.ITERATION] == 2
    ]
    assert len(step) == 1
    assert step[0]["status_code"] == 2  # ERROR
    events = [e for e in step[0]["events"] if e["name"] == "exception"]
    assert events and events[0]["attributes"]["exception.type"] == "RuntimeError"
    # The exception left the megatron.train block too, so it is ERROR as well; start-up ended
    # before training (there is no run-long span to fail).
    errors = {s["name"] for s in spans if s["status_code"] == 2}
    assert SpanName.TRAIN in errors and SpanName.STARTUP not in errors


def test_sigterm_finishes_the_iteration_checkpoints_and_exits_zero(tmp_path):
    run_dir = tmp_path / "run"
    env = clean_env(run_dir, **telemetry_env("per_step"))
    ck = tmp_path / "ck"
    args = [*TINY, "--train-iters", "100000", "--save", str(ck)]
    code, output = sigterm_after_steps(tmp_path, run_dir, args, env)
    assert code == 0, output[-3000:]
    progress = run_dir / "progress.jsonl"
    assert "stop requested by signal" in output
    last = json.loads(progress.read_text().splitlines()[-1])["iteration"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    assert (ck / f"iter_{last:07d}" / "manifest.json").is_file()
    spans = read_spans(run_dir / "telemetry" / "traces-rank0.jsonl")
    names = {s["name"] for s in spans}
    assert {SpanName.STARTUP, SpanName.TRAIN, SpanName.CHECKPOINT_SAVE} <= names
    assert all(s["status_code"] != 2 for s in spans)
    # The train block was still open when the signal stopped the run: it ends marked
    # nemo.span.truncated, and the spans that finished (start-up, the steps, the save) do not.
    truncated = {s["name"] for s in spans if s["attributes"].get(Attr.TRUNCATED) is True}
    assert SpanName.TRAIN in truncated
    assert not truncated & {SpanName.STARTUP, SpanName.ITERATION, SpanName.CHECKPOINT_SAVE}
