"""The launcher's embedded OTLP receiver under a span burst from worker processes.

This process plays the launcher: it hosts :class:`mlaunch.receiver.Receiver` (and imports nothing
else heavy: no OTel SDK, no torch), starts ``--workers`` worker processes that each end
``--spans / --workers`` spans as fast as they can through the OTel SDK (``BatchSpanProcessor``
+ the OTLP gRPC or HTTP exporter, resource ``dl.rank=R``, as nemo-lens configures a worker), and
measures

- received spans/s: spans the workers' exporters got acknowledged, over the time from the
  workers' first span to the last acknowledgement;
- written spans/s: spans in the run directory's ``traces-rank{R}.jsonl`` over the time from the
  first span until the writer has written them all;
- peak RSS of this (the launcher's) process, and its growth over the baseline before the
  receiver started;

then checks that every span a worker emitted is in the files (lost = emitted - written = 0).

    python benchmarks/receiver_burst.py [--spans 100000] [--workers 2] [--protocol grpc|http]
        [--max-queued-mib 64] [--capacity] [--json]

The end-to-end rates are bounded by the workers' own cost of making and encoding spans on the
same cores; ``--capacity`` adds the receiver's rate alone (serialized requests submitted
in-process, parsed, converted and written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent


def _vm(key: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak is the receiver's."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# The worker side


def worker(rank: int, spans: int, endpoint: str, protocol: str) -> dict[str, Any]:
    """End ``spans`` spans through the SDK's batch processor and OTLP exporter; report counts."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        inner = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        inner = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")

    counts = {"exported": 0, "failed": 0}

    class Counting(SpanExporter):
        """The real exporter, counting what the receiver acknowledged."""

        def export(self, batch: Any) -> SpanExportResult:
            result = inner.export(batch)
            counts["exported" if result == SpanExportResult.SUCCESS else "failed"] += len(batch)
            return result

        def shutdown(self) -> None:
            inner.shutdown()

    exporter = Counting()
    provider = TracerProvider(resource=Resource.create({"dl.rank": rank, "service.name": "burst"}))
    # A queue as large as the burst: the worker itself drops nothing, so "emitted" is exact.
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter, max_queue_size=spans + 1, max_export_batch_size=512, schedule_delay_millis=20
        )
    )
    tracer = provider.get_tracer("burst")
    start = time.time()
    for i in range(spans):
        with tracer.start_as_current_span("megatron.train_step") as span:
            span.set_attribute("dl.iteration", i)
    provider.force_flush(600_000)
    done = time.time()
    provider.shutdown()
    return {"rank": rank, "emitted": spans, "start": start, "acked": done, **counts}


# ---------------------------------------------------------------------------------------------
# The launcher side


