"""Bounded shutdown against dead or hanging endpoints (in subprocesses), the spool, and the
no-SDK import path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.launch_runs import clean_env
from support.otlp import HangingServer, closed_port_endpoint

from mlaunch.model.spans import Attr
from mlaunch.model.spans import SpanName as S
from mlaunch.otlp import otlp_json
from mlaunch.rundir import layout as lay

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 2.0
# The SDK's own flush would block for the exporter timeout (60 s here) or ~28 s of retries;
# mlaunch must return within its deadline. Generous slack: a correctness bound, not a perf test.
SLACK_S = 12.0

WORKER = textwrap.dedent(
    """
    import json, sys, time
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup as G
    from mlaunch.model.spans import SpanName as S

    telemetry.setup(rank=0, world_size=1)  # settings from the environment, as a worker does
    for it in range(20):
        telemetry.set_iteration(it)
        with telemetry.span(G.STEP, S.ITERATION):
            with telemetry.span(G.LAYER, S.LAYER_FORWARD):
                pass
        telemetry.record_step(it, step_ms=10.0, loss=1.0)
    time.sleep(0.5)  # let the export thread start a (hanging) export
    open_span = telemetry.span(G.JOB, S.TRAIN)
    open_span.__enter__()  # still open at shutdown: must be truncated, not lost
    t0 = time.monotonic()
    if sys.argv[1] == "explicit":
        telemetry.shutdown()
    assert "torch" not in sys.modules  # the telemetry runtime never imports torch
    print(json.dumps({"shutdown_s": time.monotonic() - t0}), flush=True)
    """
)


def _run_worker(tmp_path: Path, endpoint: str, protocol: str, mode: str) -> tuple[float, dict]:
    env = clean_env(
        MEGATRON_OTEL_ENABLED="1",
        MEGATRON_OTEL_SPAN_GROUPS="job,step,layer",
        MEGATRON_OTEL_RUN_ID="deadline",
        MEGATRON_OTEL_SHUTDOWN_TIMEOUT=str(DEADLINE_S),
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
        OTEL_EXPORTER_OTLP_TIMEOUT="60",
        MLAUNCH_RUN_DIR=str(tmp_path),
        PYTHONPATH=str(REPO),
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, mode], env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    return elapsed, {"out": json.loads(proc.stdout.strip().splitlines()[-1]), "err": proc.stderr}


def _assert_spooled(tmp_path: Path, err: str) -> None:
    spooled = otlp_json.read_spans(lay.spool_file(tmp_path, 0, "traces"))
    names = [s["name"] for s in spooled]
    assert names.count(S.ITERATION) == 20 and names.count(S.LAYER_FORWARD) == 20
    (train,) = [s for s in spooled if s["name"] == S.TRAIN]
    assert train["attributes"][Attr.TRUNCATED] is True
    assert len({s["span_id"] for s in spooled}) == len(spooled) == 41  # every span, once
    metrics = otlp_json.read_metrics(lay.spool_file(tmp_path, 0, "metrics"))
    assert metrics  # undelivered metrics are spooled too
    assert "could not be delivered" in err  # the count is logged
    assert err.count("export failed") <= 2  # once per cause, not per batch


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_shutdown_is_bounded_and_spools_with_a_hanging_endpoint(tmp_path, protocol):
    with HangingServer() as server:
        elapsed, res = _run_worker(tmp_path, server.endpoint, protocol, "explicit")
    assert res["out"]["shutdown_s"] < DEADLINE_S + 1.0
    assert elapsed < DEADLINE_S + SLACK_S
    _assert_spooled(tmp_path, res["err"])


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_atexit_shutdown_is_bounded_with_a_closed_port(tmp_path, protocol):
    elapsed, res = _run_worker(tmp_path, closed_port_endpoint(), protocol, "atexit")
    assert elapsed < DEADLINE_S + SLACK_S
    _assert_spooled(tmp_path, res["err"])


NO_SDK = textwrap.dedent(
    """
    import sys

    class HideSdk:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry.sdk" or name.startswith(("opentelemetry.sdk.", "opentelemetry.exporter")):
                raise ImportError("hidden: " + name)
            return None

    sys.meta_path.insert(0, HideSdk())
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup as G
    from mlaunch.model.spans import SpanName as S
    from mlaunch.settings import load_telemetry_settings
    from mlaunch.otlp import otlp_json  # importable without the SDK

    s = load_telemetry_settings(environ={"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks"})
    h = telemetry.setup(s, rank=0, world_size=1, run_dir=sys.argv[1])
    assert not h.exporting and not telemetry.is_enabled(G.JOB)
    with telemetry.span(G.JOB, S.STARTUP) as sp:
        assert isinstance(sp, telemetry.NullSpan)
    with telemetry.linked_span(G.COMMUNICATION, S.PP_RECV_FORWARD_LINKED, {"traceparent": "x"}):
        pass
    telemetry.set_iteration(3)
    telemetry.record_step(3, step_ms=1.0)
    telemetry.inject({})
    c = telemetry.context_from_ints((0, 1, 2, 1))  # the API alone is enough for contexts
    assert c is not None and c.span_id == 2
    telemetry.shutdown()
    assert not any(m.startswith("opentelemetry.sdk") for m in sys.modules)
    assert "torch" not in sys.modules
    print("ok")
    """
)


def test_without_the_sdk_everything_imports_and_is_a_no_op(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", NO_SDK, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "SDK unavailable" in proc.stderr
