"""``mlaunch trace`` on the output of a real tiny run: the trainer under torchrun (PP=2, every
span group, checkpoint saves and evaluation), its files read back by the telemetry package's own
decoder as the independent reference."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from support.synthetic_traces import check_chrome_trace
from support.trace_cli import invoke_trace
from support.trainer_runs import TINY, run_trainer, telemetry_env

from mlaunch.model.spans import ResourceAttr, SpanName

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ITERS = 4
ARGS = [
    *TINY, "--train-iters", str(ITERS), "--pipeline-model-parallel-size", "2",
    "--eval-interval", "2", "--eval-iters", "2", "--save", "ck", "--save-interval", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = run_trainer(tmp_path_factory.mktemp("real"), ARGS, nproc=2, env=telemetry_env("all"))
    if run.returncode != 0:
        pytest.fail(f"the trainer failed:\n{run.output[-3000:]}")
    return run.run_dir


@pytest.fixture(scope="module")
def reference(run_dir: Path) -> list[dict]:
    from mlaunch.otlp.otlp_json import read_spans

    files = sorted((run_dir / "telemetry").glob("traces-rank*.jsonl"))
    assert len(files) == 2
    return [s for f in files for s in read_spans(f)]


def _cli(*args: str | Path) -> str:
    r = invoke_trace(*args)
    assert r.exit_code == 0, r.output
    return r.output


def test_export_holds_every_span_once_properly_nested(run_dir: Path, reference: list[dict],
                                                      tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "trace.json"
    _cli("export", run_dir, "--format", "chrome", "-o", out)
    doc = json.loads(out.read_text())
    xs = check_chrome_trace(doc)
    assert sorted(e["args"]["span_id"] for e in xs) == sorted(s["span_id"] for s in reference)
    assert {e["pid"] for e in xs} == {0, 1}
    # Every cross-stage link resolves (both ranks exported), each as one s/f flow pair.
    links = sum(len(s["links"]) for s in reference if s["name"] == SpanName.PP_RECV_FORWARD_LINKED)
    assert links > 0
    flows = Counter(e["ph"] for e in doc["traceEvents"] if e["ph"] in ("s", "f"))
    assert flows["s"] == flows["f"] >= links


def test_summary_matches_the_reference_decoder(run_dir: Path, reference: list[dict]) -> None:
    d = json.loads(_cli("summary", run_dir, "--json"))
    counts = {s["name"]: s["count"] for s in d["spans"]}
    assert counts == dict(Counter(s["name"] for s in reference))
    assert counts[SpanName.ITERATION] == 2 * ITERS
    step_ms = sorted((s["end_ns"] - s["start_ns"]) / 1e6 for s in reference
                     if s["name"] == SpanName.ITERATION)  # fmt: skip
    step = next(s for s in d["spans"] if s["name"] == SpanName.ITERATION)
    assert step["max_ms"] == pytest.approx(step_ms[-1])
    assert step["total_ms"] == pytest.approx(sum(step_ms))
    assert [r["rank"] for r in d["step_skew"]["ranks"]] == [0, 1]
    assert d["run"][ResourceAttr.RUN_ID] == reference[0]["resource"][ResourceAttr.RUN_ID]
    assert d["run"][ResourceAttr.PP_SIZE] == 2
    assert d["errors"] == 0 and d["truncated"] == 0


def test_goodput_accounts_for_all_wall_time(run_dir: Path, reference: list[dict]) -> None:
    d = json.loads(_cli("goodput", run_dir, "--json"))
    for r in d["ranks"]:
        # The trainer run directly has no launcher job span, and no worker span covers the run:
        # the wall is the extent of the rank's spans, start-up to the last block's end.
        assert r["wall_source"] == "span extent"
        mine = [s for s in reference if s["resource"][ResourceAttr.RANK] == r["rank"]]
        extent = max(s["end_ns"] for s in mine) - min(s["start_ns"] for s in mine)
        assert r["wall_ms"] == pytest.approx(extent / 1e6)
        parts = ("productive_ms", "restart_ms", "checkpoint_ms", "evaluation_ms", "unaccounted_ms")
        assert sum(r[k] for k in parts) == pytest.approx(r["wall_ms"])
        assert r["steps"] == ITERS
        assert 0 < r["goodput"] < 1
        assert r["checkpoint_ms"] > 0 and r["evaluation_ms"] > 0
        assert r["restart_split_ms"]["model_init"] > 0


def test_the_span_store_reads_the_real_run_as_the_json_reader(
    run_dir: Path, tmp_path: Path
) -> None:
    """The store the launcher built at the run's end reads the same as one built afresh from a
    copy of the run's OTLP-JSON (the streaming JSON reader this compared with is gone)."""
    import shutil

    from support.trace_compare import assert_same, fresh_store

    from mlaunch.trace.goodput import goodput_store
    from mlaunch.trace.store import open_store
    from mlaunch.trace.summary import summarize_store

    run = shutil.copytree(run_dir, tmp_path / "run")  # the module's run stays as the run left it
    store = open_store(run)
    assert store is not None
    ref = fresh_store(run)
    assert_same(summarize_store(ref).to_json(), summarize_store(store).to_json())
    assert_same(goodput_store(ref).to_json(), goodput_store(store).to_json())


