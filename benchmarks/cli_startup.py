"""CLI start-up cost: ``mlaunch groups resolve all`` against ``python -c "import torch"``.

Both are run alternately in fresh processes, so machine noise hits them alike; prints the
medians and their ratio. Goals (a CLI that answers at once): the first <= 0.25 s and <= 0.2x the second.

    python benchmarks/cli_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    exe = shutil.which("mlaunch")
    mlaunch = [exe] if exe else [sys.executable, "-m", "mlaunch"]
    commands = {
        "mlaunch groups resolve all": [*mlaunch, "groups", "resolve", "all"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
    }
    for cmd in commands.values():  # warm the file cache
        _time(cmd)
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            samples[name].append(_time(cmd))

    med = {name: statistics.median(s) for name, s in samples.items()}
    cli, torch = med["mlaunch groups resolve all"], med['python -c "import torch"']
    width = max(map(len, med))
    print(f"median wall time over {args.runs} alternating runs")
    for name, value in med.items():
        print(f"  {name:<{width}}  {value * 1000:8.1f} ms")
    print(f"  ratio cli/torch-import        {cli / torch:8.3f}  (goal <= 0.20)")
    print(f"  cli absolute                  {cli:8.3f} s (goal <= 0.25 s)")
    ok = cli <= 0.25 and cli / torch <= 0.2
    print("RESULT:", "meets the goals" if ok else "MISSES a goal")


if __name__ == "__main__":
    main()
