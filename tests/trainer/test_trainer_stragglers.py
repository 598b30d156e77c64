"""Straggler attribution on the real trainer: a DP=2 x PP=2 torchrun job on gloo with every rank
exporting, where rank 1 (stage 0, data-parallel rank 1) sleeps in its first microbatch's forward
at chosen iterations (the trainer's test hook). Every rank's step absorbs the sleep, so step
times cannot tell who was slow; ``mlaunch trace stragglers`` names rank 1 and ``forward``.
With one exporting rank it exits 2 and says how to get every rank's spans; the flight
recorders' dumps of that same one-exporter job are such spans (the slow step makes every rank
dump) and name the rank.
"""

from __future__ import annotations

import json
import shutil

import pytest
from support.trace_cli import invoke_trace, user_error
from support.trainer_runs import TINY, run_trainer, telemetry_env

from mlaunch.model.spans import Attr, SpanName
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SLOW_RANK = 1
SLOW_AT = (3, 6)
ITERS = 8
DP_PP = [*TINY, "--pipeline-model-parallel-size", "2", "--train-iters", str(ITERS)]


def test_a_rank_slow_in_forward_is_named_although_every_step_time_is_the_same(tmp_path):
    env = {
        **telemetry_env("per_step,microbatch"),
        "MLAUNCH_TEST_SLOW_FORWARD_AT": ",".join(map(str, SLOW_AT)),
        "MLAUNCH_TEST_SLOW_RANK": str(SLOW_RANK),
    }
    run = run_trainer(tmp_path, DP_PP, nproc=4, env=env)
    assert run.returncode == 0, run.output[-3000:]

    # Every rank's step of a slow iteration holds the whole 1 s sleep (the step's all-ranks
    # reduce waits for rank 1): per-rank step times are the same, the slow rank's included.
    # The data-parallel replicas seed Python's random alike (--seed): their span ids must
    # still be their own (they were not: every send_forward id was on two ranks).
    ids_of: dict[int, set[str]] = {}
    for rank in range(4):
        spans = read_spans(run.run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        ids_of[rank] = {s["span_id"] for s in spans}
        steps = {
            s["attributes"][Attr.ITERATION]: (s["end_ns"] - s["start_ns"]) / 1e9
            for s in spans
            if s["name"] == SpanName.ITERATION
        }
        assert all(steps[i] >= 1.0 for i in SLOW_AT), (rank, steps)

    for rank in range(4):
        for other in range(rank + 1, 4):
            assert not ids_of[rank] & ids_of[other], (rank, other)

    res = invoke_trace("stragglers", run.run_dir, "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["ranks"]
    top = rows[0]
    assert (top["rank"], top["phase"]) == (SLOW_RANK, "forward"), rows
    assert set(SLOW_AT) <= set(top["iterations"]), rows
    text = invoke_trace("stragglers", run.run_dir)
    assert f"rank {SLOW_RANK} made the others wait most" in text.output, text.output


def test_one_exporting_rank_exits_2_and_its_flight_recorders_name_the_straggler(tmp_path):
    # One job for both (each is a 4-process run): what the one exporting rank wrote alone is
    # refused, with the way to get every rank's spans; with the recorders' dumps it is answered.
    env = {
        **telemetry_env("per_step"),
        "MEGATRON_OTEL_EXPORT_STRATEGY": "single_rank",
        "MEGATRON_OTEL_RECORDER_GROUPS": "per_step,microbatch",
        "MEGATRON_OTEL_RECORDER_ITERS": "4",
        "MLAUNCH_TEST_SLOW_FORWARD_AT": "8",
        "MLAUNCH_TEST_SLOW_RANK": str(SLOW_RANK),
    }
    run = run_trainer(tmp_path, [*DP_PP[:-1], "12"], nproc=4, env=env)
    assert run.returncode == 0, run.output[-3000:]
    exported = tmp_path / "exported"  # the run as its exporter left it, before any dump
    shutil.copytree(run.run_dir, exported, ignore=shutil.ignore_patterns("recorder-*"))
    assert [p.name for p in (exported / "telemetry").glob("traces-*")] == ["traces-rank3.jsonl"]
    user_error(invoke_trace("stragglers", exported), "only rank 3 of 4", "all_ranks")
    for rank in range(4):  # the 1 s step is slow on every rank: every rank dumped
        assert (run.run_dir / "telemetry" / f"recorder-rank{rank}.jsonl").is_file()
    res = invoke_trace("stragglers", run.run_dir, "--json")
    assert res.exit_code == 0, res.output
    top = json.loads(res.output)["ranks"][0]
    assert (top["rank"], top["phase"]) == (SLOW_RANK, "forward") and 8 in top["iterations"]
