"""Fixtures of the report tests: a browser, a real tiny run and a synthetic 1,000-iteration run
(each built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_browser import find_or_install_chromium
from report_synth import write_per_step_run
from support.trainer_runs import run_trainer, telemetry_env

#: A 2-stage pipeline of a tiny GPT, every span group on, an evaluation every 3 iterations.
REAL_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "6", "--pipeline-model-parallel-size", "2",
    "--eval-interval", "3", "--eval-iters", "1",
]  # fmt: skip


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (skips only where it cannot be)."""
    path, why = find_or_install_chromium()
    if path is None:
        pytest.skip(f"no headless browser for the report tests: {why}")
    return path


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank torchrun job of mlaunch's trainer (PP=2, span groups `all`, file exporter)."""
    tmp = tmp_path_factory.mktemp("real")
    run = run_trainer(tmp, REAL_ARGS, nproc=2, env=telemetry_env("all"), name="run")
    assert run.returncode == 0, run.output[-3000:]
    return run.run_dir


@pytest.fixture(scope="session")
def synth_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic 1,000-iteration `per_step` run: 4 ranks, PP=2 x DP=2, with progress.jsonl."""
    return write_per_step_run(tmp_path_factory.mktemp("synth") / "run", iterations=1000)
