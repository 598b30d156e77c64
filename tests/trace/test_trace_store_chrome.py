"""``trace export --format chrome`` from the span store (mlaunch/trace/chrome.py, column-wise)
writes byte for byte what the JSON path (ChromeExporter over the OTLP-JSON, removed in issue 41:
its bytes' SHA-256 recorded in :data:`JSON_PATH_SHA256`) wrote, on the suite's
synthetic runs and on a trace made of every case the column-wise path hands to the span-by-span
code: threads and lanes, the launcher's trace, errors, events (one before the first span), links
(resolved and not), attributes named like the exporter's own args, non-ASCII text, ids that are not
16 hex digits, a run longer than a day, an end before its start, several parts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from support.synthetic_traces import TraceBuilder, hand_example, write_realistic_run
from support.trace_cli import invoke_trace
from support.trace_compare import assert_same, fresh_store

from mlaunch.model.spans import SpanName
from mlaunch.trace.chrome import export_chrome
from mlaunch.trace.reader import TraceReader
from mlaunch.trace.store import StoreReader, open_store
from mlaunch.trace.store_build import build_store
from mlaunch.trace.summary import summarize_store

S = SpanName
LONG_NS = 123_456_789_012_345_678
DAY_MS = 30 * 3600 * 1000.0  # past 10^11 us (27.8 h) from the earliest span: the repr fallback
#: Steps of a 3-rank run whose layout sort outgrows 24 MB of DuckDB memory (about 275,000 spans).
SPILL_STEPS = 1500


def _hostile() -> TraceBuilder:
    b = TraceBuilder(world_size=3)
    step = b.span(0, S.ITERATION, 0, 100, attrs={"megatron.iteration": 1})
    fb = b.span(0, S.FORWARD_BACKWARD, 5, 90, parent=step)
    send = b.span(0, S.P2P_SEND_FORWARD, 10, 50, parent=fb)
    b.span(0, S.P2P_RECV_FORWARD, 30, 70, parent=fb)  # overlaps the send: a second lane
    b.span(0, S.P2P_RECV_BACKWARD, 40, 60, parent=fb)
    b.span(0, S.DATALOADER, 20, 130, thread=7)
    b.span(0, S.DATALOADER, 25, 27, thread=7, attrs={"thread.name": "loader"})
    b.span(1, S.ITERATION, 1, 101, error="disk full")
    b.span(1, S.OPTIMIZER, 2, 3, error="")
    b.span(1, S.PP_RECV_FORWARD_LINKED, 15, 30, links=[send])
    b.span(1, S.OPTIMIZER, 60, 70, links=[type(send)("ff" * 16, "ee" * 8, 0)])  # not exported
    b.span(1, S.EVALUATE_STEP, 80, 90, events=[(-5, "early", {"k": 1}), (85, "exception", {})])
    b.span(1, "custom.span.äöü", 3, 4, attrs={"span_id": "mine", "note": "naïve ✓"})
    b.span(1, "custom.other", 4, 5, attrs={"status": "own"})
    b.span(2, S.ITERATION, 0, DAY_MS, attrs={"f": 0.1, "b": True, "l": [1, "x"]})
    b.span(2, S.OPTIMIZER, DAY_MS - 1.234567, DAY_MS - 0.5)
    b.span(2, S.OPTIMIZER, 50, 40)  # ends before it starts
    b.span(2, "custom.noattrs", 7, 8)
    b.span(TraceBuilder.LAUNCHER, "mlaunch.job", -1, DAY_MS + 1)
    odd = b.span(2, S.DATALOADER, 9, 10)
    for s in b.spans[2]:
        if s["spanId"] == odd.span_id:
            s["spanId"] = "xyz-not-hex"  # odd ids are kept and exported as written
    b.span(2, "custom.clock", 11, 12)  # a clock jump: 1.2e14 us, more digits than repr keeps
    b.spans[2][-1]["endTimeUnixNano"] = str(int(b.spans[2][-1]["startTimeUnixNano"]) + LONG_NS)
    return b


def _runs(tmp_path: Path) -> list[Path]:
    hand = hand_example()[0].write_run_dir(tmp_path / "hand")
    a = tmp_path / "real4"
    write_realistic_run(a, steps=30, seed=1)
    b = tmp_path / "real2"
    write_realistic_run(b, ranks=2, steps=12, pp=1, microbatches=2, layers=2, batch=7, seed=3)
    return [hand, a, b, _hostile().write_run_dir(tmp_path / "hostile", batch=2)]


#: SHA-256 of what the JSON path's exporter wrote for each trace below (recorded with that code).
JSON_PATH_SHA256 = {
    "cli": "bddc9ff6de175860725cabf21ae165660a52472befad0fcbeb518c2018e4862b",
    "hand": "4aa4809df44271857d77374b5f9d9b0a902733ee84f959ce25b6615f6fa6077d",
    "hostile": "1cbd29a1c735f1c68f851668729017ea1804df5c870bd9a77d0cfca38d037bb1",
    "hostile-batch2": "1cbd29a1c735f1c68f851668729017ea1804df5c870bd9a77d0cfca38d037bb1",
    "real2": "814b70d43527213f973f6402afc76e3cd512a5c6b5f3f9f1102dcc1103f5a3ee",
    "real4": "bc3c68a73b429d4e4dcf695d4ab1e29049db6a39dfaac51ff17a5782ff3e80d8",
    "spill": "36e791f5fcc814039e6f4a42cbc705f95e620d136b6d405e387bb54ca459ad84",
}


def _both(run: Path, tmp_path: Path, key: str | None = None, **build: int) -> tuple[bytes, bytes]:
    """The JSON path's bytes' hash and the store's export of ``run`` (its parts cut as
    ``build`` says), as a pair that must be equal."""
    import hashlib

    new = tmp_path / "new.json"
    if build:
        build_store(run, TraceReader.open(run), **build)
    store = open_store(run)
    assert store is not None
    export_chrome(StoreReader(store), new)
    got = hashlib.sha256(new.read_bytes()).hexdigest()
    return JSON_PATH_SHA256[key or run.name].encode(), got.encode()


@pytest.mark.parametrize("rows", [32_768, 3])
def test_chrome_export_from_the_store_is_byte_for_byte_the_json_paths(
    tmp_path: Path, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlaunch.trace import chrome

    monkeypatch.setattr(chrome, "_SLICE", rows)  # the texts of a part built in slices
    for run in _runs(tmp_path):
        old, new = _both(run, tmp_path)
        assert old == new, run.name
    doc = json.loads((tmp_path / "new.json").read_text())  # the hostile run: the cases were there
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert any(e["args"].get("status") == "ERROR" for e in xs)
    assert any(e["args"]["span_id"] == "xyz-not-hex" for e in xs)
    assert any(e["ts"] >= 1e11 for e in xs)
    assert any(e["dur"] > 1e14 for e in xs)
    assert any(e["ph"] == "i" and e["ts"] < 0 for e in doc["traceEvents"])
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) == 1


@pytest.mark.parametrize("segment_rows", [1, 3])
def test_a_store_of_many_small_parts_exports_the_same_bytes(
    tmp_path: Path, segment_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlaunch.trace import chrome

    monkeypatch.setattr(chrome, "_SLICE", 2)  # and a part's texts built 2 rows at a time
    run = _hostile().write_run_dir(tmp_path / "run", batch=2)
    old, new = _both(run, tmp_path, "hostile-batch2", segment_rows=segment_rows)
    assert old == new


def test_the_cli_exports_a_run_directory_from_its_store(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_realistic_run(run, ranks=2, steps=4, seed=5)
    r = invoke_trace("export", run, "-o", tmp_path / "cli.json")
    assert r.exit_code == 0, r.output
    assert (run / "trace-store" / "manifest.json").is_file()  # it read the store
    got = hashlib.sha256((tmp_path / "cli.json").read_bytes()).hexdigest()
    assert got == JSON_PATH_SHA256["cli"]


@pytest.mark.slow  # about 275,000 spans through both exporters: a minute on a CI core
def test_exports_that_spill_are_the_json_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-rank store of many parts, DuckDB held to 24 MB and one thread: the layout's sort
    (each thread's spans by start) goes to disk, as at 10^8 spans, and the chrome export is still
    the JSON path's bytes; the OTLP-JSON export (a record batch at a time, no DuckDB) holds the
    same spans as the JSON's."""
    from mlaunch.trace import chrome, store
    from mlaunch.trace.chrome import LaneSweep
    from mlaunch.trace.store import export_otlp_json

    monkeypatch.setattr(chrome, "SORT_MEMORY", "24MB")
    monkeypatch.setattr(store, "DUCKDB_THREADS", 1)
    spilled: list[bool] = []

    class Watched(LaneSweep):  # notes, as the sorted spans arrive, whether DuckDB wrote to disk
        def feed(self, *cols: Any) -> list[int]:
            spill = list(run.joinpath("trace-store").glob(".duckdb-spill-*/*"))
            spilled.append(bool(spill))
            return super().feed(*cols)

    monkeypatch.setattr(chrome, "LaneSweep", Watched)
    run = tmp_path / "run"
    write_realistic_run(run, ranks=3, steps=SPILL_STEPS, pp=1, seed=7)
    old, new = _both(run, tmp_path, "spill", segment_rows=40_000)
    assert old == new
    st = open_store(run)
    assert st is not None and len(st.parts) > 3 and any(spilled)
    assert not list(run.joinpath("trace-store").glob(".*"))  # no scratch left behind
    # the OTLP-JSON export (a record batch at a time, no DuckDB) reads back as the same spans
    b = tmp_path / "b.jsonl"
    n = export_otlp_json(StoreReader(st), b)
    back = fresh_store(b)
    assert n == st.manifest.spans == back.manifest.spans
    old, new = summarize_store(st).to_json(), summarize_store(back).to_json()
    for k in ("spans", "step_skew", "ranks_seen", "errors", "truncated"):
        assert_same(old[k], new[k], k)
