"""On a CUDA machine: the same launch runs on the GPU with NCCL and bf16 (skipped without one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlaunch.telemetry.otlp_json import read_spans

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.distributed]


def test_tiny_run_on_cuda_with_nccl_and_bf16(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_"))
    }
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "mlaunch", "train", "--device", "cuda", "--nproc-per-node", "1",
            "--global-batch-size", "4", "--train-iters", "5", "--precision", "bf16",
            "--run-dir", str(run_dir),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "eval_loss" not in r] == [1, 2, 3, 4, 5]
    spans = read_spans(run_dir / "telemetry" / "traces-rank0.jsonl")
    resource = spans[0]["resource"]
    assert resource["host.gpu.count"] >= 1
    assert resource["megatron.precision"] == "bf16"
