"""The size of ``mlaunch trace report`` for a 1,000-iteration ``per_step`` run (the report's goal:
under 10 MB), with what it is made of, and the time to write it.

The run is synthetic (tests/report/report_synth.py): 4 ranks, PP=2 x DP=2, 4 microbatches, the
spans ``MEGATRON_OTEL_SPAN_GROUPS=per_step`` emits (about 64,000), checkpoints and evaluations,
and a progress.jsonl. Pass ``--run-dir`` to measure a real run instead.

    python benchmarks/report_size.py [--iterations 1000] [--run-dir runs/<id>] [--window A:B]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "report")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--run-dir", type=Path, help="measure this run instead of a synthetic one")
    parser.add_argument("--window", help="--iterations A:B of the report (default: its default)")
    args = parser.parse_args()

    from plotly.offline import get_plotlyjs

    from mlaunch.trace.reader import TraceReader
    from mlaunch.trace.report import parse_iterations, render_report

    with tempfile.TemporaryDirectory() as tmp:
        run = args.run_dir
        if run is None:
            from report_synth import write_per_step_run

            run = write_per_step_run(Path(tmp) / "run", iterations=args.iterations)
        spans = sum(len(batch) for _, batch, _ in TraceReader.open(run))
        window = parse_iterations(args.window) if args.window else None
        t0 = time.perf_counter()
        result = render_report(run, window)
        out = result.write(Path(tmp) / "report.html")
        seconds = time.perf_counter() - t0
        size = out.stat().st_size
        js = len(get_plotlyjs().encode())
    shown = ", ".join(f"{a}-{b}" for a, b in result.window) or "all"
    print(f"run: {run if args.run_dir else f'synthetic per_step, {args.iterations} iterations'}"
          f" ({spans:,} spans)")  # fmt: skip
    print(f"report: {size / 2**20:.2f} MiB ({size:,} bytes), written in {seconds:.1f} s")
    print(f"  plotly.js (embedded once): {js / 2**20:.2f} MiB")
    print(f"  everything else:           {(size - js) / 2**20:.2f} MiB "
          f"(timeline iterations {shown}: {result.timeline_spans:,} spans, "
          f"{result.links} links; curves, tables)")  # fmt: skip
    print(f"goal < 10 MiB: {'met' if size < 10 * 2**20 else 'MISSED'}")


if __name__ == "__main__":
    main()
