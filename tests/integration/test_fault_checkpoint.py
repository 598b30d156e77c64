"""Crash-consistent checkpoints under a real ``kill -9``: pipeline-parallel workers killed while
they write a checkpoint (after the shard data, before the manifest and the rename), then a plain
restart of the same command line, which resumes from the previous valid checkpoint and says so.

Also: with two pipeline stages, an iteration is valid only when every stage's shard verifies, and
a manifest that lists fewer shards than the checkpoint has stages is not trusted.
(Corrupting the newest single-stage checkpoint is covered by
tests/trainer/test_trainer_training.py::test_resume_continues_the_same_loss_sequence_and_skips_a_corrupt_checkpoint.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.trainer_runs import TINY, clean_env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS, INTERVAL, PAUSE_AT = 12, 4, 8
ARGS = [
    *TINY, "--pipeline-model-parallel-size", "2", "--train-iters", str(ITERS),
    "--save-interval", str(INTERVAL), "--log-interval", "1",
]  # fmt: skip


def torchrun(tmp: Path, run_dir: Path, **env: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "mlaunch.trainer", *ARGS, "--save", str(tmp / "ck"),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=tmp, env=clean_env(run_dir, **env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "progress.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def test_kill_9_during_a_save_resumes_from_the_previous_valid_checkpoint(tmp_path):
    from mlaunch.trainer import checkpoint  # imports torch: not while every xdist worker collects

    ck = tmp_path / "ck"
    run_dir = tmp_path / "run"
    proc = torchrun(tmp_path, run_dir, MLAUNCH_TEST_PAUSE_IN_SAVE=str(PAUSE_AT))
    try:
        # Both stage writers announce the pause (shard data written, no manifest yet) with their pid.
        deadline = time.monotonic() + 120
        paused: list[Path] = []
        while len(paused) < 2 and proc.poll() is None and time.monotonic() < deadline:
            paused = sorted(ck.glob(".paused-in-save-rank*"))
            time.sleep(0.05)
        assert len(paused) == 2, (
            proc.communicate(timeout=5)[0] if proc.poll() is not None else paused
        )
        tmp_dir = ck / f".tmp.iter_{PAUSE_AT:07d}"
        shards = sorted(
            p.relative_to(tmp_dir).as_posix() for p in tmp_dir.rglob(checkpoint.MODEL_FILE)
        )
        assert shards == [
            f"mp_rank_00_000/{checkpoint.MODEL_FILE}",
            f"mp_rank_00_001/{checkpoint.MODEL_FILE}",
        ]
        for marker in paused:
            os.kill(int(marker.read_text()), signal.SIGKILL)  # the fault
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, out
    # On disk: the half-written save is a .tmp directory nothing treats as a checkpoint.
    assert (ck / checkpoint.TRACKER_FILE).read_text().strip() == str(PAUSE_AT - INTERVAL)
    assert not (ck / checkpoint.iter_dir_name(PAUSE_AT)).exists()
    assert not (tmp_dir / checkpoint.MANIFEST_FILE).exists()
    before = losses(run_dir)
    assert sorted(before) == list(range(1, PAUSE_AT + 1))

    # The next start, same argv (no --load): resumes from iteration 4 and says why not 8.
    for marker in paused:
        marker.unlink()
    again = torchrun(tmp_path, run_dir)
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out
    assert f"ignoring unfinished checkpoint save {tmp_dir}" in out
    assert (
        f"resuming from checkpoint {ck / checkpoint.iter_dir_name(PAUSE_AT - INTERVAL)}, the previous "
        f"valid one (the save of iteration {PAUSE_AT} is unfinished or damaged)"
    ) in out
    after = losses(run_dir)  # progress.jsonl appends: iterations 1..8, then 5..12
    records = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines()]
    resumed = [r["iteration"] for r in records[PAUSE_AT:] if "loss" in r]
    assert resumed == list(range(PAUSE_AT - INTERVAL + 1, ITERS + 1))
    # Iterations 5..8 ran twice, from the same checkpoint state: the same losses, to the bit.
    redone = [r["loss"] for r in records[PAUSE_AT:] if "loss" in r][:INTERVAL]
    assert redone == [before[i] for i in range(PAUSE_AT - INTERVAL + 1, PAUSE_AT + 1)]
    assert sorted(after) == list(range(1, ITERS + 1))
    assert not list(ck.glob(".tmp.*"))  # the next save cleaned the leftover up
    assert checkpoint.committed_iterations(ck) == [4, 8, 12]

    # Every stage must verify: damage only stage 1's shard of the newest checkpoint.
    newest = ck / checkpoint.iter_dir_name(ITERS)
    shard = newest / "mp_rank_00_001" / checkpoint.MODEL_FILE
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    logs: list[str] = []
    assert checkpoint.find_valid_checkpoint(ck, logs.append) == PAUSE_AT
    assert (
        "iter_0000012 is invalid: mp_rank_00_001/model_optim_rng.pt fails its sha256 check"
        in logs[0]
    )

    # A manifest that forgets a stage's shard is not trusted either.
    manifest_path = ck / checkpoint.iter_dir_name(PAUSE_AT) / checkpoint.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = [
        f for f in manifest["files"] if not f["path"].startswith("mp_rank_00_001/")
    ]
    manifest_path.write_text(json.dumps(manifest))
    logs.clear()
    assert checkpoint.find_valid_checkpoint(ck, logs.append) == PAUSE_AT - INTERVAL
    assert "lists no shard for mp_rank_00_001 of 2 pipeline stages" in logs[1]
