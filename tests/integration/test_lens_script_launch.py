"""``mlaunch train --script`` with a real nemo-lens worker, 0.1.0 and 0.2.0 (configured as
Megatron-LM's ``_set_telemetry`` does): what the worker resolves equals what mlaunch resolved and
recorded.

Two ranks under real torchrun; the worker sends OTLP/gRPC to an in-process receiver (the
assertions are about what nemo-lens resolved, read back from ``lens-worker-rank{R}.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch
from support.otlp import GrpcOtlpReceiver

pytestmark = [pytest.mark.nemo_lens, pytest.mark.slow, pytest.mark.distributed]


def _launch(script: Path, tmp_path: Path, endpoint: str, *args: str, **env: str):
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--script", str(script), "--nproc-per-node", "2", "--device", "cpu",
        "--train-iters", "2", "--eval-interval", "0", "--run-dir", str(run_dir),
        "--otel-enabled", "--otel-exporter", "otlp", "--otlp-endpoint", endpoint, *args,
        cwd=tmp_path, env=clean_env(LENS_WORKER_ITER_SECONDS="0", **env),
    )  # fmt: skip
    code, out = finish(proc)
    return code, out, run_dir


def _worker_reports(run_dir: Path) -> dict[int, dict]:
    return {r: json.loads((run_dir / f"lens-worker-rank{r}.json").read_text()) for r in range(2)}


@pytest.mark.parametrize(
    ("args", "env", "groups", "ranks"),
    [
        (
            ("--otel-span-groups", "all,-layer", "--otel-export-strategy", "all_ranks"),
            {},
            "all,-layer",
            [0, 1],
        ),
        (("--otel-span-groups", "goodput"), {}, "goodput", [0, 1]),
        # a spec that starts with '-': one argv item, never taken for an option
        (("--otel-span-groups", "-layer,all"), {}, "-layer,all", [0, 1]),
        # the documented alias nemo-lens never reads: written as EXPORT_STRATEGY
        (
            ("--otel-span-groups", "default"),
            {"MEGATRON_OTEL_RANK_STRATEGY": "single_rank", "MEGATRON_OTEL_EXPORT_RANK": "0"},
            "default",
            [0],
        ),
    ],
    ids=["all-minus-layer", "goodput", "leading-dash", "rank-strategy-alias"],
)
def test_the_worker_resolves_what_mlaunch_resolved(
    lens_worker_script, tmp_path, args, env, groups, ranks
):
    from mlaunch.model.spec import resolve

    with GrpcOtlpReceiver() as rx:
        code, out, run_dir = _launch(lens_worker_script, tmp_path, rx.endpoint, *args, **env)
        assert code == 0, out[-4000:]
        resolved = json.loads((run_dir / "resolved.json").read_text())
        assert resolved["exporting_ranks"] == ranks
        assert resolved["span_groups"] == sorted(resolve(groups))
        assert resolved["reference"]["span_groups"] == resolved["span_groups"]
        reports = _worker_reports(run_dir)
        for rank, report in reports.items():
            assert "error" not in report, report
            assert report["enabled"] is True and report["finished"] is True
            assert report["exporting"] is (rank in resolved["exporting_ranks"]), report
            assert report["export_strategy"] == resolved["reference"]["export_strategy"]
            assert report["exporter"] == resolved["reference"]["exporter"] == "otlp"
            assert report["run_id"] == resolved["run_id"]
            if report["exporting"]:
                assert report["span_groups"] == resolved["span_groups"]
        emitted = sum(r.get("emitted", 0) for r in reports.values())
        assert emitted > 0 and rx.wait_for_spans(emitted, timeout=20)


def test_a_refused_setting_starts_and_creates_nothing(lens_worker_script, tmp_path):
    code, out, run_dir = _launch(
        lens_worker_script,
        tmp_path,
        "http://127.0.0.1:9",
        MEGATRON_OTEL_EXPORT_STRATEGY="builtins:bool",
    )
    assert code == 2, out
    assert "MEGATRON_OTEL_EXPORT_STRATEGY" in out and "single_rank" in out
    assert "Traceback" not in out
    assert not run_dir.exists()
    assert not list(tmp_path.rglob("lens-worker-rank*.json"))  # no worker ever ran


def test_the_worker_emits_only_the_span_names_the_summary_announced(lens_worker_script, tmp_path):
    from mlaunch.model.spans import SPANS

    with GrpcOtlpReceiver() as rx:
        code, out, run_dir = _launch(
            lens_worker_script, tmp_path, rx.endpoint, "--otel-span-groups", "per_step,microbatch"
        )
        assert code == 0, out[-4000:]
        announced = set(
            json.loads((run_dir / "resolved.json").read_text())["reference"]["span_names"]
        )
        emitted = sum(r.get("emitted", 0) for r in _worker_reports(run_dir).values())
        assert rx.wait_for_spans(emitted, timeout=20)
        # The workers' spans (the launcher's job trace, relayed to the same endpoint, has no rank).
        names = {s["name"] for s in rx.spans if "dl.rank" in s["resource"]}
    assert names <= set(SPANS), sorted(names - set(SPANS))
    assert names <= announced, sorted(names - announced)
