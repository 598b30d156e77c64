"""What the live-capture hook for nemo-lens workers (mlaunch/lens_hook) costs a worker at start.

    python benchmarks/lens_hook_startup.py [--python PATH] [--runs N]

Starts ``PATH -c pass`` (default: this interpreter; give the workers' one, e.g. the nemo-lens
venv's) N times without and N times with the hook, interleaved, as a rank of a run would see it
(the hook's folder first on ``PYTHONPATH``, ``RANK`` and ``MLAUNCH_RUN_DIR`` set), and prints the
child processes' CPU time (user + system, so other load on the machine barely moves it): minimum
and median per start, and their difference. Bytecode is cached after the first start unless
``PYTHONDONTWRITEBYTECODE`` is set; the first start of each kind is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlaunch import envcontract as ec  # noqa: E402
from mlaunch.lens_hook import SITE_DIR  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--runs", type=int, default=41)
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", ec.RUN_DIR)}
    with tempfile.TemporaryDirectory() as run_dir:
        hooked = {**base, "PYTHONPATH": str(SITE_DIR), "RANK": "0", ec.RUN_DIR: run_dir}
        cpu: dict[str, list[float]] = {"without hook": [], "with hook": []}
        for i in range(args.runs + 1):
            for name, env in (("without hook", base), ("with hook", hooked)):
                before = _children_cpu()
                subprocess.run([args.python, "-c", "pass"], env=env, check=True)
                if i:
                    cpu[name].append(_children_cpu() - before)
    stats = {}
    for name, values in cpu.items():
        values.sort()
        stats[name] = (values[0] * 1e3, values[len(values) // 2] * 1e3)
        print(
            f"{name:13s} CPU per start: min {stats[name][0]:6.1f} ms, median {stats[name][1]:6.1f} ms"
        )
    d_min = stats["with hook"][0] - stats["without hook"][0]
    d_med = stats["with hook"][1] - stats["without hook"][1]
    print(f"{'the hook':13s} costs:         min {d_min:+6.1f} ms, median {d_med:+6.1f} ms")


if __name__ == "__main__":
    main()
