"""Elastic restart under a real ``kill -9``: ``mlaunch train --max-restarts 1`` on torchrun/gloo,
a worker killed from outside in the middle of the run, torchrun restarting the group, and the
trainer resuming by itself from the newest valid checkpoint under ``<run_dir>/checkpoints``.

The losses after the resume must be those of an uninterrupted run with the same seed and config
(the reference), and the restarted processes' spans must say so on their resource
(``dl.restart_count`` = 1) and in ``megatron.train.first_iteration``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch_runs import TIMEOUT_S, clean_env, finish, mlaunch, train_records

from mlaunch.model.spans import Attr, ResourceAttr, SpanName
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS = 60  # --max-restarts without --save-interval: mlaunch saves every ITERS // 10 = 6
INTERVAL = ITERS // 10
KILL_AFTER = 8  # past the first checkpoint, well before the end
#: No eval, so the per-iteration cost stays small; everything else is the tiny default config.
ARGS = ["--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "0"]


def _has_spans(run_dir: Path, rank: int) -> bool:
    """Whether the rank's traces file holds a whole line (a batch of spans) yet."""
    path = run_dir / "telemetry" / f"traces-rank{rank}.jsonl"
    try:
        return b"\n" in path.read_bytes()
    except FileNotFoundError:
        return False


