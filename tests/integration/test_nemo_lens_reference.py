"""What the real nemo-lens (0.1.0 and 0.2.0, each test once per version) does with the values mlaunch must translate (a Megatron-LM
worker's telemetry configuration).

These pin the reference's behaviour that mlaunch's translation for ``--script`` entry points is
built on: if a future nemo-lens accepted these values, the translation table could relax.
"""

from __future__ import annotations

import json

import pytest
from support.nemo_lens import run_worker_directly

pytestmark = [pytest.mark.nemo_lens, pytest.mark.slow]


def _run(tmp_path, python, **env: str):
    base = {
        "MEGATRON_OTEL_ENABLED": "true",
        "MEGATRON_OTEL_EXPORTER": "console",
        "MLAUNCH_RUN_DIR": str(tmp_path),
    }
    result = run_worker_directly(["--train-iters", "1"], {**base, **env}, tmp_path, python=python)
    report = json.loads((tmp_path / "lens-worker-rank0.json").read_text())
    return result, report


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"MEGATRON_OTEL_EXPORTER": "file"}, "Unknown exporter type: 'file'"),
        ({"MEGATRON_OTEL_SPAN_GROUPS": "goodput"}, "Unknown span group or preset: 'goodput'"),
        ({"MEGATRON_OTEL_SPAN_GROUPS": "all,-layer"}, "Unknown span group or preset: '-layer'"),
        # looked up before the enabled check: fatal even with telemetry off
        (
            {"MEGATRON_OTEL_ENABLED": "false", "MEGATRON_OTEL_EXPORT_STRATEGY": "pkg.mod:fn"},
            "pkg.mod:fn",
        ),
    ],
)
def test_nemo_lens_rejects_what_mlaunch_must_translate(lens_python, tmp_path, env, error):
    result, report = _run(tmp_path, lens_python, **env)
    assert result.returncode != 0
    assert error in report["error"], report


def test_nemo_lens_reads_empty_as_unset_and_ignores_aliases(lens_python, lens_version, tmp_path):
    result, report = _run(
        tmp_path,
        lens_python,
        MEGATRON_OTEL_SPAN_GROUPS="",
        MEGATRON_OTEL_RANK_STRATEGY="all_ranks",
        MEGATRON_OTEL_EXPORT_STRATEGY="single_rank",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert report["span_groups"] == [
        "checkpoint",
        "evaluate",
        "first_iteration",
        "inference",
        "job",
    ]
    assert report["export_strategy"] == "single_rank"  # RANK_STRATEGY was never read
    # the version this test is parametrized with is the one the worker ran (0.2.0 on 3.12)
    assert report["nemo_lens"] == lens_version
    assert report["python"] == {"0.1.0": "3.13", "0.2.0": "3.12"}[lens_version]


def test_nemo_lens_rank_sampler_replaces_the_trace_sampler(lens_python, tmp_path):
    result, report = _run(
        tmp_path,
        lens_python,
        MEGATRON_OTEL_SAMPLER_ENABLED="true",
        MEGATRON_OTEL_EXPORT_SAMPLE_RATE="1.0",
        OTEL_TRACES_SAMPLER="traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0.1",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TraceIdRatio" not in report["sampler"], report["sampler"]


def test_a_console_workers_telemetry_records_are_not_its_last_line(
    lens_python, lens_version, tmp_path
):
    """``mlaunch status`` (a SLURM job) shows each node's last log line. With ``--otel-exporter
    console`` a worker's stdout ends in the SDK's records, which nemo-lens 0.1.0 writes as indented
    JSON blocks and 0.2.0 as compact JSON lines: neither is the line shown."""
    from mlaunch.launcher.run_status import node_views

    result, _ = _run(tmp_path, lens_python)
    assert result.returncode == 0, result.stderr[-2000:]
    records = result.stdout.splitlines()
    assert '"context": {' in result.stdout  # spans, as the SDK's console exporter writes them
    if lens_version == "0.1.0":
        assert records[0] == "{" and records[-1] == "}"  # indented blocks
    else:
        assert all(line.startswith("{") and line.endswith("}") for line in records)  # JSONL
    log = tmp_path / "run" / "logs" / "node0" / "job" / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text(" iteration        1/       1 | lm loss: 1.0E+01 |\n" + result.stdout)
    (view,) = node_views(tmp_path / "run")
    assert view.last_line == "iteration        1/       1 | lm loss: 1.0E+01 |"
