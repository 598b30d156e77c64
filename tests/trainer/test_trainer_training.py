"""Training behaviour on real torchrun jobs (gloo, CPU, tiny model): the loss goes down, pipeline and
data parallelism reproduce the single-process loss sequence, and resuming (including past a
corrupt checkpoint) continues it exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.trainer_runs import TINY, Run, run_trainer, telemetry_env

from mlaunch.model.spans import Attr, Metric, SpanName
from mlaunch.otlp.otlp_json import read_metrics, read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS = 20
ARGS = [*TINY, "--train-iters", str(ITERS)]


def assert_close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b), (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert math.isclose(x, y, rel_tol=rel), f"iteration {i + 1}: {x} != {y}"


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-3000:]
    return run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("training")


@pytest.fixture(scope="module")
def baseline(workdir) -> Run:
    """One plain process (no torchrun), 20 iterations, default corpus."""
    return ok(run_trainer(workdir, ARGS, plain=True, name="baseline"))


def test_loss_goes_down_on_the_default_corpus(baseline):
    losses = baseline.losses()
    assert len(losses) == ITERS
    records = baseline.progress()
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert {
        "iteration",
        "train_iters",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "step_ms",
        "skipped",
    } <= set(records[0])
    assert losses[0] > math.log(256) - 0.5  # starts near uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_pipeline_parallel_matches_one_stage(workdir, baseline):
    pp = ok(
        run_trainer(workdir, [*ARGS, "--pipeline-model-parallel-size", "2"], nproc=2, name="pp2")
    )
    assert_close(pp.losses(), baseline.losses(), rel=1e-4)


def test_data_parallel_matches_one_process_with_the_same_global_batch(workdir, baseline):
    dp = ok(run_trainer(workdir, ARGS, nproc=2, name="dp2"))
    assert_close(dp.losses(), baseline.losses(), rel=1e-4)


def test_data_parallel_with_many_buckets_overlapping_backward_matches_one_process(
    workdir, baseline
):
    # ~10k elements per bucket: the tiny model's gradients travel in several buckets, each
    # all-reduced from inside the last backward as soon as it is complete.
    args = [*ARGS, "--ddp-bucket-size", "10000"]
    dp = ok(run_trainer(workdir, args, nproc=2, name="dp2-buckets"))
    assert_close(dp.losses(), baseline.losses(), rel=1e-4)
    records = dp.progress()
    assert records and all(r["grad_buckets"] >= 3 for r in records)
    assert all(r["grad_buckets_in_backward"] == r["grad_buckets"] for r in records)


def test_resume_with_dropout_draws_the_same_masks_as_a_straight_run(workdir, baseline):
    # Dropout draws from the RNG: a resume that restored it wrongly would change the losses.
    args = [*TINY, "--train-iters", "6", "--hidden-dropout", "0.2"]
    straight = ok(run_trainer(workdir, args, name="dropout", plain=True))
    assert not math.isclose(straight.losses()[1], baseline.losses()[1], rel_tol=1e-6)  # on
    ck = workdir / "ck-dropout"
    save = [*args, "--save", str(ck), "--save-interval", "3", "--exit-interval", "3"]
    ok(run_trainer(workdir, save, name="dropout-a", plain=True))
    second = ok(run_trainer(workdir, [*args, "--load", str(ck)], name="dropout-b", plain=True))
    assert [r["iteration"] for r in second.progress()] == [4, 5, 6]
    assert_close(second.losses(), straight.losses()[3:], rel=1e-6)


def test_resume_continues_the_same_loss_sequence_and_skips_a_corrupt_checkpoint(workdir, baseline):
    ck = workdir / "ck"
    first = ok(
        run_trainer(
            workdir,
            [*ARGS, "--save", str(ck), "--save-interval", "10", "--exit-interval", "10"],
            name="resume-a",
            plain=True,
        )
    )
    assert [r["iteration"] for r in first.progress()] == list(range(1, 11))
    assert (ck / "iter_0000010" / "manifest.json").is_file()

    (ck / ".tmp.iter_0000099").mkdir()  # what a save killed mid-write leaves behind
    second = ok(
        run_trainer(
            workdir,
            [
                *ARGS,
                "--load",
                str(ck),
                "--save",
                str(ck),
                "--save-interval",
                "5",
                "--keep-last",
                "2",
            ],
            env=telemetry_env("per_step"),
            name="resume-b",
            plain=True,
        )
    )
    assert "resuming from checkpoint" in second.output and "iter_0000010" in second.output
    assert [r["iteration"] for r in second.progress()] == list(range(11, 21))
    assert_close(second.losses(), baseline.losses()[10:], rel=1e-6)
    assert sorted(p.name for p in ck.glob("iter_*")) == [
        "iter_0000015",
        "iter_0000020",
    ]  # --keep-last 2
    assert not list(ck.glob(".tmp.*"))  # never mistaken for a checkpoint, and cleaned up
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    # The resumed process's spans and metrics (telemetry on; the losses above are unchanged by it).
    spans = read_spans(second.run_dir / "telemetry" / "traces-rank0.jsonl")
    by_name = {s["name"]: s for s in spans}
    load = by_name[SpanName.CHECKPOINT_LOAD]
    assert load["attributes"][Attr.ITERATION] == 10
    assert by_name[SpanName.CHECKPOINT_LOAD_IO_READ]["parent_span_id"] == load["span_id"]
    assert by_name[SpanName.FIRST_ITERATION]["attributes"][Attr.ITERATION] == 11
    steps = sorted(
        s["attributes"][Attr.ITERATION] for s in spans if s["name"] == SpanName.ITERATION
    )
    assert steps == list(range(11, 21))
    metrics = {
        m["name"]: m for m in read_metrics(second.run_dir / "telemetry" / "metrics-rank0.jsonl")
    }
    durations = metrics[Metric.STEP_DURATION_MS]
    assert durations["kind"] == "histogram" and int(durations["data_points"][-1]["count"]) == 10
    assert {Metric.LOSS, Metric.GRAD_NORM, Metric.LEARNING_RATE, Metric.TOKENS_PER_SEC} <= set(
        metrics
    )

    # Corrupt the newest checkpoint: loading falls back to iteration 15 and says why.
    shard = ck / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    third = ok(run_trainer(workdir, [*ARGS, "--load", str(ck)], name="resume-c", plain=True))
    assert "iter_0000020 is invalid" in third.output and "sha256" in third.output
    assert [r["iteration"] for r in third.progress()] == list(range(16, 21))
    assert_close(third.losses(), baseline.losses()[15:], rel=1e-6)


def test_an_iteration_with_non_finite_gradients_is_skipped_and_counted(workdir):
    run = ok(
        run_trainer(
            workdir,
            [*TINY, "--train-iters", "6", "--log-interval", "6"],
            env={"MLAUNCH_TEST_NAN_AT_ITERATION": "3"},
            name="nan",
            plain=True,
        )
    )
    records = run.progress()
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert records[2]["grad_norm"] is None  # NaN is written as null
    assert all(math.isfinite(r["loss"]) for r in records)
    assert "skipped 1" in run.output  # the counter in the log line
