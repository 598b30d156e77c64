"""Megatron-LM's metrics, by name, from a real nemo-lens worker: the embedded receiver writes
the worker's ``megatron.training.*`` metrics to the run directory, and ``mlaunch trace report``
draws the loss, learning-rate and grad-norm curves from them (a Megatron-LM worker writes no
``progress.jsonl`` and its step spans carry no loss), through the span store and the JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch
from support.trace_cli import invoke_trace

from mlaunch.model.spans import METRICS, Metric
from mlaunch.otlp.otlp_json import read_metrics, read_spans

pytestmark = [pytest.mark.nemo_lens, pytest.mark.slow, pytest.mark.distributed]

ITERS = 12

#: What the worker records at iteration i (tests/support/lens_worker.py): curve -> value.
RECORDED = {
    "chart-loss": lambda i: 10.0 / i,
    "chart-lr": lambda i: 1e-3 / i,
    "chart-grad-norm": lambda i: 1.0 + 1.0 / i,
}


def _figures(page: Path) -> dict:
    m = re.search(
        r'<script type="application/json" id="report-figures">(.*?)</script>',
        page.read_text(),
        re.S,
    )
    assert m
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_report_curves_read_a_megatron_workers_metrics(lens_worker_script, tmp_path):
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(lens_worker_script), "--nproc-per-node", "2", "--device", "cpu",
        "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "0",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-span-groups", "per_step",
        cwd=tmp_path,
        env=clean_env(LENS_WORKER_ITER_SECONDS="0.01", OTEL_METRIC_EXPORT_INTERVAL="100"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    assert not (run_dir / "progress.jsonl").exists()  # not mlaunch's trainer: no progress file

    # What the worker exported, as Megatron-LM names, kinds and units them: mlaunch's catalogue.
    kinds = {"histogram": "histogram", "gauge": "gauge", "counter": "sum"}
    catalogue = {m.name: (kinds[m.kind], m.unit) for m in METRICS}
    exported = {
        m["name"]: (m["kind"], m["unit"])
        for path in (run_dir / "telemetry").glob("metrics-rank*.jsonl")
        for m in read_metrics(path)
    }
    # skipped_iters is added to only when an iteration was skipped (none here), as in Megatron-LM.
    assert exported == {k: v for k, v in catalogue.items() if k != Metric.SKIPPED_ITERS}

    for engine, extra in {"store": (), "json": ("--skip-invalid",)}.items():
        page = tmp_path / f"{engine}.html"
        r = invoke_trace("report", run_dir, "-o", page, *extra)
        assert r.exit_code == 0, r.output
        figures = _figures(page)
        for chart, value in RECORDED.items():
            (line,) = figures[chart]["data"]
            points = list(zip(line["x"], line["y"], strict=True))
            assert points, (engine, chart)
            # Each point is at the iteration whose step last ended before the export: the gauge
            # then holds that iteration's value, or the one before (set just after the step).
            for x, y in points:
                assert any(y == pytest.approx(value(j)) for j in (x, x - 1)), (chart, x, y)
            # The last export (at shutdown) is after the last iteration's value.
            assert points[-1] == (ITERS, pytest.approx(value(ITERS))), (engine, chart)
        assert "megatron.training.* metrics" in page.read_text()


def test_status_watch_shows_a_megatron_workers_step_time_and_tokens_from_its_metrics(
    lens_worker_script, tmp_path
):
    # The `default` groups export no step spans: the watch's step time and tokens/s can only
    # come from the worker's metrics (Megatron-LM's names, what mlaunch's trainer records too).
    from rich.console import Console

    from mlaunch.cli.status_watch import render
    from mlaunch.slurm.watch import WatchState, snapshot
    from mlaunch.trace.metrics import read_metric_points

    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(lens_worker_script), "--nproc-per-node", "2", "--device", "cpu",
        "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "0",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-span-groups", "default",
        "--otel-export-strategy", "all_ranks", cwd=tmp_path,
        env=clean_env(LENS_WORKER_ITER_SECONDS="0.01"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    names = {
        s["name"] for p in (run_dir / "telemetry").glob("traces-rank*.jsonl") for s in read_spans(p)
    }
    assert "megatron.train.iteration" not in names  # nothing but metrics to read it from

    snap = snapshot(str(run_dir), tmp_path, WatchState())
    points = read_metric_points(run_dir)
    assert sorted(r.rank for r in snap.ranks) == [0, 1]
    for r in snap.ranks:
        # The last export: the step histogram's mean since the one before (here the only one,
        # at shutdown: the mean of every step), the tokens/s gauge's last value.
        assert r.step_ms == pytest.approx(points[r.rank]["step_ms"][-1][1])
        assert r.tokens_per_s == pytest.approx(points[r.rank]["tokens_per_sec"][-1][1])
        assert r.step_ms > 0 and r.tokens_per_s > 0
    console = Console(width=160, record=True)
    console.print(render(snap))
    shown = console.export_text()
    assert f"{snap.ranks[0].tokens_per_s:,.0f}" in shown, shown
