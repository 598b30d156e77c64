"""Nothing lost at volume: 100,000 spans against a closed port, a hanging server and a server that
dies mid-run. Every span is delivered, spooled or counted as dropped with a reason, the counts add
up, and the shutdown warning states them (in subprocesses, as a worker runs)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.launch_runs import clean_env
from support.otlp import GrpcOtlpReceiver, HangingServer, closed_port_endpoint

from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay
from mlaunch.telemetry._runtime import BATCH_SIZE

REPO = Path(__file__).resolve().parents[2]
STEPS, LAYERS = 100, 999  # 100 coarse step spans with 999 fine spans each: 100,000 spans
TOTAL = STEPS * (1 + LAYERS)
HALF = TOTAL // 2
DEADLINE_S = 3.0

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup as G
    from mlaunch.model.spans import SpanName as S

    steps, layers, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    h = telemetry.setup(rank=0, world_size=1)
    span, STEP, LAYER = telemetry.span, G.STEP, G.LAYER
    for it in range(steps):
        if go != "-" and it == steps // 2:  # half-way: wait until the test killed the server
            Path(go + ".half").touch()
            deadline = time.monotonic() + 120
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
        with span(STEP, S.ITERATION):
            for _ in range(layers):
                with span(LAYER, S.LAYER_FORWARD):
                    pass
    t0 = time.monotonic()
    telemetry.shutdown()
    print(json.dumps({"shutdown_s": time.monotonic() - t0, **h.span_counts()}), flush=True)
    """
)


def _env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    env = clean_env(
        MEGATRON_OTEL_ENABLED="1",
        MEGATRON_OTEL_SPAN_GROUPS="step,layer",
        MEGATRON_OTEL_RUN_ID="counting",
        MEGATRON_OTEL_METRICS_ENABLED="0",
        MEGATRON_OTEL_SHUTDOWN_TIMEOUT=str(DEADLINE_S),
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_TIMEOUT="2",
        MLAUNCH_RUN_DIR=str(tmp_path),
        PYTHONPATH=str(REPO),
    )
    return env


def _parse(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spooled_ids(tmp_path: Path) -> list[str]:
    path = lay.spool_file(tmp_path, 0, "traces")
    return [s["span_id"] for s in otlp_json.read_spans(path)] if path.exists() else []


def _check(counts: dict[str, Any], err: str, tmp_path: Path, received: list[str]) -> None:
    print(
        "counts:",
        {k: counts[k] for k in ("emitted", "delivered", "spooled", "dropped", "dropped_by")},
    )
    assert counts["emitted"] == TOTAL
    assert counts["pending"] == 0
    assert counts["dropped"] == 0, counts["dropped_by"]
    assert counts["delivered"] + counts["spooled"] + counts["dropped"] == counts["emitted"]
    spooled = _spooled_ids(tmp_path)
    assert len(spooled) == len(set(spooled)) == counts["spooled"]
    # Nothing lost: every span is at the receiver or in the spool (a batch whose answer never
    # came may be in both; it counts once, as spooled).
    assert len(set(spooled) | set(received)) == TOTAL
    assert len(received) >= counts["delivered"]
    # The warning states the numbers.
    m = re.search(r"(\d+) emitted = (\d+) delivered \+ (\d+) spooled \+ (\d+) dropped", err)
    assert m, err[-2000:]
    assert [int(x) for x in m.groups()] == [
        counts["emitted"],
        counts["delivered"],
        counts["spooled"],
        counts["dropped"],
    ]


def _run(tmp_path: Path, endpoint: str, go: str = "-") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WORKER, str(STEPS), str(LAYERS), go],
        env=_env(tmp_path, endpoint),
        capture_output=True,
        text=True,
        timeout=300,
    )


@contextlib.contextmanager
def _closed_port() -> Iterator[str]:
    yield closed_port_endpoint()


@contextlib.contextmanager
def _hanging_server() -> Iterator[str]:
    with HangingServer() as server:
        yield server.endpoint


@pytest.mark.slow
@pytest.mark.parametrize(
    "unreachable", [_closed_port, _hanging_server], ids=["closed-port", "hanging-server"]
)
def test_100k_spans_against_an_unreachable_collector_are_all_spooled(tmp_path, unreachable):
    with unreachable() as endpoint:
        proc = _run(tmp_path, endpoint)
    counts = _parse(proc)
    assert counts["delivered"] == 0 and counts["spooled"] == TOTAL
    assert counts["shutdown_s"] < DEADLINE_S + 5.0
    _check(counts, proc.stderr, tmp_path, [])


@pytest.mark.slow
def test_100k_spans_with_a_server_that_dies_mid_run(tmp_path):
    go = str(tmp_path / "go")
    rx = GrpcOtlpReceiver().start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(STEPS), str(LAYERS), go],
            env=_env(tmp_path, rx.endpoint),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(go + ".half") and time.monotonic() < deadline:
            time.sleep(0.05)
        # The first half delivered, then the collector dies.
        assert rx.wait_for_spans(HALF, timeout=120)
    finally:
        rx.stop()
    Path(go).touch()
    out, err = proc.communicate(timeout=300)
    counts = _parse(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    received = [s["span_id"] for s in rx.spans]
    # The batch in flight when the server died may have arrived unconfirmed: it counts as spooled.
    assert counts["delivered"] >= HALF - BATCH_SIZE and counts["spooled"] >= HALF
    _check(counts, err, tmp_path, received)
