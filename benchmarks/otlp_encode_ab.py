"""The OTLP span encoders' cost, this tree against a git revision, interleaved in time.

    python benchmarks/otlp_encode_ab.py [--base REV] [--rounds N]

The same three long-lived workers as ``recorded_span_ab.py`` (the base, a second copy of it as the
A/A control, this tree), taking turns one chunk each with the order rotated every round, timed in
thread CPU time with GC off. Each chunk encodes a batch of 200 spans (5 plain attributes each)
a few times; printed: the median and the minimum microseconds per span, and the A/A and new/base
ratios of the medians. Rows:

- ``runtime json, fast``: the runtime's OTLP/JSON line of plain fine-grained spans (the path
  nearly every span of a training run takes);
- ``runtime json, general`` / ``runtime dict, general`` / ``runtime protobuf, general``: spans
  with a status and an event, which take the general path (the span dict builder);
- ``receiver to_dict``: the receiver's conversion of a received protobuf request to OTLP/JSON.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recorded_span_ab import base_copies, print_rows, run_rounds  # noqa: E402 - a sibling script, not a package

BATCH = 200
REPEAT = 5
ROWS = (
    "runtime json, fast",
    "runtime json, general",
    "runtime dict, general",
    "runtime protobuf, general",
    "receiver to_dict",
)


def _spans(fine_span: type, general: bool) -> list:
    out = []
    for i in range(BATCH):
        attrs = {"megatron.iteration": i, "layer": i % 24, "loss": 1.5 + i, "op": "fwd", "ok": True}
        s = fine_span(f"megatron.op{i % 7}", attrs)
        s.trace_id, s.span_id, s.parent_id = 0xABCDEF0123456789ABCDEF0123456789, i + 1, i // 3 + 1
        s.start, s.end = 1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_500 + i
        if general:
            s.status = (2, "boom")
            s.events = [("ev", {"k": i}, s.start + 1)]
        out.append(s)
    return out


def worker(root: str) -> None:
    """Serve chunks: read a row label per line, print its microseconds per span."""
    sys.path.insert(0, root)
    import mlaunch
    from mlaunch.telemetry._encode import Limits, SpanEncoder
    from mlaunch.telemetry._spans import FineSpan

    try:  # where the receiver's converter lives in this tree
        from mlaunch.otlp.from_proto import to_dict
    except ImportError:
        from mlaunch.receiver.otlp_dict import to_dict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    if not mlaunch.__file__.startswith(root):
        raise SystemExit(f"worker imported {mlaunch.__file__}, not the code under {root}")
    enc = SpanEncoder(
        Resource.create({"service.name": "b"}), InstrumentationScope("s", "1"), Limits()
    )
    plain, general = _spans(FineSpan, False), _spans(FineSpan, True)
    request = ExportTraceServiceRequest()
    request.ParseFromString(enc.pb_request(general)[0])
    rows = {
        "runtime json, fast": lambda: enc.json_line(plain),
        "runtime json, general": lambda: enc.json_line(general),
        "runtime dict, general": lambda: enc.json_request(general),
        "runtime protobuf, general": lambda: enc.pb_request(general),
        "receiver to_dict": lambda: to_dict(request),
    }
    for fn in rows.values():
        fn()  # warm the encoder's caches
    print("ready", flush=True)
    for line in sys.stdin:
        fn = rows[line.strip()]
        gc.disable()
        t = time.thread_time()
        for _ in range(REPEAT):
            fn()
        elapsed = time.thread_time() - t
        gc.enable()
        print(f"{elapsed / (REPEAT * BATCH) * 1e6:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=40, help="chunks per worker and row")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    roots = base_copies(args.base, "mlaunch-encode-ab-")
    res = run_rounds(__file__, roots, ROWS, args.rounds)
    print(
        f"OTLP span encoders, this tree vs {args.base} (base2: a second copy of it, the A/A "
        f"control); {args.rounds} rounds x {REPEAT} batches of {BATCH} spans, thread CPU us/span"
    )
    print_rows(res, ROWS, digits=2)


if __name__ == "__main__":
    main()
