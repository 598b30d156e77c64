"""A recorded span's training-thread cost, this tree against a git revision, interleaved in time.

    python benchmarks/recorded_span_ab.py [--base REV] [--rounds N]

Extracts ``REV`` (default ``HEAD``) twice into temporary directories and starts three long-lived
worker processes: the base, a second copy of the base (the A/A control: the same code in another
process, so its ratio to the base is the noise floor), and this working tree. The workers take
turns, one chunk of 20,000 spans each, the order rotated every round, so a load change on a shared
machine hits all three alike. Each chunk is timed in thread CPU time (``time.thread_time``, GC off
as ``timeit`` runs it) on a rank that exports nothing and records ``all`` (the flight recorder's
hot path, as ``span_overhead.py``'s recorder rows). Prints the median and the minimum ns per span
of each, with the A/A and new/base ratios of the medians. Rows: a disabled span, a recorded span,
one with an ``attrs=`` mapping, and a recorded span nested in another (ns per pair).

Goal (the flight recorder's): a recorded span <= 500 ns of training-thread CPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 20_000
ROWS = {
    "disabled": "with span(OFF, NAME): pass",
    "recorded": "with span(FINE, NAME): pass",
    "recorded, attrs=": "with span(FINE, NAME, {'k': 1}): pass",
    "recorded, nested (pair)": "with span(FINE, NAME):\n with span(FINE, NAME): pass",
}


def worker(root: str) -> None:
    """Serve chunks: read a row label per line, print its ns per span (code from ``root``)."""
    sys.path.insert(0, root)
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup as G
    from mlaunch.model.spans import SpanName as S
    from mlaunch.settings import load_telemetry_settings
    from mlaunch.telemetry import _recorder

    if not telemetry.__file__.startswith(root):
        raise SystemExit(f"worker imported {telemetry.__file__}, not the code under {root}")
    settings = load_telemetry_settings(
        environ={
            "MEGATRON_OTEL_ENABLED": "1",
            "MEGATRON_OTEL_EXPORT_STRATEGY": "single_rank",
            "MEGATRON_OTEL_EXPORTER": "none",
            "MEGATRON_OTEL_RECORDER_GROUPS": "all,-activation_offload",
            "MEGATRON_OTEL_RUN_ID": "bench",
        }
    )
    # As span_overhead.py's recorder rows: rank 0 of 2 under single_rank exports nothing.
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tempfile.mkdtemp(prefix="mlaunch-ab-"))
    telemetry.set_iteration(1)
    env = {
        "span": telemetry.span,
        "FINE": G.LAYER.value,
        "OFF": G.ACTIVATION_OFFLOAD.value,
        "NAME": S.LAYER_FORWARD.value,
    }
    timers = {k: timeit.Timer(v, timer=time.thread_time, globals=env) for k, v in ROWS.items()}
    print("ready", flush=True)
    for line in sys.stdin:
        ns = timers[line.strip()].timeit(CHUNK) / CHUNK * 1e9
        _recorder.RECORDER.current.clear()  # an iteration boundary does this in training
        print(f"{ns:.2f}", flush=True)


def base_copies(base: str, prefix: str) -> dict[str, Path]:
    """``base``'s ``mlaunch`` extracted twice (``git archive``) into a temporary directory, the
    second copy the A/A control, beside this tree: ``{"base": ..., "base2": ..., "new": ROOT}``.
    The copies are sources only: a C extension of the base is not built there, so they run its
    pure-Python fallback (compare against a base from before the extension, or build it there)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    roots = {"base": tmp / "base", "base2": tmp / "base2", "new": ROOT}
    for name in ("base", "base2"):
        roots[name].mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", base, "mlaunch"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(roots[name])], input=archive, check=True)
    return roots


def run_rounds(script: str, roots: dict[str, Path], rows: Iterable[str], rounds: int
               ) -> dict[tuple[str, str], list[float]]:  # fmt: skip
    """One ``script --worker ROOT`` per copy, asked for each row in turn, the copies' order
    rotated every round (none always measures first); ``(copy, row)`` -> a number per round."""
    workers = {
        k: subprocess.Popen(
            [sys.executable, script, "--worker", str(r)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k, r in roots.items()
    }
    for w in workers.values():
        if w.stdout.readline().strip() != "ready":
            raise SystemExit("a worker failed to start")
    names = list(roots)
    res: dict[tuple[str, str], list[float]] = {(k, row): [] for k in names for row in rows}
    for r in range(rounds):
        order = names[r % 3 :] + names[: r % 3]
        for row in rows:
            for k in order:
                workers[k].stdin.write(row + "\n")
                workers[k].stdin.flush()
                res[(k, row)].append(float(workers[k].stdout.readline()))
    for w in workers.values():
        w.stdin.close()
        w.wait(30)
    return res


def print_rows(res: dict[tuple[str, str], list[float]], rows: Iterable[str], digits: int) -> None:
    """Median and minimum of each copy per row, the A/A ratio (base2/base) and new/base."""
    width = max(len(row) for row in rows)
    print(f"  {'':<{width}}  {'median: base':>12} {'base2':>7} {'new':>7}   {'min: base':>9} "
          f"{'base2':>7} {'new':>7}   {'A/A':>5} {'new/base':>8}")  # fmt: skip
    f = f".{digits}f"
    for row in rows:
        med = {k: statistics.median(res[(k, row)]) for k in ("base", "base2", "new")}
        low = {k: min(res[(k, row)]) for k in ("base", "base2", "new")}
        print(
            f"  {row:<{width}}  {med['base']:12{f}} {med['base2']:7{f}} {med['new']:7{f}}"
            f"   {low['base']:9{f}} {low['base2']:7{f}} {low['new']:7{f}}"
            f"   {med['base2'] / med['base']:5.3f} {med['new'] / med['base']:8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=30, help="chunks per worker and row")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    roots = base_copies(args.base, "mlaunch-ab-")
    res = run_rounds(__file__, roots, ROWS, args.rounds)
    print(
        f"recorded span, this tree vs {args.base} (base2: a second copy of it, the A/A control); "
        f"{args.rounds} rounds x {CHUNK} spans per chunk, thread CPU ns per span"
    )
    print_rows(res, ROWS, digits=1)
    new = statistics.median(res[("new", "recorded")])
    verdict = "ok" if new <= 500 else "OVER"
    print(f"  goal: recorded span <= 500 ns (median, this tree): {new:.1f} ns {verdict}")


if __name__ == "__main__":
    main()
