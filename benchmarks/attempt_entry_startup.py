"""What the job trace's worker wrapper (mlaunch/launcher/attempt_entry.py) adds to a worker's start.

    python benchmarks/attempt_entry_startup.py [--runs N]

Starts ``python -u -c pass`` N times directly and N times through the wrapper as torchrun starts
it (``python -S -u attempt_entry.py -c pass`` with ``MLAUNCH_ATTEMPT_TRACE`` and
``TORCHELASTIC_RESTART_COUNT`` set: it sets ``TRACEPARENT`` and ``os.execv``s ``python -u -c
pass``), interleaved, and prints the wall time per start (median and minimum) and the child
processes' CPU time per start (user + system, which other load on the machine barely moves), and
the differences. The first start of each kind is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

WRAPPER = Path(__file__).resolve().parents[1] / "mlaunch" / "launcher" / "attempt_entry.py"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _start(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one start of ``argv``."""
    cpu, t = _children_cpu(), time.perf_counter()
    subprocess.run(argv, env=env, check=True)
    return time.perf_counter() - t, _children_cpu() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=41)
    args = ap.parse_args()
    env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "0",
           "MLAUNCH_ATTEMPT_TRACE": "0123456789abcdef0123456789abcdef:0123456789abcdef"}  # fmt: skip
    kinds = {
        "python -u -c pass": [sys.executable, "-u", "-c", "pass"],
        "through attempt_entry.py": [sys.executable, "-S", "-u", str(WRAPPER), "-c", "pass"],
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(args.runs):
        for kind, argv in kinds.items():
            sample = _start(argv, env)
            if i:  # the first start of each kind warms the caches
                times[kind].append(sample)
    print(f"{args.runs - 1} starts of each, interleaved; ms per start")
    print(f"{'':28} {'wall median':>12} {'wall min':>9} {'CPU median':>11} {'CPU min':>8}")
    rows = {}
    for kind, samples in times.items():
        wall = [w * 1e3 for w, _ in samples]
        cpu = [c * 1e3 for _, c in samples]
        rows[kind] = (statistics.median(wall), min(wall), statistics.median(cpu), min(cpu))
        print(f"{kind:28} {rows[kind][0]:12.1f} {rows[kind][1]:9.1f} {rows[kind][2]:11.1f}"
              f" {rows[kind][3]:8.1f}")  # fmt: skip
    base, wrapped = rows["python -u -c pass"], rows["through attempt_entry.py"]
    print(f"{'the wrapper adds':28} " + " ".join(
        f"{w - b:{n}.1f}" for w, b, n in zip(wrapped, base, (12, 9, 11, 8), strict=True)
    ))  # fmt: skip


if __name__ == "__main__":
    main()
