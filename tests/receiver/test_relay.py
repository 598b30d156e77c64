"""The receiver as a relay: workers export to the launcher, which forwards to the configured
collector with the user's protocol and headers, and spools what it cannot deliver; a collector
outage in the middle loses nothing (received + spooled = emitted), ``mlaunch trace replay`` sends
the spool later (lost = 0), an unresponsive collector never holds the launcher past its deadline,
and the headers (secrets) never reach a file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans
from support.otlp import RECEIVER_TOKEN, GrpcOtlpReceiver, HangingServer, HttpOtlpReceiver
from test_receiver import emit
from typer.testing import CliRunner

from mlaunch.otlp.otlp_json import read_spans
from mlaunch.receiver import Receiver, Upstream
from mlaunch.receiver.signals import SIGNALS
from mlaunch.rundir import layout as lay

SECRET = "s3cr3t-token-value"


def relay_to(env: dict[str, str]) -> dict[str, Upstream]:
    return {name: Upstream.from_env(env, name) for name in SIGNALS}


def spooled_ids(run_dir: Path) -> list[str]:
    return [
        s["span_id"]
        for p in sorted((run_dir / lay.TELEMETRY_DIR).glob("spool-traces-*.jsonl"))
        for s in read_spans(p)
    ]


def no_secret_on_disk(run_dir: Path) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path


@pytest.mark.slow
def test_collector_down_then_up_received_plus_spooled_equals_emitted_then_replay(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    collector = GrpcOtlpReceiver().start()
    port = collector.port
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
    }
    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, relay=relay_to(env), log=said.append).start()
    worker = GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True)  # as the workers are pointed
    emitted = emit(worker, 5, rank=0)  # collector up: forwarded
    assert collector.wait_for_spans(5, timeout=10)
    # ... and acknowledged (a call cut by the collector's stop after it stored the spans would be
    # both delivered and spooled: readers deduplicate, but this test counts exactly).
    deadline = time.monotonic() + 10
    while rx.stats.signals["traces"].forwarded_items < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    collector.stop()
    emitted += emit(worker, 8, rank=1)  # collector down: spooled (one failed try, then backoff)
    time.sleep(0.5)
    collector2 = GrpcOtlpReceiver(port).start()
    try:
        # Collector back: within the backoff (1 s, doubling) the relay uses it again.
        deadline = time.monotonic() + 15
        while not collector2.spans and time.monotonic() < deadline:
            emitted += emit(worker, 1, rank=0)
            time.sleep(0.2)
        assert collector2.spans, "the relay never went back to the collector"
        emitted += emit(worker, 4, rank=0)
        stats = rx.close()
        t = stats.signals["traces"]
        received = [s["span_id"] for s in collector.spans + collector2.spans]
        spooled = spooled_ids(tmp_path)
        assert t.received_items == len(emitted)
        assert t.forwarded_items == len(received) and t.spooled_items == len(spooled)
        assert sorted(received + spooled) == sorted(emitted)  # received + spooled = emitted
        assert len(spooled) >= 8 and t.lost_items == 0
        assert all(h.get("authorization") == f"Bearer {SECRET}" for h in collector.headers)
        assert sum("cannot deliver traces" in m for m in said) == 1  # logged once
        assert all(SECRET not in m for m in said)
        no_secret_on_disk(tmp_path)

        # `mlaunch trace replay` sends the spool; afterwards the collector has every span once.
        from mlaunch.cli import app

        before = len(collector2.spans)
        r = CliRunner().invoke(
            app, ["trace", "replay", str(tmp_path), "--endpoint", collector2.endpoint, "--json"]
        )
        assert r.exit_code == 0, r.output
        replayed = [s["span_id"] for s in collector2.spans[before:]]
        assert sorted(replayed) == sorted(spooled)
        delivered = [s["span_id"] for s in collector.spans + collector2.spans]
        assert sorted(delivered) == sorted(emitted)  # lost = 0
        print(f"relay: emitted {len(emitted)} received {len(received)} spooled {len(spooled)}"
              f" replayed {len(replayed)} lost {len(set(emitted) - set(delivered))}")  # fmt: skip
        # Ranks survive the round trip: the spool is per rank, the resource intact.
        assert {s["resource"]["dl.rank"] for s in collector2.spans[before:]} >= {1}
    finally:
        collector2.stop()


def test_http_relay_forwards_with_the_users_headers(tmp_path: Path) -> None:
    with HttpOtlpReceiver() as collector:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={SECRET}",
        }
        rx = Receiver(
            tmp_path, token=RECEIVER_TOKEN, relay=relay_to(env), log=lambda m: None
        ).start()
        ids = emit(HttpSpans(endpoint=rx.http_endpoint + "/v1/traces"), 6, rank=2)
        stats = rx.close()
        assert sorted(s["span_id"] for s in collector.spans) == sorted(ids)
        assert all(h.get("x-api-key") == SECRET for h in collector.headers)
        assert stats.signals["traces"].forwarded_items == 6
        assert stats.upstream["traces"].endswith("/v1/traces") and SECRET not in str(stats)
        no_secret_on_disk(tmp_path)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_unresponsive_collector_never_holds_the_launcher_past_the_deadline(
    tmp_path: Path, protocol: str
) -> None:
    with HangingServer() as hanging:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": hanging.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "60",  # the relay must not wait this long
        }
        rx = Receiver(
            tmp_path, token=RECEIVER_TOKEN, relay=relay_to(env), log=lambda m: None
        ).start()
        ids = emit(GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True), 4, rank=0)
        start = time.monotonic()
        stats = rx.close(deadline_s=2.0)
        took = time.monotonic() - start
        assert took < 3.5, took
        assert sorted(spooled_ids(tmp_path)) == sorted(ids)  # the call in flight too
        assert stats.signals["traces"].spooled_items == 4


@pytest.mark.slow
@pytest.mark.parametrize("upstream", ["hanging", "closed"])
def test_a_relay_outage_at_volume_spools_every_queued_request(
    tmp_path: Path, upstream: str
) -> None:
    """20,000 spans in ~40 requests (many batches, not one) while the collector hangs or is
    gone: at the close deadline the request in flight and every queued one are spooled."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from support.otlp import closed_port_endpoint

    n = 20_000
    with HangingServer() as hanging:
        endpoint = hanging.endpoint if upstream == "hanging" else closed_port_endpoint()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": "30"}
        rx = Receiver(
            tmp_path, token=RECEIVER_TOKEN, relay=relay_to(env), log=lambda m: None
        ).start()
        tp = TracerProvider(resource=Resource.create({"dl.rank": 0}))
        tp.add_span_processor(
            BatchSpanProcessor(
                GrpcSpans(endpoint=rx.grpc_endpoint, insecure=True),
                max_queue_size=n,
                max_export_batch_size=512,
            )
        )
        tracer = tp.get_tracer("t")
        ids = set()
        for i in range(n):
            with tracer.start_as_current_span(
                "megatron.microbatch.forward", attributes={"i": i}
            ) as sp:
                ids.add(format(sp.get_span_context().span_id, "016x"))
        assert tp.force_flush(60_000)  # the worker's side: all handed to the launcher
        tp.shutdown()
        stats = rx.close(deadline_s=2.0)
    t = stats.signals["traces"]
    spooled = spooled_ids(tmp_path)
    assert t.received_items == n
    assert t.forwarded_items == 0 and t.lost_items == 0
    assert t.spooled_items == len(spooled) == n
    assert set(spooled) == ids  # received + spooled = emitted, nothing twice
    print(f"relay outage ({upstream}) at volume: emitted {n} received {t.received_items}"
          f" forwarded {t.forwarded_items} spooled {len(spooled)} lost {n - len(set(spooled))}")  # fmt: skip