def run_burst(
    spans: int = 100_000,
    workers: int = 2,
    protocol: str = "grpc",
    run_dir: Path | None = None,
    max_queued_mib: int = 64,
    worker_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One burst; returns the measurements (see the module docstring)."""
    sys.path.insert(0, str(_REPO))
    from mlaunch.launcher.receiver_wiring import token_env
    from mlaunch.otlp.otlp_json import read_spans
    from mlaunch.receiver import Receiver
    from mlaunch.rundir import layout as lay

    tmp = None
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="receiver-burst-")
        run_dir = Path(tmp.name)
    baseline = _vm("VmRSS")
    _reset_peak()
    rx = Receiver(run_dir, max_queued_bytes=max_queued_mib * 2**20).start()
    endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
    assert endpoint, rx.stats.errors
    per = spans // workers
    # The workers authenticate as a launch's do: the token in the standard headers variable.
    env = {**os.environ, "PYTHONPATH": str(_REPO), **token_env(rx), **(worker_env or {})}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(r),
                "--spans",
                str(per),
                "--endpoint",
                endpoint,
                "--protocol",
                protocol,
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )  # fmt: skip
        for r in range(workers)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"worker exited {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    first = min(r["start"] for r in results)
    acked = max(r["acked"] for r in results)
    exported = sum(r["exported"] for r in results)
    counts = rx.stats.signals["traces"]
    while counts.written_items + counts.lost_items < exported and time.time() - acked < 300:
        time.sleep(0.01)
    written_at = time.time()
    peak = _vm("VmHWM")
    stats = rx.close()
    files = {r: lay.traces_file(run_dir, r) for r in range(workers)}
    in_files = {r: len(read_spans(p)) if p.exists() else 0 for r, p in files.items()}
    out = {
        "protocol": protocol,
        "workers": workers,
        "emitted": sum(r["emitted"] for r in results),
        "exported_ok": exported,
        "export_failed": sum(r["failed"] for r in results),
        "received": counts.received_items,
        "written": counts.written_items,
        "in_files": sum(in_files.values()),
        "lost": sum(r["emitted"] for r in results) - sum(in_files.values()),
        "rejected_requests": counts.rejected_requests,
        "received_spans_per_s": round(exported / max(acked - first, 1e-9)),
        "written_spans_per_s": round(counts.written_items / max(written_at - first, 1e-9)),
        "seconds_to_acked": round(acked - first, 3),
        "seconds_to_written": round(written_at - first, 3),
        "peak_rss_mib": round(peak / 2**20, 1),
        "baseline_rss_mib": round(baseline / 2**20, 1),
        "rss_growth_mib": round((peak - baseline) / 2**20, 1),
        "peak_queued_mib": round(stats.peak_queued_bytes / 2**20, 2),
        "close_s": stats.closed_in_s,
    }
    if tmp is not None:
        tmp.cleanup()
    return out


def capacity(spans: int = 100_000, batch: int = 512) -> dict[str, Any]:
    """The receiver's own pipeline without workers: serialized 512-span requests (as the SDK
    sends them) submitted in-process as fast as the queue takes them; spans/s until written."""
    sys.path.insert(0, str(_REPO))
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from mlaunch.receiver import Receiver

    ended: list[Any] = []

    class Keep(SpanExporter):
        def export(self, batch_: Any) -> SpanExportResult:
            ended.extend(batch_)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"dl.rank": 0}))
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("burst")
    for i in range(batch):
        with tracer.start_as_current_span("megatron.train_step") as span:
            span.set_attribute("dl.iteration", i)
    body = encode_spans(ended).SerializeToString()
    with tempfile.TemporaryDirectory(prefix="receiver-capacity-") as tmp:
        rx = Receiver(tmp, max_queued_bytes=2**40)
        start = time.perf_counter()
        for _ in range(spans // batch):
            rx.submit("traces", body, len(body))
        counts = rx.stats.signals["traces"]
        while counts.written_items < (spans // batch) * batch:
            time.sleep(0.005)
        took = time.perf_counter() - start
        rx.close()
    return {"capacity_spans_per_s": round((spans // batch) * batch / took)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--max-queued-mib", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument(
        "--capacity", action="store_true",
        help="also measure the receiver alone: in-process requests, no worker processes",
    )  # fmt: skip
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.spans, args.endpoint, args.protocol)))
        return
    r = run_burst(args.spans, args.workers, args.protocol, max_queued_mib=args.max_queued_mib)
    if args.capacity:  # after the burst: the SDK it imports must not count in the peak RSS
        r.update(capacity(args.spans))
    if args.json:
        print(json.dumps(r))
        return
    print(f"burst: {r['emitted']:,} spans from {r['workers']} workers over OTLP/{r['protocol']}")
    print(f"  received: {r['received_spans_per_s']:>10,} spans/s ({r['seconds_to_acked']} s)")
    print(f"  written:  {r['written_spans_per_s']:>10,} spans/s ({r['seconds_to_written']} s)")
    print(f"  peak RSS: {r['peak_rss_mib']} MiB (baseline {r['baseline_rss_mib']} MiB,"
          f" +{r['rss_growth_mib']} MiB; queue peak {r['peak_queued_mib']} MiB)")  # fmt: skip
    print(f"  emitted {r['emitted']:,}, in files {r['in_files']:,}, lost {r['lost']:,},"
          f" refused requests (retried) {r['rejected_requests']:,}")  # fmt: skip
    if args.capacity:
        print(f"  receiver alone (no workers): {r['capacity_spans_per_s']:,} spans/s written")


if __name__ == "__main__":
    main()
