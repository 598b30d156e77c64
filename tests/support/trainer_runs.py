"""Running the real trainer in tests: plain processes and real torchrun jobs on gloo, tiny configs."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mlaunch import envcontract
from support import launch_runs

#: A tiny model and batch: 2 layers, width 32, 32 tokens, 2 microbatches of 2 per DP rank at DP=2.
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "3", "--log-interval", "5",
    "--eval-iters", "0",
]  # fmt: skip

#: The pause of each iteration (``MLAUNCH_TEST_ITERATION_PAUSE``) of an open-ended job that a test
#: drives while it runs: its iteration is a few ms of compute, so unpaused it trains flat out on
#: both of a 2-core CI machine's cores for as long as the test takes.
IDLE_PAUSE_S = "0.1"


@dataclass
class Run:
    """A finished trainer job."""

    returncode: int
    output: str
    run_dir: Path

    def progress(self) -> list[dict]:
        path = self.run_dir / "progress.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.progress() if "loss" in r]

    def eval_losses(self) -> list[float]:
        return [r["eval_loss"] for r in self.progress() if "eval_loss" in r]


def clean_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """The parent environment without any telemetry/launcher variables, plus ``extra``."""
    return launch_runs.clean_env(
        **{"MLAUNCH_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1", **extra}
    )


def run_trainer(
    tmp: Path,
    args: list[str],
    *,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    name: str = "run",
    plain: bool = False,
) -> Run:
    """Start ``python -m mlaunch.trainer`` under torchrun (``nproc`` >= 1) in ``tmp/name``; with
    ``plain``, as one process without torchrun or a process group (the trainer run bare, as a
    user may): the same training for a single-process test, without a torchrun process that
    imports torch only to start it (about 3 CPU-s a run on a 2-core CI machine)."""
    if plain and nproc != 1:
        raise ValueError("plain runs one process: nproc must be 1")
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [sys.executable, *([] if plain else torchrun), "-m", "mlaunch.trainer", *args]
    proc = subprocess.run(
        cmd,
        cwd=tmp,
        env=clean_env(run_dir, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr, run_dir)


def sigterm_after_steps(
    tmp: Path, run_dir: Path, args: list[str], env: dict[str, str], steps: int = 3
) -> tuple[int, str]:
    """Start ``python -m mlaunch.trainer ARGS`` (one process, no torchrun) in ``tmp``, send it
    SIGTERM once ``run_dir/progress.jsonl`` holds ``steps`` records, and return its exit code and
    output (stdout and stderr together). Bounded: 120 s for the steps, 120 s for the exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlaunch.trainer", *args],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    progress = run_dir / "progress.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if progress.exists() and len(progress.read_text().splitlines()) >= steps:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll ``predicate`` every 0.1 s until it holds; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def progress_lines(run_dir: Path) -> int:
    """How many records ``run_dir/progress.jsonl`` holds (0 before it exists)."""
    path = run_dir / "progress.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@contextlib.contextmanager
def trainer_in_background(
    tmp: Path, run_dir: Path, args: list[str], env: dict[str, str], nproc: int = 2
) -> Iterator[subprocess.Popen]:
    """A torchrun job of ``nproc`` trainer processes running in the background while the block
    runs; SIGTERM (the trainer stops after its iteration and shuts telemetry down) when it is
    left, bounded: 120 s, then kill. The output is on ``proc.output`` afterwards. Each iteration
    pauses :data:`IDLE_PAUSE_S` (``env`` may say otherwise): the job only has to keep running while
    the block drives it, and idles instead of taking the cores the block's own commands need."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "mlaunch.trainer", *args,
        ],
        cwd=tmp, env=clean_env(run_dir, **{envcontract.ITERATION_PAUSE: IDLE_PAUSE_S, **env}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.output, _ = proc.communicate(timeout=120)  # type: ignore[attr-defined]
        finally:
            if proc.poll() is None:
                proc.kill()


def telemetry_env(spec: str) -> dict[str, str]:
    """Telemetry on, every rank exporting to files in the run directory."""
    return {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks",
        "MEGATRON_OTEL_EXPORTER": "file",
        "MEGATRON_OTEL_SPAN_GROUPS": spec,
    }
