"""``mlaunch train --script`` with a real nemo-lens worker (Megatron-LM's telemetry set-up) and the
launcher's embedded OTLP receiver, as a new user runs it:

- no collector (the default): every span the workers emitted is in the run directory, per rank,
  and every ``mlaunch trace`` command reads it;
- an endpoint whose collector is down for the whole run (relay, the default for scripts):
  nothing reaches the collector, everything is spooled (received + spooled = emitted), and
  ``mlaunch trace replay`` delivers all of it once the collector is up (lost = 0); the header
  (a secret) reaches the collector and never a file;
- the same endpoint with the collector up: the workers' spans arrive through the relay.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch
from support.otlp import GrpcOtlpReceiver, closed_port_endpoint
from support.trace_cli import trace_cli as cli
from support.trace_compare import store_rows

from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay
from mlaunch.trace import store_build
from mlaunch.trace.reader import TraceReader
from mlaunch.trace.store import open_store
from mlaunch.trace.store_build import build_store

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.nemo_lens]

SECRET = "tok-9f8e7d6c5b4a"
ARGS = ("--nproc-per-node", "2", "--train-iters", "4", "--otel-export-strategy", "all_ranks")


def emitted(run_dir: Path) -> int:
    """Spans the workers' SDK providers ended (what nemo-lens handed its exporter)."""
    reports = [json.loads((run_dir / f"lens-worker-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(rep.get("finished") and rep.get("exporting") for rep in reports), reports
    return sum(rep["emitted"] for rep in reports)


def receiver_stats(run_dir: Path) -> dict:
    return json.loads(lay.receiver_stats_file(run_dir).read_text())


def run_script(
    script: Path, run_dir: Path, *extra: str, cwd: Path, env: dict[str, str]
) -> tuple[int, str]:
    """``mlaunch train --script`` with the two-rank ARGS (plus ``extra``), run to the end."""
    return finish(
        mlaunch("--script", str(script), "--run-dir", str(run_dir), *ARGS, *extra, cwd=cwd, env=env)
    )


def run_relay(
    script: Path, run_dir: Path, endpoint: str, *, cwd: Path, env: dict[str, str]
) -> tuple[int, str]:
    """The same, relaying the workers' telemetry (OTLP exporter) to ``endpoint``."""
    return run_script(script, run_dir, "--otlp-endpoint", endpoint, "--otel-exporter", "otlp",
                      cwd=cwd, env=env)  # fmt: skip


def test_script_with_no_collector_writes_every_span_for_every_trace_command(
    lens_worker_script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    code, out = run_script(lens_worker_script, run_dir, cwd=tmp_path, env=clean_env())
    assert code == 0, out
    n = emitted(run_dir)
    per_rank = {r: len(read_spans(lay.traces_file(run_dir, r))) for r in (0, 1)}
    assert sum(per_rank.values()) == n and all(per_rank.values()), per_rank
    stats = receiver_stats(run_dir)
    assert stats["mode"] == "embedded"
    assert stats["signals"]["traces"]["written_items"] == n
    assert stats["signals"]["traces"]["lost_items"] == 0
    assert stats["signals"]["metrics"]["written_items"] > 0  # nemo-lens's metrics too
    taken: list[object] = []  # the chunks the decoder read (the first command builds the store)
    parse = store_build.parse
    monkeypatch.setattr(store_build, "parse", lambda *a: taken.append(c := parse(*a)) or c)
    for args in (
        ("summary", run_dir),
        ("goodput", run_dir),
        ("export", run_dir, "-o", tmp_path / "trace.json"),
        ("report", run_dir, "-o", tmp_path / "report.html"),
    ):
        code, text = cli(*args)
        assert code == 0, (args, text)
    assert (tmp_path / "report.html").stat().st_size > 0
    assert len(json.loads((tmp_path / "trace.json").read_text())["traceEvents"]) >= n
    # The store those commands read holds, row for row, what the JSON reader's own build of the
    # same files holds: nemo-lens's OTLP as the receiver wrote it, read by the decoder.
    store = open_store(run_dir, build=False)
    assert store is not None
    assert any(c is not None for c in taken), "the decoder took no chunk of the run"
    reference = tmp_path / "reference"
    shutil.copytree(run_dir / "telemetry", reference / "telemetry")
    build_store(reference, TraceReader.open(reference), columnar=False)
    assert store_rows(store) == store_rows(open_store(reference, build=False))


def launcher_spans(run_dir: Path) -> int:
    """The launcher's own job-trace spans (always also in its file in the run directory)."""
    spans = read_spans(lay.launcher_traces_file(run_dir, 0))
    assert {s["name"] for s in spans} == {SpanName.JOB, SpanName.JOB_ATTEMPT}
    return len(spans)


def test_relay_with_the_collector_down_spools_everything_and_replay_loses_nothing(
    lens_worker_script: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    endpoint = closed_port_endpoint()
    env = clean_env(
        OTEL_EXPORTER_OTLP_HEADERS=f"x-api-key={SECRET}", OTEL_EXPORTER_OTLP_TIMEOUT="2"
    )
    code, out = run_relay(lens_worker_script, run_dir, endpoint, cwd=tmp_path, env=env)
    assert code == 0, out
    # The workers' spans plus the launcher's job trace (mlaunch.job + its attempt), which the
    # relay forwards (here: spools) too.
    n = emitted(run_dir) + launcher_spans(run_dir)
    stats = receiver_stats(run_dir)["signals"]["traces"]
    assert stats["forwarded_items"] == 0 and stats["spooled_items"] == n  # received 0 + spooled
    assert stats["lost_items"] == 0
    assert SECRET not in out
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path
    # The collector comes up where the endpoint said; replay sends the spool.
    port = int(endpoint.rsplit(":", 1)[1])
    with GrpcOtlpReceiver(port) as collector:
        code, text = cli("replay", run_dir, "--endpoint", endpoint, "--headers",
                         f"x-api-key={SECRET}", "--json")  # fmt: skip
        assert code == 0, text
        result = json.loads(text)
        assert result["spans_sent"] == n and result["spans_failed"] == 0
        assert len({(s["trace_id"], s["span_id"]) for s in collector.spans}) == n  # lost = 0
        assert {s["resource"].get("dl.rank") for s in collector.spans} == {0, 1, None}
        print(f"relay (collector down): emitted {n} received {stats['forwarded_items']}"
              f" spooled {stats['spooled_items']} replayed {result['spans_sent']}"
              f" lost {n - len({(s['trace_id'], s['span_id']) for s in collector.spans})}")  # fmt: skip


def test_relay_with_the_collector_up_forwards_the_workers_spans(
    lens_worker_script: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    with GrpcOtlpReceiver() as collector:
        env = clean_env(OTEL_EXPORTER_OTLP_HEADERS=f"x-api-key={SECRET}")
        code, out = run_relay(
            lens_worker_script, run_dir, collector.endpoint, cwd=tmp_path, env=env
        )
        assert code == 0, out
        n = emitted(run_dir) + launcher_spans(run_dir)  # the workers' and the launcher's job trace
        assert collector.wait_for_spans(n, timeout=10)
        assert len(collector.spans) == n
        assert all(h.get("x-api-key") == SECRET for h in collector.headers)
    assert receiver_stats(run_dir)["signals"]["traces"]["forwarded_items"] == n
    assert not list((run_dir / lay.TELEMETRY_DIR).glob("spool-*"))


def test_sigterm_to_the_launcher_still_flushes_the_receiver(
    lens_worker_script: Path, tmp_path: Path
) -> None:
    """Ctrl-C/SIGTERM mid-run: the launcher forwards it, torchrun stops, and the receiver writes
    what arrived (whole lines) and its counts before the launcher exits."""
    import signal
    import time

    run_dir = tmp_path / "run"
    env = clean_env(LENS_WORKER_ITER_SECONDS="0.05", OTEL_BSP_SCHEDULE_DELAY="100")
    proc = mlaunch("--script", str(lens_worker_script), "--run-dir", str(run_dir),
                   "--nproc-per-node", "2", "--train-iters", "100000",
                   "--otel-export-strategy", "all_ranks", "--otel-span-groups", "per_step",
                   cwd=tmp_path, env=env)  # fmt: skip
    traces = lay.traces_file(run_dir, 0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if traces.exists() and traces.stat().st_size > 0:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code != 0  # interrupted
    stats = receiver_stats(run_dir)["signals"]["traces"]
    assert stats["written_items"] == stats["received_items"] > 0 and stats["lost_items"] == 0
    files = [lay.traces_file(run_dir, r) for r in (0, 1)]
    on_disk = sum(len(read_spans(p)) for p in files if p.exists())  # rank 1 may not have sent yet
    assert on_disk == stats["written_items"]
    code, text = cli("summary", run_dir)
    assert code == 0, text
