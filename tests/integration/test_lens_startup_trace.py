"""A Megatron-LM worker's start-up, traced from ``mlaunch train``'s own start.

Megatron-LM's entry point (``pretrain_hybrid.py``) reads ``LENS_LAUNCH_SCRIPT_START_TIME`` /
``LENS_LAUNCH_SCRIPT_PRESRUN_TIME`` (Unix seconds) and ``SLURM_JOB_START_TIME``, and
``training.py`` backdates its start-up trace from them: ``megatron.startup`` begins at the launch,
with ``megatron.startup.launch_script`` and ``.container_load`` children, and ``pre_startup``
covers SLURM's job start to the launch. mlaunch hands its workers its own start and the moment it
starts torchrun, so launch-to-first-iteration is one traced stretch, and ``trace goodput``
attributes the launch (restart: ``launch``). The real nemo-lens worker reads the variables as
Megatron-LM does (``support/lens_worker.py``); each test runs under 0.1.0 and 0.2.0.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch
from support.trace_cli import trace_cli

from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.nemo_lens, pytest.mark.slow]

#: A float of Unix seconds holds about 0.2 us: a backdated span's ends are that close.
NS_ROUNDING = 1_000
#: SLURM's job start, this many seconds before the launch (a prolog, the queue's tail).
SLURM_LEAD_S = 30


def _spans(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for span in read_spans(path):
        out.setdefault(span["name"], []).append(span)
    return out


def _goodput(path: Path) -> dict:
    code, text = trace_cli("goodput", path, "--json")
    assert code == 0, text
    return json.loads(text)


def test_a_megatron_workers_start_up_begins_at_the_launch_and_goodput_attributes_it(
    lens_worker_script: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    slurm_start = int(time.time()) - SLURM_LEAD_S  # SLURM writes whole seconds
    env = clean_env(SLURM_JOB_START_TIME=str(slurm_start))
    code, out = finish(
        mlaunch("--script", str(lens_worker_script), "--run-dir", str(run_dir),
                "--nproc-per-node", "1", "--train-iters", "3", cwd=tmp_path, env=env)
    )  # fmt: skip
    assert code == 0, out
    launcher = _spans(lay.launcher_traces_file(run_dir, 0))
    (job,), (attempt,) = launcher[SpanName.JOB], launcher[SpanName.JOB_ATTEMPT]
    worker = _spans(lay.traces_file(run_dir, 0))
    (startup,) = worker[SpanName.STARTUP]
    (launch_script,) = worker[SpanName.STARTUP_LAUNCH_SCRIPT]
    (container_load,) = worker[SpanName.STARTUP_CONTAINER_LOAD]
    (pre_startup,) = worker[SpanName.PRE_STARTUP]
    report = json.loads((run_dir / "lens-worker-rank0.json").read_text())
    stamps = report["launch_stamps"]

    # The worker read mlaunch's start (the job span's) and a PRESRUN stamp taken before torchrun
    # started (attempt 0 opens once it has); its start-up trace begins where the job does.
    assert abs(stamps["launch_script_start"] * 1e9 - job["start_ns"]) < NS_ROUNDING
    presrun_ns = stamps["launch_script_presrun"] * 1e9
    assert job["start_ns"] <= presrun_ns <= attempt["start_ns"] + NS_ROUNDING
    assert abs(startup["start_ns"] - job["start_ns"]) < NS_ROUNDING
    # launch_script: mlaunch's own start-up; container_load: torchrun, the rendezvous and the
    # worker's interpreter up to its first line; both children of the start-up, end to end.
    assert launch_script["parent_span_id"] == container_load["parent_span_id"] == startup["span_id"]
    assert launch_script["start_ns"] == startup["start_ns"]
    assert launch_script["end_ns"] == container_load["start_ns"]
    assert abs(container_load["end_ns"] - stamps["program_start"] * 1e9) < NS_ROUNDING
    # pre_startup: SLURM's job start to the launch, a trace of its own (SLURM_JOB_START_TIME
    # reaches the workers as it is)
    assert pre_startup["start_ns"] == slurm_start * 10**9
    assert pre_startup["end_ns"] == launch_script["start_ns"]
    assert not pre_startup["parent_span_id"]

    # goodput: the launch is restart time (launch), not unaccounted. The wall is the job span,
    # so pre_startup (before it) is outside it.
    launch_ms = (container_load["end_ns"] - launch_script["start_ns"]) / 1e6
    (rank,) = _goodput(run_dir)["ranks"]
    assert rank["wall_source"] == SpanName.JOB
    assert rank["restart_split_ms"]["launch"] == pytest.approx(launch_ms, abs=0.01)
    assert launch_ms > 0

    # A collector's view (no launcher file): the wall is the worker's span extent, which begins
    # at SLURM's job start, and the launch holds pre_startup as well.
    collector = tmp_path / "collector"
    shutil.copytree(run_dir / lay.TELEMETRY_DIR, collector / lay.TELEMETRY_DIR,
                    ignore=shutil.ignore_patterns("traces-launcher-*"))  # fmt: skip
    (rank,) = _goodput(collector)["ranks"]
    assert rank["wall_source"] == "span extent"
    whole_ms = (container_load["end_ns"] - pre_startup["start_ns"]) / 1e6
    assert rank["restart_split_ms"]["launch"] == pytest.approx(whole_ms, abs=0.01)
    assert whole_ms > SLURM_LEAD_S * 1e3  # SLURM_JOB_START_TIME is at least that far back
