"""Telemetry under a collector outage: a real trainer process exporting over OTLP/gRPC to an
in-process receiver that stops in the middle of the run and comes back on the same port.

Training never waits for the collector; every span the run produced is either received or in the
spool; ``mlaunch trace summary`` reads the spool; ``mlaunch trace replay`` delivers the spooled
spans later, and a second replay sends nothing new. The run ends by a preemption signal
(SIGUSR1, enabled with ``--preempt-signals``): exit 0, a checkpoint at the last iteration.

"Every span the run produced" is known from the test-only tee (MLAUNCH_TEST_TEE_SPANS): the
export thread writes a copy of every span it hands to the exporter; the test checks the tee
itself against the progress records (one megatron.train.iteration per iteration).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support.otlp import GrpcOtlpReceiver, closed_port_endpoint
from support.trace_cli import trace_cli as cli
from support.trainer_runs import IDLE_PAUSE_S, TINY, clean_env

from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import read_metrics, read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SHUTDOWN_DEADLINE_S = 3.0
#: Generous slack on a shared 2-core machine: a correctness bound (training did not wait for the
#: collector, whose requests time out after EXPORT_TIMEOUT_S and retry), not a speed target.
SLACK_S = 5.0
EXPORT_TIMEOUT_S = 2


def keys(spans: list[dict]) -> set[tuple[str, str]]:
    return {(s["trace_id"], s["span_id"]) for s in spans}


def wait_until(predicate, timeout: float, proc: subprocess.Popen) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def test_collector_outage_spools_replays_and_never_stalls_training(tmp_path):
    run_dir = tmp_path / "run"
    tel = run_dir / "telemetry"
    spool = tel / "spool-traces-rank0.jsonl"
    progress = run_dir / "progress.jsonl"

    def iterations() -> int:
        return len(progress.read_text().splitlines()) if progress.exists() else 0

    rx1 = GrpcOtlpReceiver().start()
    rx2: GrpcOtlpReceiver | None = None
    env = clean_env(
        run_dir, MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_EXPORTER="otlp",
        MEGATRON_OTEL_SPAN_GROUPS="per_step", OTEL_EXPORTER_OTLP_ENDPOINT=rx1.endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_TIMEOUT=str(EXPORT_TIMEOUT_S),
        OTEL_METRIC_EXPORT_INTERVAL="500", MEGATRON_OTEL_SHUTDOWN_TIMEOUT=str(SHUTDOWN_DEADLINE_S),
        MLAUNCH_TEST_TEE_SPANS="1", MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S,  # open-ended: idle
    )  # fmt: skip
    args = [
        *TINY, "--train-iters", "1000000", "--log-interval", "1000", "--save", str(tmp_path / "ck"),
        "--preempt-signals", "SIGTERM,SIGUSR1",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlaunch.trainer", *args], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: iterations() >= 3 and rx1.spans, 120, proc), "no spans arrived"
        rx1.stop()  # fault 1: the collector goes away mid-run
        stopped_at = iterations()
        # The exporter notices (a failed request) and spools; training goes on meanwhile.
        assert wait_until(lambda: spool.exists() and spool.stat().st_size > 0, 60, proc)
        rx2 = GrpcOtlpReceiver(port=rx1.port).start()  # ... and comes back on the same port
        assert rx2.port == rx1.port
        assert wait_until(lambda: bool(rx2.spans), 60, proc), "export did not resume"
        assert wait_until(lambda: iterations() >= stopped_at + 5, 60, proc)
        proc.send_signal(signal.SIGUSR1)  # fault 2: preemption
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        rx1.stop()
    try:
        assert proc.returncode == 0, out[-3000:]
        assert "stop requested by signal" in out
        assert "undelivered data goes to" in out  # logged once, no traceback
        assert "Traceback" not in out

        records = [json.loads(line) for line in progress.read_text().splitlines()]
        last = records[-1]["iteration"]
        assert [r["iteration"] for r in records] == list(range(1, last + 1))
        assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == str(
            last
        )
        # Training never stalled on the collector: no step, and no gap between steps, longer
        # than the shutdown deadline plus slack (the training thread never waits for exports).
        bound_s = SHUTDOWN_DEADLINE_S + SLACK_S
        assert max(r["step_ms"] for r in records) / 1e3 < bound_s
        gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False)]
        assert max(gaps) < bound_s, max(gaps)

        # Every span is received or spooled: received ∪ spool == everything the run produced.
        produced = read_spans(tel / "tee-traces-rank0.jsonl")
        steps = sorted(
            s["attributes"]["megatron.iteration"]
            for s in produced
            if s["name"] == SpanName.ITERATION
        )
        assert steps == list(range(1, last + 1))  # the tee is complete
        all_keys = keys(produced)
        assert len(all_keys) == len(produced)
        spooled = read_spans(spool)
        received = keys(rx1.spans) | keys(rx2.spans)
        assert spooled and received
        assert received | keys(spooled) == all_keys
        lost = all_keys - received - keys(spooled)
        assert not lost
        missing = all_keys - received

        # `mlaunch trace summary` reads the spool (the only file there: no file exporter here).
        code, text = cli("summary", run_dir, "--json")
        assert code == 0, text
        summary = json.loads(text)
        assert summary["read"]["spans"] == len(keys(spooled))

        # Bad input exits 2 with a message, never a traceback.
        code, text = cli("replay", tmp_path / "nope", "--endpoint", rx2.endpoint)
        assert code == 2 and "no such directory" in text
        code, text = cli("replay", tmp_path / "ck", "--endpoint", rx2.endpoint)
        assert code == 2 and "not an mlaunch run directory" in text
        code, text = cli("replay", run_dir, "--endpoint", "localhost:4317")
        assert code == 2 and "is not an http(s) URL with a host" in text
        # A collector that is down: nothing recorded as sent, exit 1, the next replay retries.
        copy = tmp_path / "copy"
        shutil.copytree(run_dir, copy)
        code, text = cli("replay", copy, "--endpoint", closed_port_endpoint(), "--timeout", "1")
        assert code == 1 and f"failed {len(spooled):,} spans" in text, text
        assert not (copy / "telemetry" / "replayed.json").exists()

        # Replay delivers the spooled spans (and metrics) to the collector that came back...
        metrics_before = len(rx2.metrics)
        spooled_metric_lines = (
            len((tel / "spool-metrics-rank0.jsonl").read_text().splitlines())
            if (tel / "spool-metrics-rank0.jsonl").exists() else 0
        )  # fmt: skip
        code, text = cli("replay", run_dir, "--endpoint", rx2.endpoint, "--json")
        assert code == 0, text
        result = json.loads(text)
        assert result["spans_sent"] == len(spooled) and result["spans_failed"] == 0
        assert result["metric_batches_sent"] == spooled_metric_lines
        assert rx2.wait_for_spans(len(rx2.spans), timeout=1)
        assert missing <= keys(rx2.spans)
        assert keys(rx1.spans) | keys(rx2.spans) == all_keys
        if spooled_metric_lines:
            assert len(rx2.metrics) > metrics_before
            assert len(read_metrics(tel / "spool-metrics-rank0.jsonl")) > 0
        # ... and a second replay sends nothing new.
        count = len(rx2.spans)
        code, text = cli("replay", run_dir, "--endpoint", rx2.endpoint)
        assert code == 0, text
        assert "sent 0 spans and 0 metric batches in 0 requests" in text
        assert f"{len(spooled):,} spans were sent by earlier replays" in text
        assert len(rx2.spans) == count
        # The spool files stay readable by `mlaunch trace` after the replay.
        assert cli("summary", run_dir)[0] == 0
        print(
            f"faults: collector stop+restart, SIGUSR1; spans produced {len(all_keys)}, received live "
            f"{len(received)}, spooled {len(keys(spooled))}, replayed {result['spans_sent']}, lost {len(lost)}"
        )
    finally:
        if rx2 is not None:
            rx2.stop()