def mlaunch_train(cwd: Path, run_dir: Path, *args: str) -> subprocess.Popen:
    # wide: summary rows on one line
    return mlaunch("--run-dir", str(run_dir), *ARGS, *args, cwd=cwd, env=clean_env(COLUMNS="250"))


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The trainer process of global ``rank`` in ``run_dir``'s job, found through /proc (its
    environment names the run directory and the rank torchrun gave it)."""
    want = {f"MLAUNCH_RUN_DIR={run_dir}".encode(), f"RANK={rank}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if b"mlaunch.trainer" not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:  # gone, or not ours
            continue
        if want <= env:
            return int(entry.name)
    return None


def worker_logs(run_dir: Path) -> str:
    """Every worker's stderr tail and torchrun's own log, for a failure message."""
    parts = []
    for path in sorted((run_dir / "logs").rglob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-12:]
        parts.append(f"\n== {path.relative_to(run_dir)}\n" + "\n".join(tail))
    return "".join(parts)


def assert_close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rel * max(abs(w), 1e-12), (i, g, w)


def test_kill_9_a_worker_restarts_the_group_and_resumes_the_same_loss_sequence(tmp_path):
    # The reference first: the same job, never interrupted.
    ref_dir = tmp_path / "reference"
    code, out = finish(mlaunch_train(tmp_path, ref_dir, "--max-restarts", "1"))
    assert code == 0, out
    reference = [r["loss"] for r in train_records(ref_dir)]
    assert len(reference) == ITERS

    run_dir = tmp_path / "killed"
    proc = mlaunch_train(tmp_path, run_dir, "--max-restarts", "1")
    victim = None
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        records = train_records(run_dir)
        if victim is None and records:
            victim = worker_pid(run_dir, 1)
        # Not before rank 1 has written spans: what its export thread (draining every 0.25 s)
        # has not written when SIGKILL lands is lost, and on an idle machine iteration 8 came
        # before its first write (no attempt-0 span of rank 1 for the check below).
        if (
            victim is not None
            and records
            and records[-1]["iteration"] >= KILL_AFTER
            and _has_spans(run_dir, 1)
        ):
            os.kill(victim, signal.SIGKILL)  # the fault: rank 1 dies without a chance to react
            break
        time.sleep(0.02)
    assert victim is not None, "never saw the worker of rank 1"
    killed_after = train_records(run_dir)[-1]["iteration"]
    code, out = finish(proc)
    assert code == 0, out + worker_logs(run_dir)

    # The restart was announced, with its cause and where the workers resume.
    assert (
        "restart 1 of 1: rank 1 killed by SIGKILL; torchrun started the workers again; resuming"
        " from the newest valid checkpoint"
    ) in out
    # `mlaunch status`: completed, the restart listed; rank 0's error file of attempt 0 (its
    # peer vanished mid-collective) is not the run's failure.
    st = subprocess.run(
        [sys.executable, "-m", "mlaunch", "status", str(run_dir), "--json"], cwd=tmp_path,
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert st.returncode == 0, st.stdout + st.stderr
    status = json.loads(st.stdout)
    assert status["state"] == "completed" and status["failures"] == [], status
    assert [(r["attempt"], r["rank"], r["cause"]) for r in status["restarts"]] == [
        (1, 1, "rank 1 killed by SIGKILL")
    ]

    # The summary said where checkpoints go, with the interval mlaunch chose for restarts.
    ckpt = run_dir / "checkpoints"
    assert "checkpoints" in out and f"every {INTERVAL} iterations" in out
    assert "restart(s), each resuming from the newest valid checkpoint" in out

    # Two attempts in progress.jsonl: 1..k, then from the last checkpoint c <= k to the end. The
    # restarted rank 0 says which c; its attempt starts at the last record of iteration c + 1
    # (c < k: it trains c+1..k again; c == k, a kill right after that save: it simply goes on).
    restarted_log = "".join(
        p.read_text(errors="replace") for p in (run_dir / "logs").rglob("attempt_1/0/stdout.log")
    )
    found = re.search(r"resuming from checkpoint \S*iter_(\d{7})", restarted_log)
    assert found, restarted_log
    resumed_at = int(found.group(1))
    iterations = [r["iteration"] for r in train_records(run_dir)]
    split = max(i for i, it in enumerate(iterations) if it == resumed_at + 1)
    first, second = train_records(run_dir)[:split], train_records(run_dir)[split:]
    assert first[-1]["iteration"] >= resumed_at, iterations
    assert [r["iteration"] for r in second] == list(range(resumed_at + 1, ITERS + 1))
    assert resumed_at % INTERVAL == 0 and INTERVAL <= resumed_at <= first[-1]["iteration"]
    assert first[-1]["iteration"] < ITERS, "the kill landed after the run had finished"
    assert killed_after <= first[-1]["iteration"]
    # Both attempts follow the uninterrupted run exactly.
    assert_close([r["loss"] for r in first], reference[: len(first)], rel=1e-6)
    assert_close([r["loss"] for r in second], reference[resumed_at:], rel=1e-6)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)

    # The restarted trainer found the checkpoint by itself (the argv had no --load).
    assert "--load" not in (run_dir / "command.txt").read_text()
    assert f"--load not given: resuming from --save {ckpt}" in restarted_log
    assert f"resuming from checkpoint {ckpt / f'iter_{resumed_at:07d}'}" in restarted_log

    # Telemetry: the restart count is on the resource, and the resumed iteration is the first one.
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        after = [s for s in spans if s["resource"][ResourceAttr.RESTART_COUNT] == 1]
        before = [s for s in spans if s["resource"][ResourceAttr.RESTART_COUNT] == 0]
        assert before and after and len(before) + len(after) == len(spans)
        steps = sorted(
            s["attributes"][Attr.ITERATION] for s in after if s["name"] == SpanName.ITERATION
        )
        assert steps == list(range(resumed_at + 1, ITERS + 1))
        by_name = {s["name"]: s for s in after}
        assert by_name[SpanName.FIRST_ITERATION]["attributes"][Attr.ITERATION] == resumed_at + 1
        assert by_name[SpanName.CHECKPOINT_LOAD]["attributes"][Attr.ITERATION] == resumed_at
        # A restart starts new traces: no trace id is shared with the killed attempt.
        assert not {s["trace_id"] for s in after} & {s["trace_id"] for s in before}


def test_preemption_signals_are_checked_before_anything_starts(tmp_path):
    from mlaunch.settings.trainer_cli import build_parser, validate

    def check(*argv: str) -> dict[str, str]:
        return dict(validate(build_parser().parse_args(list(argv)), 1))

    ns = build_parser().parse_args(["--preempt-signals", "term, usr1"])
    assert validate(ns, 1) == [] and ns.preempt_signals == ("SIGTERM", "SIGUSR1")
    assert "cannot be caught" in check("--preempt-signals", "SIGKILL")["--preempt-signals"]
    assert "not a signal name" in check("--preempt-signals", "SIGTREM")["--preempt-signals"]
    # Through mlaunch train: exit 2 naming the flag, no traceback, nothing started.
    proc = subprocess.run(
        [sys.executable, "-m", "mlaunch", "train", "--dry-run", "--run-dir", str(tmp_path / "r"),
         "--", "--preempt-signals", "SIGKILL"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--preempt-signals" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
