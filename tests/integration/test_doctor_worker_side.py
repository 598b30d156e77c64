"""``mlaunch doctor`` checks the worker side: nemo-lens 0.1.0's own configuration loader, run under
the worker's interpreter on the environment mlaunch would hand a ``--script`` worker."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.launch_runs import clean_env

from mlaunch.doctor.worker_side import check_worker_side
from mlaunch.launcher import lens_names
from mlaunch.settings import load_settings

pytestmark = [pytest.mark.nemo_lens, pytest.mark.slow]


def _check(env: dict[str, str], python: str | None, **flags):
    settings = load_settings(environ=env, flags=flags, check_cross_fields=False)
    return check_worker_side(settings, env, worker_python=python)


def _one(results, name="worker telemetry"):
    [found] = [r for r in results if r.name == name]
    return found


def test_the_worker_resolves_what_the_plan_says_and_doctor_shows_it(lens_python):
    env = {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_SPAN_GROUPS": "all,-layer",
        "MEGATRON_OTEL_RANK_STRATEGY": "all_ranks",
        "MEGATRON_OTEL_SAMPLER_ENABLED": "true",
        "MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "0.5",
    }
    result = _one(_check(env, str(lens_python)))
    assert result.status == "pass", result.message
    assert "nemo-lens 0.1.0" in result.message and "matches mlaunch's plan" in result.message
    assert "layer," not in result.message and "microbatch" in result.message
    assert "strategy all_ranks" in result.message and "exporting ranks 0-1" in result.message
    assert "rank-aware sampler keeps ranks" in result.message
    # A script's workers send to the launcher's receiver, which only lets the job's workers in.
    assert "embedded receiver, which authenticates" in result.message


def test_a_setting_nemo_lens_raises_on_is_a_failure_with_its_error(lens_python):
    env = {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORT_STRATEGY": "builtins:bool"}
    results = _check(env, str(lens_python))
    worker = _one(results)
    assert worker.status == "fail"
    assert "Unknown export_strategy 'builtins:bool'" in worker.message
    assert "stop at start-up" in worker.message
    refusal = _one(results, "script worker")
    assert refusal.status == "fail" and "registered name" in refusal.message


def test_a_worker_resolving_something_else_is_a_mismatch(lens_python, monkeypatch):
    # A translation bug: the worker is told rank 0 exports while the plan says the last rank.
    real = lens_names.worker_env
    monkeypatch.setattr(
        lens_names,
        "worker_env",
        lambda s, run_id: {**real(s, run_id), "MEGATRON_OTEL_EXPORT_RANK": "0"},
    )
    env = {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORT_STRATEGY": "single_rank"}
    result = _one(_check(env, str(lens_python)))
    assert result.status == "fail"
    assert "exporting_ranks: worker [0], mlaunch [1]" in result.message


def test_a_worker_python_without_nemo_lens_warns_that_telemetry_would_be_off():
    result = _one(_check({"MEGATRON_OTEL_ENABLED": "1"}, sys.executable))
    assert result.status == "warn"
    assert "silently run with telemetry off" in result.message


def test_the_default_interpreter_without_nemo_lens_is_only_a_note_for_the_trainer():
    result = _one(_check({"MEGATRON_OTEL_ENABLED": "1"}, None))
    assert result.status == "pass" and "cannot import nemo.lens" in result.message


def test_doctor_cli_reports_the_worker_side_and_refuses_a_bad_interpreter(lens_python, tmp_path):
    env = clean_env(MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_SPAN_GROUPS="goodput")
    run = subprocess.run(
        [sys.executable, "-m", "mlaunch", "doctor", "--json", "--worker-python", str(lens_python)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    checks = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    worker = checks["worker telemetry"]
    assert worker["status"] == "pass", worker
    assert "job" in worker["message"] and "step" in worker["message"]
    bad = subprocess.run(
        [sys.executable, "-m", "mlaunch", "doctor", "--worker-python", str(tmp_path / "nope")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("--worker-python:"), bad.stderr
