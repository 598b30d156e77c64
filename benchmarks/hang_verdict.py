"""The hang watchdog's costs: py-spy's stack read per worker, and hang-to-verdict on a real job.

1. Stack collection: N worker-like processes (torch imported, a main thread and two helper
   threads asleep, as an mlaunch worker's export and request threads are) are read R times each
   with the watchdog's own :func:`~mlaunch.launcher.hang_report.dump_stacks`; prints the median
   per worker, and the wall time of reading all N at once (the watchdog reads them in parallel).
2. Hang to verdict: ``mlaunch train --script tests/support/hang_worker.py --hang-timeout T`` (2
   ranks on gloo; rank 1 sleeps inside ``megatron.data.get_batch`` at iteration 5); from the
   moment rank 1 entered that span (its open-span file) to the report's writing, split into the
   timeout, the detection lag (the watchdog reads once a second) and the collection.

    python benchmarks/hang_verdict.py [--workers 4] [--reads 10] [--timeout 10] [--no-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlaunch.launcher.hang_report import dump_stacks

ROOT = Path(__file__).resolve().parents[1]
WORKER_CODE = """
import threading, time, torch
for name in ("export", "watch"):
    threading.Thread(target=time.sleep, args=(3600,), name=name, daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""


def stack_cost(workers: int, reads: int) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER_CODE], stdout=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        per: list[float] = []
        for _ in range(reads):
            for p in procs:
                threads, error, took = dump_stacks(p.pid)
                assert threads is not None, error
                per.append(took)
        walls = []
        for _ in range(reads):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(lambda p: dump_stacks(p.pid), procs))
            walls.append(time.perf_counter() - t0)
        print(
            f"py-spy stack read: median {statistics.median(per) * 1e3:.0f} ms per worker"
            f" ({len(per)} reads, {len(threads)} threads each); all {workers} in parallel:"
            f" median {statistics.median(walls) * 1e3:.0f} ms"
        )
    finally:
        for p in procs:
            p.kill()
            p.wait()


def hang_to_verdict(timeout_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "OTEL_"))}
        out = subprocess.run(
            [sys.executable, "-m", "mlaunch", "train", "--script",
             str(ROOT / "tests" / "support" / "hang_worker.py"), "--nproc-per-node", "2",
             "--device", "cpu", "--run-dir", str(run_dir), "--otel-enabled",
             "--otel-export-strategy", "all_ranks", "--hang-timeout", f"{timeout_s:g}"],
            capture_output=True, text=True, cwd=tmp, env={**env, "OMP_NUM_THREADS": "1"},
            timeout=600, check=False,
        )  # fmt: skip
        hang = run_dir / "hang"
        node = json.loads((hang / "report-node0.json").read_text())
        spans = json.loads((hang / "spans-rank1.json").read_text())
        main = next(t for t in spans["threads"] if t["thread"] == "MainThread")
        began = main["spans"][-1]["start_ns"] / 1e9  # rank 1 entered the span it hangs in
        written = (hang / "report-node0.json").stat().st_mtime
        print(
            f"hang to verdict: {written - began:.1f} s = timeout {node['timeout_s']:g} s"
            f" + detection lag {node['detected_at'] - began - node['timeout_s']:.1f} s"
            f" + collection {node['collect_s']:.2f} s (exit code {out.returncode})"
        )
        print("verdict:", node["verdict"])
        for r in node["ranks"]:
            print(f"  rank {r['rank']}: py-spy {r['collect_s'] * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--reads", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--no-run", action="store_true", help="only the stack-read cost")
    args = parser.parse_args()
    stack_cost(args.workers, args.reads)
    if not args.no_run:
        hang_to_verdict(args.timeout)


if __name__ == "__main__":
    main()