def test_a_store_of_the_receivers_files_equals_the_store_of_the_workers_files(
    run_dir: Path, tmp_path: Path
) -> None:
    """The same real run's spans through the launcher's embedded receiver (the workers' requests
    handed to it in-process, in the order they were written): the receiver writes its own
    OTLP-JSON (from protobuf) and appends the span store from it as the spans arrive. A read in
    the middle sees the store's parts plus the JSON tail not yet in them; once the receiver has
    closed and the run-end build has run, the store holds what a store built afresh from the
    workers' files holds, row for row."""
    import shutil
    import time

    from support.otlp import RECEIVER_TOKEN
    from support.trace_compare import assert_same, fresh_store, json_store_rows, store_rows

    from mlaunch.otlp.otlp_json import decode_traces_line
    from mlaunch.receiver import Receiver
    from mlaunch.trace.store import open_store, update_store
    from mlaunch.trace.store_layout import load_manifest
    from mlaunch.trace.summary import summarize_store

    def spans_in(text: str) -> int:
        return sum(len(ss["spans"]) for line in text.splitlines()
                   for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"])  # fmt: skip

    def until(what: str, ok: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120
        while not ok():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    workers = shutil.copytree(run_dir, tmp_path / "workers")
    shutil.rmtree(workers / "trace-store", ignore_errors=True)  # built from the JSON below
    received = tmp_path / "received"
    # Appends from the first byte on (the receiver's default waits for 64 MiB).
    rx = Receiver(received, token=RECEIVER_TOKEN, log=lambda m: None, store_min_bytes=1)
    files = sorted((workers / "telemetry").glob("traces-rank*.jsonl"))
    lines = [line for f in files for line in f.read_text().splitlines()]
    total = spans_in("\n".join(lines))
    half = len(lines) // 2
    first = spans_in("\n".join(lines[:half]))
    for line in lines[:half]:
        assert rx.ingest_traces(decode_traces_line(line))

    def stored() -> int:
        man = load_manifest(received)
        return man.spans if man is not None else 0

    assert rx._store is not None
    # The append's process has written the manifest (last) and ended: the appender counted it.
    until("the receiver's append", lambda: stored() == first and rx._store.appends == 1)
    rx._store.min_bytes = 1 << 62  # no more appends: the rest stays a JSON tail
    for line in lines[half:]:
        assert rx.ingest_traces(decode_traces_line(line))

    def on_disk() -> int:  # the complete lines the receiver has written out
        texts = [f.read_text() for f in (received / "telemetry").glob("traces-*.jsonl")]
        return sum(spans_in(t[: t.rfind("\n") + 1]) for t in texts)

    until("the receiver's files", lambda: on_disk() == total)
    assert stored() == first < total
    live = open_store(received)  # a read while the run is written: store parts + the JSON tail
    assert live is not None and live.manifest.spans == total
    ref = summarize_store(fresh_store(received)).to_json()
    assert_same(ref, summarize_store(live).to_json())

    stats = rx.close()
    assert stats.store_appends >= 1
    assert stats.signals["traces"].written_items == sum(spans_in(f.read_text()) for f in files)
    assert sorted(p.name for p in (received / "telemetry").glob("traces-*")) == [
        f.name for f in files
    ]
    assert update_store(received) is None  # what the launcher runs at the end of the run
    mine, theirs = json_store_rows(workers, tmp_path / "fresh"), store_rows(open_store(received))
    assert len(mine[0]) == len(theirs[0]) > 0
    assert mine == theirs


def test_chrome_export_from_the_store_is_the_json_paths_bytes(
    run_dir: Path, tmp_path: Path
) -> None:
    """The export of the store the launcher built writes exactly the bytes of a store built
    afresh from the run's OTLP-JSON."""
    import shutil

    from support.trace_compare import fresh_store

    from mlaunch.trace.chrome import export_chrome
    from mlaunch.trace.store import StoreReader, open_store

    run = shutil.copytree(run_dir, tmp_path / "run")
    old = export_chrome(StoreReader(fresh_store(run)), tmp_path / "old.json")
    store = open_store(run)
    assert store is not None
    new = export_chrome(StoreReader(store), tmp_path / "new.json")
    assert old == new and new.spans > 0
    assert (tmp_path / "old.json").read_bytes() == (tmp_path / "new.json").read_bytes()


def test_the_report_from_the_store_prepares_the_json_paths_data(
    run_dir: Path, tmp_path: Path
) -> None:
    """The report's data from the store the launcher built equals that of a store built afresh
    from the run's OTLP-JSON."""
    import shutil
    from dataclasses import replace

    from support.trace_compare import assert_same, fresh_store

    from mlaunch.trace.report.build import prepare, render
    from mlaunch.trace.store import StoreReader, open_store

    run = shutil.copytree(run_dir, tmp_path / "run")
    old = prepare(run, StoreReader(fresh_store(run)))
    store = open_store(run)
    assert store is not None
    new = prepare(run, StoreReader(store))
    assert_same(old.summary.to_json(), new.summary.to_json())
    assert old.goodput.to_json() == new.goodput.to_json()
    assert old.timeline == new.timeline and old.timeline.spans > 0
    assert (old.ranges, old.notes, old.marks, old.meta, old.curve_figs) == (
        new.ranges, new.notes, new.marks, new.meta, new.curve_figs
    )  # fmt: skip
    assert render(old).html == render(replace(new, summary=old.summary)).html
