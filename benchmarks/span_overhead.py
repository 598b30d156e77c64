"""Per-call cost of mlaunch's span sites, side by side with the alternatives, in one run.

    python benchmarks/span_overhead.py [--quick]

Prints ns per call (best of several repeats, loop overhead included and shown) and ratios:
a plain function call; a frozenset membership check; ``is_enabled``; mlaunch's disabled
``with span``; a nemo-lens style ``@contextmanager`` guard (disabled and enabled); mlaunch's
enabled fine-grained span; mlaunch's enabled coarse (SDK) span; a raw OTel SDK span with a
BatchSpanProcessor whose exporter drops everything.

Goals (SPEC section 9.12 / issue 3): disabled ``with span`` <= 150 ns, ``is_enabled`` <= 40 ns,
enabled fine-grained span <= 2.5 us of training-thread time.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import timeit
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

from mlaunch import telemetry  # noqa: E402
from mlaunch.model.groups import SpanGroup as G  # noqa: E402
from mlaunch.model.spans import SpanName as S  # noqa: E402
from mlaunch.settings import load_telemetry_settings  # noqa: E402


class _DropExporter(SpanExporter):
    def export(self, spans):  # noqa: ANN001
        return SpanExportResult.SUCCESS


def _measure(stmt: str, env: dict, number: int, repeat: int) -> tuple[float, float]:
    """Best ns per execution of ``stmt``: (wall clock, this thread's CPU time).

    Thread CPU time is the training-thread cost the goals are about: it excludes time the
    export thread holds the GIL while converting records, and time other processes take.
    """
    wall = timeit.Timer(stmt, globals=env)
    cpu = timeit.Timer(stmt, timer=time.thread_time, globals=env)
    best_wall = min(wall.repeat(repeat=repeat, number=number)) / number * 1e9
    best_cpu = min(cpu.repeat(repeat=repeat, number=number)) / number * 1e9
    return best_wall, best_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args()
    n_fast, n_slow, repeat = (100_000, 5_000, 3) if args.quick else (1_000_000, 50_000, 7)

    # The raw SDK's BatchSpanProcessor drops spans when its queue fills ("Queue full"); quiet.
    logging.getLogger("opentelemetry").setLevel(logging.ERROR)
    run_dir = tempfile.mkdtemp(prefix="mlaunch-bench-")
    settings = load_telemetry_settings(
        environ={
            "MEGATRON_OTEL_ENABLED": "1",
            "MEGATRON_OTEL_SPAN_GROUPS": "all,-activation_offload",
            "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks",
            "MEGATRON_OTEL_EXPORTER": "none",
            "MEGATRON_OTEL_METRICS_ENABLED": "0",
            "MEGATRON_OTEL_RUN_ID": "bench",
        }
    )
    telemetry.setup(settings, rank=0, world_size=1, run_dir=run_dir)

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_DropExporter()))
    tracer = provider.get_tracer("bench")
    enabled = frozenset(g.value for g in settings.groups)

    @contextmanager
    def managed_span(group, name):  # noqa: ANN001, ANN202 - written the way nemo-lens does it
        if group not in enabled:
            yield None
            return
        with tracer.start_as_current_span(name) as s:
            yield s

    def f() -> None:
        pass

    env = {
        "f": f,
        "fs": enabled,
        "telemetry": telemetry,
        "span": telemetry.span,
        "is_enabled": telemetry.is_enabled,
        "managed_span": managed_span,
        "tracer": tracer,
        "OFF": G.ACTIVATION_OFFLOAD,
        "FINE": G.LAYER,
        "COARSE": G.STEP,
        "S": S,
    }
    rows = [
        ("empty loop (baseline)", "pass", n_fast),
        ("plain function call", "f()", n_fast),
        ("frozenset membership", "OFF in fs", n_fast),
        ("mlaunch is_enabled (off)", "is_enabled(OFF)", n_fast),
        ("mlaunch disabled `with span`", "with span(OFF, S.ACTIVATION_OFFLOAD): pass", n_fast),
        (
            "nemo-lens managed_span, disabled",
            "with managed_span(OFF, S.ACTIVATION_OFFLOAD): pass",
            n_fast,
        ),
        ("mlaunch fine span (enabled)", "with span(FINE, S.LAYER_FORWARD): pass", n_slow),
        ("mlaunch coarse span (enabled, SDK)", "with span(COARSE, S.ITERATION): pass", n_slow),
        (
            "raw OTel SDK span + BatchSpanProcessor",
            "with tracer.start_as_current_span(S.ITERATION): pass",
            n_slow,
        ),
        (
            "nemo-lens managed_span, enabled",
            "with managed_span(FINE, S.LAYER_FORWARD): pass",
            n_slow,
        ),
    ]
    # Constant lookups like S.X cost the same in every row that uses them; hoist them anyway.
    for name in ("ACTIVATION_OFFLOAD", "LAYER_FORWARD", "ITERATION"):
        env[name] = getattr(S, name).value
    results: dict[str, float] = {}
    walls: dict[str, float] = {}
    for label, stmt, number in rows:
        stmt = stmt.replace("S.", "")
        walls[label], results[label] = _measure(stmt, env, number, repeat)
        # Drop what the export thread has not converted yet, so it does not steal the GIL
        # from the next row (exporter "none" delivers nothing anyway).
        telemetry._spans.STATE.queue.clear()
    telemetry.shutdown(1.0)
    provider.shutdown()
    shutil.rmtree(run_dir, ignore_errors=True)

    width = max(len(label) for label in results)
    print(f"{'site':<{width}}  {'thread-cpu ns':>13}  {'wall ns':>9}")
    for label, ns in results.items():
        print(f"{label:<{width}}  {ns:13.1f}  {walls[label]:9.1f}")
    raw = results["raw OTel SDK span + BatchSpanProcessor"]
    print()
    print("ratios (thread CPU time)")
    print(
        f"  nemo-lens disabled guard / mlaunch disabled span : {results['nemo-lens managed_span, disabled'] / results['mlaunch disabled `with span`']:.1f}x"
    )
    print(
        f"  raw SDK span / mlaunch fine span                 : {raw / results['mlaunch fine span (enabled)']:.1f}x"
    )
    print(
        f"  raw SDK span / mlaunch coarse span               : {raw / results['mlaunch coarse span (enabled, SDK)']:.2f}x"
    )
    print(
        f"  mlaunch disabled span / plain call               : {results['mlaunch disabled `with span`'] / results['plain function call']:.1f}x"
    )
    print()
    print("goals (thread CPU time)")
    for label, goal in (
        ("mlaunch disabled `with span`", 150),
        ("mlaunch is_enabled (off)", 40),
        ("mlaunch fine span (enabled)", 2500),
    ):
        ok = "ok" if results[label] <= goal else "OVER"
        print(f"  {label:<{width}} {results[label]:8.1f} ns  (goal <= {goal} ns) {ok}")


if __name__ == "__main__":
    main()
