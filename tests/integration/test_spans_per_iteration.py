"""The spans-per-iteration estimate (``estimate_spans_per_iteration``: what ``groups resolve``
prints and what ``mlaunch train``'s summary and ``resolved.json`` show) against the spans real
``mlaunch train`` runs export.

The rule it states: per exporting rank, one iteration is its ``megatron.train.iteration`` span
and everything beneath it (or, with the step group off, what would be beneath it). Exactly that
count, in every iteration, the first included: the first iteration's extra wrapper
``megatron.train.first_iteration`` (once per block), start-up, the block root, checkpoint saves
and evaluations hang outside every iteration and are not counted. The default run's shape has 2
data-parallel replicas, so ``groups resolve``'s defaults count its grad_sync spans."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch

from mlaunch.model.spans import Repeat, SpanName, span_def
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS = 3
STEADY = {Repeat.ITERATION, Repeat.MICROBATCH, Repeat.LAYER}

#: id -> (train flags, the `groups resolve` arguments of the same shape, if it has one).
RUNS = {
    # The embedded default (per_step, 2 layers, 2 microbatches, dp 2), with a save and an
    # evaluation inside the run: they stay outside the iterations.
    "default": (
        ["--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2"], ["per_step"]
    ),
    "all-offload-4mb-3layers": (
        ["--otel-span-groups", "all", "--num-layers", "3", "--global-batch-size", "16",
         "--offload-activations"],
        None,  # `groups resolve` has no offload: the launch's own estimate only
    ),
    # a mix without forward_backward or job: the microbatches attach to the step
    "mix": (
        ["--otel-span-groups", "step,microbatch,layer,optimizer,communication"],
        ["step,microbatch,layer,optimizer,communication"],
    ),
    "pp2-all": (
        ["--config", "pp2", "--otel-span-groups", "all"],
        ["all", "--pp", "2", "--layers", "4", "--microbatches", "4", "--dp", "1"],
    ),
}  # fmt: skip


def _iterations(spans: list[dict]) -> list[int]:
    """The spans of each iteration: its step span and everything beneath it."""
    children: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        children[s["parent_span_id"]].append(s)

    def subtree(s: dict) -> int:
        return 1 + sum(subtree(c) for c in children[s["span_id"]])

    steps = sorted(
        (s for s in spans if s["name"] == SpanName.ITERATION), key=lambda s: s["start_ns"]
    )
    return [subtree(s) for s in steps]


@pytest.mark.parametrize("run_id", list(RUNS))
def test_the_estimate_is_each_iterations_span_count_in_a_real_run(tmp_path: Path, run_id: str):
    train, resolve = RUNS[run_id]
    run_dir = tmp_path / "run"
    code, out = finish(mlaunch(
        "--run-dir", str(run_dir), "--train-iters", str(ITERS), "--eval-interval", "0", *train,
        cwd=tmp_path, env=clean_env(COLUMNS="200"),
    ))  # fmt: skip
    assert code == 0, out
    estimate = json.loads((run_dir / "resolved.json").read_text())["spans_per_iteration"]
    if resolve is not None:
        shown = subprocess.run(
            [sys.executable, "-m", "mlaunch", "groups", "resolve", *resolve, "--json"],
            capture_output=True, text=True, timeout=120, env=clean_env(), check=True,
        ).stdout  # fmt: skip
        assert json.loads(shown)["estimate"]["spans_per_iteration_per_stage"] == estimate
    assert f"~{max(estimate)} per iteration per exporting rank" in out  # the launch summary
    files = sorted((run_dir / "telemetry").glob("traces-rank*.jsonl"))
    assert len(files) == 2
    for path in files:
        spans = read_spans(path)
        stage = spans[0]["resource"]["dl.pipeline_parallel.rank"]
        assert _iterations(spans) == [estimate[stage]] * ITERS, path.name
        # and no span the estimate counts lies outside an iteration
        steady = Counter(span_def(s["name"]).repeat in STEADY for s in spans)
        assert steady[True] == estimate[stage] * ITERS, path.name
