"""``progress.jsonl``'s one typed read path: what the trainer writes reads back as the record it
wrote, and what an earlier trainer or a crash left still reads as far as it goes."""

from __future__ import annotations

import math
from dataclasses import replace

from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import (
    ProgressEval,
    ProgressStep,
    progress_line,
    read_progress_record,
    read_progress_tail,
)

STEP = ProgressStep(
    iteration=3, train_iters=10, loss=2.5, lr=1e-3, grad_norm=0.75, tokens_per_sec=1234.0,
    step_ms=12.5, cpu_ms=11.0, skipped=False, time=1700000000.5,
)  # fmt: skip


def test_a_written_step_and_eval_read_back_as_the_records_written() -> None:
    assert read_progress_record(progress_line(STEP)) == STEP
    with_buckets = replace(STEP, grad_buckets=4, grad_buckets_in_backward=3)
    assert read_progress_record(progress_line(with_buckets).encode()) == with_buckets
    for sample in (None, "once upon"):
        written = ProgressEval(iteration=5, eval_loss=2.25, sample=sample)
        assert read_progress_record(progress_line(written)) == written


def test_a_non_finite_float_is_written_as_null_and_reads_as_none() -> None:
    skipped = replace(STEP, grad_norm=math.inf, skipped=True)
    read = read_progress_record(progress_line(skipped))
    assert isinstance(read, ProgressStep) and read.grad_norm is None and read.skipped is True


def test_a_key_an_earlier_trainer_did_not_write_reads_as_none() -> None:
    read = read_progress_record('{"iteration": 2, "loss": 3.0, "time": 5.0, "extra": 1}')
    assert read == ProgressStep(
        iteration=2, train_iters=None, loss=3.0, lr=None, grad_norm=None, tokens_per_sec=None,
        step_ms=None, cpu_ms=None, skipped=None, time=5.0,
    )  # fmt: skip
    assert read_progress_record('{"eval_loss": 1.5}') == ProgressEval(None, 1.5)


def test_a_line_with_eval_loss_is_an_evaluation_as_every_reader_tells_them_apart() -> None:
    read = read_progress_record('{"iteration": 4, "loss": 1.0, "eval_loss": 2.0}')
    assert read == ProgressEval(iteration=4, eval_loss=2.0)


def test_a_cut_line_or_a_line_of_neither_record_reads_as_none() -> None:
    line = progress_line(STEP)
    for raw in (line[:-10], b"", "[1, 2]", '"text"', '{"iteration": 7}', b"\xff\xfe"):
        assert read_progress_record(raw) is None


def test_the_tail_holds_the_newest_steps_in_order_without_the_line_the_cut_falls_in(
    tmp_path,
) -> None:
    steps = [replace(STEP, iteration=i) for i in range(1, 41)]
    lines = [progress_line(s) for s in steps]
    lines.insert(20, progress_line(ProgressEval(20, 3.0)))
    (tmp_path / lay.PROGRESS_FILE).write_text("".join(lines) + lines[-1][:-10])  # a cut last line
    assert read_progress_tail(tmp_path, 1 << 20) == steps
    # A limit that ends 5 bytes into iteration 29's line: that line is dropped, not misread.
    limit = sum(map(len, lines[30:])) + len(lines[-1]) - 10 + 5
    assert read_progress_tail(tmp_path, limit) == steps[29:]
    assert read_progress_tail(tmp_path / "nowhere") == []
