"""``mlaunch doctor`` checks the worker side: nemo-lens's own configuration loader (0.1.0 and
0.2.0, the tests taking ``lens_python`` run once per version), run under the worker's interpreter
on the environment mlaunch would hand a ``--script`` worker."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_the_worker_resolves_what_the_plan_says_and_doctor_shows_it(lens_python, lens_version):
    env = {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_SPAN_GROUPS": "all,-layer",
        "MEGATRON_OTEL_RANK_STRATEGY": "all_ranks",
        "MEGATRON_OTEL_SAMPLER_ENABLED": "true",
        "MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "0.5",
    }
    result = _one(_check(env, str(lens_python)))
    assert result.status == "pass", result.message
    assert f"nemo-lens {lens_version} under" in result.message
    assert "matches mlaunch's plan" in result.message and "not a version" not in result.message
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


def test_a_worker_python_without_nemo_lens_fails_when_telemetry_is_on():
    result = _one(_check({"MEGATRON_OTEL_ENABLED": "1"}, sys.executable))
    assert result.status == "fail"
    assert "silently run with telemetry off" in result.message
    assert "0.1.0 or 0.2.0" in result.message  # both versions a Megatron-LM user can have
    # the advice names what Megatron-LM pins first, and both ways to get a nemo-lens
    assert result.fix.startswith("install nemo-lens 0.2.0 (what Megatron-LM pins")
    assert "pip install -e .[otel]" in result.fix and "Lens@v0.2.0" in result.fix
    assert "nemo-lens[sdk]==0.1.0" in result.fix and "Python >= 3.13" in result.fix


def test_a_worker_python_without_nemo_lens_warns_when_telemetry_is_off():
    result = _one(_check({"MEGATRON_OTEL_ENABLED": "0"}, sys.executable))
    assert result.status == "warn"
    assert "silently run with telemetry off" in result.message


def test_the_default_interpreter_without_nemo_lens_is_only_a_note_for_the_trainer():
    result = _one(_check({"MEGATRON_OTEL_ENABLED": "1"}, None))
    assert result.status == "pass" and "cannot import nemo.lens" in result.message
    assert "trainer does not need it" in result.message
    assert "silently" not in result.message  # a pass never says telemetry would be lost


def _fake_lens(root: Path, version: str, source: Path | None = None) -> Path:
    """A ``nemo.lens`` package of another version on a path of its own: a copy of ``source``
    (a real nemo-lens package folder) with its version changed, or a bare package."""
    package = root / "nemo" / "lens"
    if source is not None:
        shutil.copytree(source, package, ignore=shutil.ignore_patterns("__pycache__"))
        # nemo-lens takes its __version__ from the installed distribution's metadata: the
        # copy states its own last, as a release of that version would.
        with open(package / "package_info.py", "a") as info:
            info.write(f"\n__version__ = {version!r}\n")
    else:
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (root / "nemo" / "__init__.py").touch()
    return root


def test_a_bare_unknown_nemo_lens_is_a_warning_naming_its_version(tmp_path):
    path = _fake_lens(tmp_path / "fake", "0.3.0")
    env = {"MEGATRON_OTEL_ENABLED": "1", "PYTHONPATH": str(path)}
    result = _one(_check(env, sys.executable))
    assert result.status == "warn", result
    assert "nemo-lens 0.3.0" in result.message and "0.1.0 or 0.2.0" in result.message
    assert "could not be run" in result.message and "ImportError" in result.message


@pytest.mark.nemo_lens("0.2.0")
def test_a_working_unknown_nemo_lens_is_compared_and_only_warned_about(lens_python, tmp_path):
    """0.2.0's package as "0.3.0", first on the path of 0.2.0's interpreter."""
    find = "import nemo.lens, os; print(os.path.dirname(nemo.lens.__file__))"
    source = subprocess.run(
        [str(lens_python), "-c", find], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    path = _fake_lens(tmp_path / "fake", "0.3.0", Path(source))
    env = {"MEGATRON_OTEL_ENABLED": "1", "PYTHONPATH": str(path)}
    result = _one(_check(env, str(lens_python)))
    assert result.status == "warn", result
    assert "nemo-lens 0.3.0" in result.message and "not a version mlaunch" in result.message
    assert "matches mlaunch's plan" in result.message
    assert result.fix.startswith("install nemo-lens 0.2.0")
    # a local version label (nemo-lens installed from a git checkout) is that release
    path = _fake_lens(tmp_path / "git", "0.2.0+b85578f", Path(source))
    env = {"MEGATRON_OTEL_ENABLED": "1", "PYTHONPATH": str(path)}
    result = _one(_check(env, str(lens_python)))
    assert result.status == "pass", result
    assert "nemo-lens 0.2.0+b85578f under" in result.message


def test_doctor_cli_reports_the_worker_side_and_refuses_a_bad_interpreter(
    lens_python, lens_version, tmp_path
):
    env = clean_env(MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_SPAN_GROUPS="goodput")
    run = subprocess.run(
        [sys.executable, "-m", "mlaunch", "doctor", "--json", "--worker-python", str(lens_python)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    checks = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    worker = checks["worker telemetry"]
    assert worker["status"] == "pass", worker
    assert "job" in worker["message"] and "step" in worker["message"]
    assert f"nemo-lens {lens_version} under" in worker["message"]
    bad = subprocess.run(
        [sys.executable, "-m", "mlaunch", "doctor", "--worker-python", str(tmp_path / "nope")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("--worker-python:"), bad.stderr
