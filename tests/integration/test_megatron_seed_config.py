"""The seed's own minimal configuration, as Megatron-LM's users write it, through plain
``mlaunch train``: ``MEGATRON_OTEL_ENABLED=1 OTEL_EXPORTER_OTLP_ENDPOINT=...
MEGATRON_OTEL_SPAN_GROUPS=default`` and nothing else sends spans and metrics to that endpoint (the
shipped tiny.toml's ``exporter = "file"`` gives way), and the metrics are the ones Lens's Grafana
dashboard for Megatron queries. One real run, received by a real OTLP receiver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.launch_runs import clean_env, finish, mlaunch
from support.otlp import GrpcOtlpReceiver
from support.prometheus import dashboard_series, prometheus_series

from mlaunch.model.spans import METRICS, Metric

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS = 4


@pytest.fixture(scope="module")
def env_only_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cwd = tmp_path_factory.mktemp("seed")
    with GrpcOtlpReceiver() as rx:
        env = clean_env(
            MEGATRON_OTEL_ENABLED="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint,
            MEGATRON_OTEL_SPAN_GROUPS="default",
        )
        code, out = finish(mlaunch("--train-iters", str(ITERS), cwd=cwd, env=env))
        assert code == 0, out
        assert rx.wait_for_spans(1, timeout=10)
        (run_dir,) = (cwd / "runs").iterdir()
        yield {"run_dir": run_dir, "out": out, "spans": rx.spans, "metrics": rx.metrics}


def test_the_seeds_env_only_configuration_sends_spans_to_its_endpoint(env_only_run) -> None:
    run_dir: Path = env_only_run["run_dir"]
    names = {s["name"] for s in env_only_run["spans"]}
    assert {"megatron.startup", "megatron.train"} <= names  # the default preset's job spans
    assert "megatron.train.iteration" not in names  # step is not in `default`
    assert {s["resource"]["nemo.run.id"] for s in env_only_run["spans"]} == {run_dir.name}
    # Nothing went to files instead, and the run's record says why the exporter is otlp.
    assert not list((run_dir / "telemetry").glob("traces-rank*.jsonl"))
    settings = json.loads((run_dir / "resolved.json").read_text())["settings"]
    assert settings["telemetry.exporter"] == {
        "value": "otlp",
        "source": "OTEL_EXPORTER_OTLP_ENDPOINT over tiny.toml's exporter = 'file'",
    }
    assert settings["telemetry.span_groups"]["source"] == "MEGATRON_OTEL_SPAN_GROUPS"
    assert "not used" not in env_only_run["out"]


def test_the_trainers_metrics_are_megatrons_by_name_kind_and_unit(env_only_run) -> None:
    kinds = {"histogram": "histogram", "gauge": "gauge", "counter": "sum"}
    want = {m.name: (kinds[m.kind], m.unit) for m in METRICS}
    # CPU torch keeps no allocation statistics: no memory sample on CPU (docs/telemetry.md).
    want.pop(Metric.MEMORY_ALLOCATED_GB)
    got = {m["name"]: (m["kind"], m["unit"]) for m in env_only_run["metrics"]}
    assert got == want
    # Megatron-LM's own instruments (megatron/training/training_metrics.py): only the step
    # duration has a unit.
    assert got[Metric.STEP_DURATION_MS] == ("histogram", "ms")
    assert got[Metric.SKIPPED_ITERS] == ("sum", "")
    assert all(unit == "" for name, (_, unit) in got.items() if name != Metric.STEP_DURATION_MS)


def test_every_series_of_lens_megatron_dashboard_is_in_what_the_trainer_exports(
    env_only_run,
) -> None:
    wanted, labels = dashboard_series()
    exported: set[str] = set()
    for m in env_only_run["metrics"]:
        exported |= prometheus_series(m["name"], m["kind"], m["unit"])
    # The memory gauge is recorded only where torch keeps allocation statistics (a GPU): its
    # instrument's name, kind and unit still give the dashboard's series.
    memory = next(m for m in METRICS if m.name == Metric.MEMORY_ALLOCATED_GB)
    exported |= prometheus_series(memory.name, memory.kind, memory.unit)
    assert not wanted - exported, sorted(wanted - exported)
    # The panels filter by service and run: resource attributes the collector turns into labels.
    resource_labels = {k.replace(".", "_") for m in env_only_run["metrics"] for k in m["resource"]}
    assert labels <= resource_labels
