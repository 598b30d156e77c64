"""What ``mlaunch train`` costs on top of plain torchrun, up to the first completed iteration.

For the same configuration (``configs/tiny.toml`` by default), alternately starts

- ``mlaunch train --run-dir D ...`` and
- ``python -m torch.distributed.run --standalone --nproc-per-node N -m mlaunch.trainer ARGS``
  with the same worker environment (the plan's ``MEGATRON_OTEL_*``, ``MLAUNCH_RUN_DIR``, ...),

and measures, from the moment the command is started, the time until the first progress record
(the trainer appends one line to ``progress.jsonl`` when an iteration completes). Prints the
medians and their ratio; the goal is ``mlaunch / torchrun <= 1.10``.

    python benchmarks/launch_overhead.py [--runs 5] [--config tiny] [--train-iters 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _first_record_s(argv: list[str], env: dict[str, str], run_dir: Path, cwd: Path) -> float:
    """Seconds from starting ``argv`` to the first line of ``run_dir/progress.jsonl``; then
    lets the (short) run finish so no process is left behind."""
    progress = run_dir / "progress.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    elapsed = None
    while elapsed is None:
        if progress.exists() and progress.stat().st_size > 0:
            elapsed = time.perf_counter() - start
        elif proc.poll() is not None:
            raise SystemExit(f"run ended (code {proc.returncode}) before a progress record: {argv}")
        else:
            time.sleep(0.005)
    if proc.wait(timeout=300) != 0:
        raise SystemExit(f"run failed with {proc.returncode}: {argv}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (alternating)")
    parser.add_argument("--config", default="tiny", help="the config both commands use")
    parser.add_argument("--train-iters", type=int, default=3, help="iterations per run")
    args = parser.parse_args()

    from mlaunch.launcher.plan import build_plan

    base_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "MLAUNCH_"))
    }
    base_env.setdefault("OMP_NUM_THREADS", "1")
    mlaunch_s: list[float] = []
    torchrun_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mlaunch-bench-") as tmp:
        root = Path(tmp)
        for i in range(args.runs):
            for which in ("mlaunch", "torchrun") if i % 2 == 0 else ("torchrun", "mlaunch"):
                run_dir = root / f"{which}-{i}"
                flags = {"launch.run_dir": str(run_dir), "training.train_iters": args.train_iters}
                if which == "mlaunch":
                    argv = [sys.executable, "-m", "mlaunch", "train", "--config", args.config,
                            "--run-dir", str(run_dir), "--train-iters", str(args.train_iters)]  # fmt: skip
                    env = base_env
                else:
                    plan = build_plan(flags=flags, config=args.config, environ=base_env, cwd=root)
                    entry = plan.argv[plan.argv.index("--redirects") + 2 :]
                    n = str(plan.settings.launch.nproc_per_node)
                    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", n, *entry]  # fmt: skip
                    env = plan.child_env
                    run_dir.mkdir(parents=True)
                elapsed = _first_record_s(argv, env, run_dir, root)
                (mlaunch_s if which == "mlaunch" else torchrun_s).append(elapsed)
                print(f"run {i + 1}/{args.runs} {which:8s} {elapsed:6.2f} s to the first iteration")
        # The launcher's own work (imports, validation, plan, summary) is what --dry-run does; it
        # is the fixed cost mlaunch adds before torchrun starts, and far less noisy than the
        # end-to-end times on a shared machine.
        dry: list[float] = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "mlaunch", "train", "--config", args.config, "--dry-run"],
                env=base_env, cwd=root, stdout=subprocess.DEVNULL, check=True,
            )  # fmt: skip
            dry.append(time.perf_counter() - start)
    m, t = statistics.median(mlaunch_s), statistics.median(torchrun_s)
    print(f"median mlaunch train: {m:.2f} s   median bare torchrun: {t:.2f} s")
    print(f"ratio mlaunch/torchrun: {m / t:.3f}  (goal <= 1.10)")
    print(
        f"median mlaunch train --dry-run (the launcher's own work): {statistics.median(dry):.2f} s"
    )


if __name__ == "__main__":
    main()
