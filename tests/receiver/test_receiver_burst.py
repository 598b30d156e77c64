"""The receiver at volume and under worker crashes, with real worker processes (the OTel SDK's
batch processor and OTLP exporters, as nemo-lens sets a worker up).

- A 100,000-span burst from 2 workers: nothing lost (spans in the files = spans emitted), and the
  launcher side's memory bounded (its peak RSS growth, measured in a separate process that hosts
  only the receiver: ``benchmarks/receiver_burst.py``).
- The same with a queue budget of zero: every request beyond the one in hand is refused with
  RESOURCE_EXHAUSTED, the workers retry as told, and still nothing is lost.
- Workers SIGKILLed mid-export (gRPC and a half-sent HTTP body): the receiver keeps serving,
  every file stays readable, and it closes promptly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
from support.otlp import RECEIVER_TOKEN
from test_receiver import emit

from mlaunch.receiver import Receiver
from mlaunch.rundir import layout as lay
from mlaunch.trace.reader import TraceReader

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "receiver_burst.py"
#: The receiver's own growth for a 100k burst is ~20 MiB (benchmarks/receiver_burst.py); the
#: bound leaves room for a loaded machine while catching anything that scales with the burst
#: (100k spans as Python dicts would be several hundred MiB).
MAX_RSS_GROWTH_MIB = 120


def burst(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_100k_span_burst_from_2_workers_nothing_lost_bounded_memory() -> None:
    r = burst("--spans", "100000", "--workers", "2")
    print(r)
    assert r["emitted"] == r["exported_ok"] == 100_000 and r["export_failed"] == 0
    assert r["written"] == r["in_files"] == 100_000
    assert r["lost"] == 0
    assert r["rss_growth_mib"] < MAX_RSS_GROWTH_MIB


def test_a_full_queue_makes_workers_retry_and_loses_nothing() -> None:
    r = burst("--spans", "20000", "--workers", "2", "--protocol", "http", "--max-queued-mib", "0")
    print(r)
    assert r["in_files"] == r["emitted"] == 20_000 and r["lost"] == 0


_KILLED_WORKER = """
import sys, time
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
tp = TracerProvider(resource=Resource.create({"dl.rank": int(sys.argv[2])}))
tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1], insecure=True),
                                         schedule_delay_millis=5, max_export_batch_size=64))
t = tp.get_tracer("w")
while True:
    with t.start_as_current_span("megatron.train_step"):
        pass
"""


def test_workers_killed_mid_export_do_not_break_the_receiver(tmp_path: Path) -> None:
    import socket

    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=lambda m: None).start()
    procs = [
        subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, rx.grpc_endpoint, str(rank)])
        for rank in (0, 1)
    ]
    counts = rx.stats.signals["traces"]
    files = [lay.traces_file(tmp_path, rank) for rank in (0, 1)]

    def both_arrived() -> bool:
        # Each rank's own spans, not only 2,000 in all: on a busy machine rank 1's interpreter
        # can still be starting when rank 0 alone has sent 2,000 (then rank 1 has no file).
        return counts.written_items >= 2000 and all(f.is_file() and f.stat().st_size for f in files)

    deadline = time.monotonic() + 60
    while not both_arrived() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert both_arrived(), "the workers' spans never arrived"
    for p in procs:
        p.send_signal(signal.SIGKILL)  # mid-export: batches leave every 5 ms
        p.wait()
    # An HTTP worker dies halfway through a request body.
    host, port = rx.http_endpoint.removeprefix("http://").split(":")
    half = subprocess.Popen(
        [sys.executable, "-c", (
            "import socket,sys,time; s=socket.create_connection((sys.argv[1], int(sys.argv[2])));"
            "s.sendall(b'POST /v1/traces HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: "
            "application/x-protobuf\\r\\nContent-Length: 900000\\r\\n\\r\\n' + b'\\x0a'*300000);"
            "time.sleep(60)"), host, port],
    )  # fmt: skip
    time.sleep(0.5)
    half.send_signal(signal.SIGKILL)
    half.wait()
    socket.create_connection((host, int(port))).close()
    # Still serving, and a new worker's spans land.
    ids = emit(GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True), 3, rank=2)
    start = time.monotonic()
    stats = rx.close()
    assert time.monotonic() - start < 5
    t = stats.signals["traces"]
    assert t.written_items == t.received_items and t.lost_items == 0 and t.malformed_requests == 0
    # Every line whole: the reader reads the directory strictly (no --skip-invalid).
    seen = {}
    reader = TraceReader.open(tmp_path)
    for res, spans, _ in reader:
        seen[res.rank] = seen.get(res.rank, 0) + len(spans)
    assert seen[2] == 3 and seen[0] + seen[1] + 3 == t.written_items
    assert len(lay.traces_file(tmp_path, 2).read_text().splitlines()) == len(ids)
