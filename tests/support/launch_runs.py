"""Running ``mlaunch train`` as a user would, in a subprocess: shared by the launch and fault tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: Variables scrubbed from the inherited environment, so the developer's shell never leaks in.
PREFIXES = (
    "MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "PET_", "MLAUNCH_", "TORCHELASTIC_",
    "LENS_LAUNCH_SCRIPT_",
)  # fmt: skip
#: A generous bound for one tiny job on a loaded 2-core machine (a hang fails, not a slow run).
TIMEOUT_S = 180


def clean_env(**extra: str) -> dict[str, str]:
    """The parent environment without telemetry/launcher variables, one thread, no GPU, plus
    ``extra`` (which may override the thread count and give GPUs back): the one scrub every test
    that starts a process uses. The CPU tests stay on CPU on a GPU machine: in auto mode their
    workers would take the GPUs (two "nodes" on one machine would both take ``cuda:0``, which
    NCCL refuses); the ``gpu`` tests set ``CUDA_VISIBLE_DEVICES`` themselves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def mlaunch(
    *args: str, cwd: Path, env: dict[str, str] | None = None, **popen: Any
) -> subprocess.Popen:
    """``python -m mlaunch train ARGS`` with stdout and stderr together, as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "mlaunch", "train", *args],
        cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, **popen,
    )  # fmt: skip


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    """Wait for ``proc`` (killing it past TIMEOUT_S, which fails the test); its code and output."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"mlaunch train did not finish:\n{out}")
    return proc.returncode, out


def progress(run_dir: Path) -> list[dict]:
    """Every record of the run's progress.jsonl (empty before the first)."""
    path = run_dir / "progress.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(run_dir: Path) -> list[dict]:
    """The training-iteration records (not the evaluation ones)."""
    return [r for r in progress(run_dir) if "loss" in r and "eval_loss" not in r]


def free_port() -> int:
    """A free TCP port on loopback (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(run_dir: Path) -> dict:
    """``mlaunch status RUN_DIR --json``, parsed (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "status", str(run_dir), "--json"], cwd=run_dir.parent,
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def status_text(run_dir: Path) -> str:
    """What ``mlaunch status RUN_DIR`` prints (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "status", str(run_dir)], cwd=run_dir.parent,
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
