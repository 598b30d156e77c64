"""Instructions per recorded span (valgrind's cachegrind), this tree against a git revision.

    python benchmarks/span_instructions.py [--base REV] [--spans N]

The instruction count is the figure the machine's load does not touch (thread CPU time on a shared
machine is inflated by whatever else runs). Extracts ``REV`` (default ``HEAD``) twice, as
``recorded_span_ab.py`` does: the base, a second copy of it (the A/A control: the same code, so
its difference from the base is the floor of what a layout or hash change moves), and this
working tree. For each row and tree, runs one process under cachegrind with ``N`` spans and one
with none (same set-up, same warm-up, ``PYTHONHASHSEED=0``, no finalization) and prints
``(instructions with N - instructions with none) / N``. Rows as ``recorded_span_ab.py``: a
disabled span, a recorded span, one with an ``attrs=`` mapping, a nested pair (per pair), on a
rank that exports nothing and records ``all``; and an exported fine span (``all`` exported, as
``span_overhead.py``'s rows). Needs ``valgrind`` (``apt-get install valgrind``); about 30 runs
of a few seconds each.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from recorded_span_ab import base_copies  # benchmarks/ is this script's path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "disabled": ("with span(OFF, NAME): pass", False),
    "recorded": ("with span(FINE, NAME): pass", False),
    "recorded, attrs=": ("with span(FINE, NAME, {'k': 1}): pass", False),
    "recorded, nested (pair)": ("with span(FINE, NAME):\n  with span(FINE, NAME): pass", False),
    "exported fine": ("with span(FINE, NAME): pass", True),
}
WARMUP = 200  # spans run first in both processes: the interpreter specializes its bytecode


def worker(root: str, row: str, n: int) -> None:
    """Set up telemetry (code from ``root``), run ``WARMUP`` then ``n`` spans of ``row``, and
    leave without finalizing (its garbage collection of the kept spans is no per-span cost)."""
    sys.path.insert(0, root)
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup as G
    from mlaunch.model.spans import SpanName as S
    from mlaunch.settings import load_telemetry_settings

    if not telemetry.__file__.startswith(root):
        raise SystemExit(f"worker imported {telemetry.__file__}, not the code under {root}")
    code, exported = ROWS[row]
    env = {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_EXPORTER": "none",
        "MEGATRON_OTEL_METRICS_ENABLED": "0",
        "MEGATRON_OTEL_RUN_ID": "bench",
    }
    if exported:
        env.update(
            MEGATRON_OTEL_SPAN_GROUPS="all,-activation_offload",
            MEGATRON_OTEL_EXPORT_STRATEGY="all_ranks",
        )
    else:  # rank 0 of 2 under single_rank exports nothing and records
        env.update(
            MEGATRON_OTEL_EXPORT_STRATEGY="single_rank",
            MEGATRON_OTEL_RECORDER_GROUPS="all,-activation_offload",
        )
    world = 1 if exported else 2
    run_dir = tempfile.mkdtemp(prefix="mlaunch-instr-")
    telemetry.setup(load_telemetry_settings(environ=env), rank=0, world_size=world, run_dir=run_dir)
    telemetry.set_iteration(1)
    body = "".join(f"  {line}\n" for line in code.splitlines())
    names = {
        "span": telemetry.span,
        "FINE": G.LAYER.value,
        "OFF": G.ACTIVATION_OFFLOAD.value,
        "NAME": S.LAYER_FORWARD.value,
    }
    exec(f"def loop(n):\n for _ in range(n):\n{body}", names)
    import gc

    gc.disable()
    names["loop"](WARMUP)
    names["loop"](n)
    sys.stdout.flush()
    os._exit(0)


def instructions(root: Path, row: str, n: int) -> int:
    """Instructions cachegrind counts for one worker process."""
    out = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--worker",
            str(root),
            "--row",
            row,
            "--n",
            str(n),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        cwd=root,
        check=True,
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if found is None:
        raise SystemExit(f"no instruction count from cachegrind:\n{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--spans", type=int, default=20_000, help="spans per measured process")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.row, args.n)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: install it (apt-get install valgrind) and rerun")
    roots = base_copies(args.base, "mlaunch-instr-")
    print(
        f"instructions per span (cachegrind), this tree vs {args.base} (base2: a second copy of "
        f"it, the A/A control); {args.spans} spans minus none"
    )
    width = max(len(row) for row in ROWS)
    print(f"  {'':<{width}}  {'base':>7} {'base2':>7} {'new':>7}   {'A/A':>6} {'new-base':>8}")
    for row in ROWS:
        per = {
            k: (instructions(r, row, args.spans) - instructions(r, row, 0)) / args.spans
            for k, r in roots.items()
        }
        print(
            f"  {row:<{width}}  {per['base']:7.0f} {per['base2']:7.0f} {per['new']:7.0f}"
            f"   {per['base2'] - per['base']:+6.0f} {per['new'] - per['base']:+8.0f}"
        )
    shutil.rmtree(roots["base"].parent, ignore_errors=True)


if __name__ == "__main__":
    main()
