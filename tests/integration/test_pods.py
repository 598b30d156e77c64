"""Two local "pods" of a Kubeflow Trainer TrainJob run a real 2-node job: two ``mlaunch train``
processes on this machine with the torch runtime's environment (``PET_NNODES``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NPROC_PER_NODE``, as
Kubeflow Trainer v2.3.0's torch plugin sets them), the run id ``mlaunch trainjob``'s manifest sets
(``MEGATRON_OTEL_RUN_ID``) and the run directory on the volume both mount (``--run-dir``). No
flag says how many nodes, which rank or where the rendezvous is.

Kubernetes stops a pod with SIGTERM (preemption, a node drained) and the JobSet restarts the
job's pods with the same command and environment: the restarted pods resume from the newest
checkpoint in the shared run directory and run to the end, each node writing its own files.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from support.launch_runs import (
    TIMEOUT_S,
    clean_env,
    finish,
    free_port,
    mlaunch,
    status,
    train_records,
)
from support.trainer_runs import IDLE_PAUSE_S

from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RUN_ID = "podjob"
ITERS = 60
#: The TrainJob's command: every pod runs the same one; only the runtime's variables differ.
COMMAND = [
    "--train-iters", str(ITERS), "--global-batch-size", "4", "--save-interval", "2",
    "--log-interval", "1",
]  # fmt: skip


def pod(rank: int, port: int, volume: Path, cwd: Path):
    """One pod's container: the torch runtime's variables for node ``rank`` of 2, node 0's
    address (here loopback, in a cluster node 0's pod's DNS name) and port."""
    env = clean_env(
        PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank),
        PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port), MEGATRON_OTEL_RUN_ID=RUN_ID,
        # Each iteration idles (the test hook), so the job is still running when the pods stop.
        MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S,
        COLUMNS="300",  # the summary's rows unwrapped, to read them whole
    )  # fmt: skip
    return mlaunch(*COMMAND, "--run-dir", str(volume / RUN_ID), cwd=cwd, env=env)


def test_two_pods_run_one_job_and_restarted_pods_resume_from_the_checkpoint(tmp_path):
    volume = tmp_path / "volume"  # the PersistentVolumeClaim both pods mount
    volume.mkdir()
    run_dir = volume / RUN_ID
    port = free_port()
    for rank in (0, 1):
        (tmp_path / f"pod{rank}").mkdir()
    pods = [pod(rank, port, volume, tmp_path / f"pod{rank}") for rank in (0, 1)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(train_records(run_dir)) < 3 and time.monotonic() < deadline:
            if any(p.poll() is not None for p in pods):
                break
            time.sleep(0.1)
        for p in pods:  # Kubernetes stops both pods (a preemption, a drained node)
            p.send_signal(signal.SIGTERM)
        results = [finish(p) for p in pods]
    finally:
        for p in pods:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for code, out in results:
        assert code == 128 + signal.SIGTERM, out
    node0_out = results[0][1]
    # The summary says where each value came from: the runtime's variables, no flag.
    assert "node rank 0 (from PET_NODE_RANK), c10d at 127.0.0.1:" in node0_out, node0_out
    assert "2 node(s) (from PET_NNODES) x 1 processes (from PET_NPROC_PER_NODE)" in node0_out
    node1_log = (run_dir / "logs" / "node1" / "launcher.log").read_text()
    assert "node rank 1 (from PET_NODE_RANK)" in node1_log, node1_log
    sources = json.loads((run_dir / "resolved.json").read_text())["settings"]
    assert {p: sources[f"launch.{p}"]["source"] for p in ("nnodes", "node_rank")} == {
        "nnodes": "PET_NNODES", "node_rank": "PET_NODE_RANK"
    }  # fmt: skip
    ckpt = run_dir / "checkpoints"
    last = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert last == train_records(run_dir)[-1]["iteration"] and 3 <= last < ITERS

    # The JobSet restarts the pods: the same command, the same variables, the same volume.
    restarted = [pod(rank, port, volume, tmp_path / f"pod{rank}") for rank in (0, 1)]
    results = [finish(p) for p in restarted]
    for code, out in results:
        assert code == 0, out
    out = results[0][1]
    assert f"loading the checkpoint of iteration {last}; iteration {last + 1} follows" in out, out
    # Resumed, not restarted: iterations 1..last, then last+1..ITERS, each once.
    assert [r["iteration"] for r in train_records(run_dir)] == list(range(1, ITERS + 1))
    st = status(run_dir)
    assert st["state"] == "completed" and st["progress"]["iteration"] == ITERS, st
    assert [n["node"] for n in st["nodes"]] == [0, 1], st["nodes"]
    # Each node's own files in the one run directory, and both ranks' spans.
    for node in (0, 1):
        assert (run_dir / "logs" / f"node{node}" / "torchrun.log").is_file()
        record = json.loads((run_dir / f"launcher-node{node}.json").read_text())
        assert record["node"] == node
        assert (run_dir / "telemetry" / f"traces-launcher-node{node}.jsonl").is_file()
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        assert {s["resource"]["nemo.run.id"] for s in spans} == {RUN_ID}
        steps = sorted(
            s["attributes"]["megatron.iteration"]
            for s in spans
            if s["name"] == "megatron.train.iteration"
        )
        assert steps == list(range(1, ITERS + 1)), rank
