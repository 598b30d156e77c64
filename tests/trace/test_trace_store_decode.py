"""The span store's column-wise decoder (mlaunch/trace/store_decode.py) writes the store the
JSON reader's path writes, value for value, and leaves to the reader every line it cannot take
exactly (so errors keep the reader's file:line messages). Hypothesis fuzzes it against the
reader in tests/trace/test_trace_store_decode_fuzz.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from support.synthetic_traces import (
    encode_attributes,
    hand_example,
    request_line,
    resource_attributes,
    write_realistic_run,
)

from mlaunch.trace import store_decode
from mlaunch.trace.reader import TraceInputError, TraceReader
from mlaunch.trace.store_build import build_store
from mlaunch.trace.store_layout import STORE_DIR

_JSON_COLUMNS = ("attributes", "links", "events", "extra")


def _store(run: Path, columnar: bool) -> dict[str, Any]:
    """Everything a store holds, JSON-text columns decoded (their key order and number spelling
    are free), from a build of a copy of ``run``."""
    copy = run.parent / f"{run.name}-{'columnar' if columnar else 'reader'}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy)
    man = build_store(copy, TraceReader.open(copy), columnar=columnar)
    rows: list[dict[str, Any]] = []
    for rel in man.parts:
        for row in pq.ParquetFile(copy / STORE_DIR / rel).read().to_pylist():
            for c in _JSON_COLUMNS:
                row[c] = None if row[c] is None else orjson.loads(row[c])
            row["rank"] = rel.split("/")[1]
            rows.append(row)
    res = pq.read_table(copy / STORE_DIR / "resources.parquet").to_pylist()
    man.read["torn_lines"] = [[Path(p).relative_to(copy), n] for p, n in man.read["torn_lines"]]
    return {"rows": rows, "resources": res, "spans": man.spans, "read": man.read,
            "complete": man.complete, "ranks": [p.split("/")[1] for p in man.parts]}  # fmt: skip


def _decoded_by_reader(run: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many lines the reader decoded itself in a columnar build of ``run``."""
    calls = []
    real = TraceReader.decode_line

    def counting(self: TraceReader, *a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(TraceReader, "decode_line", counting)
        _store(run, columnar=True)
    return len(calls)


def test_the_column_wise_store_equals_the_readers_on_synthetic_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hand = hand_example()[0].write_run_dir(tmp_path / "hand")
    legacy = hand_example(legacy=True, job=(0, 500))[0].write_run_dir(tmp_path / "legacy")
    real = tmp_path / "real"
    write_realistic_run(real, steps=30, seed=1, batch=37)
    for run in (hand, legacy, real):
        assert _store(run, columnar=True) == _store(run, columnar=False), run.name
    # not vacuous: the realistic run's lines never became Python dicts
    assert _decoded_by_reader(real, monkeypatch) == 0


def test_many_chunks_and_parts_give_the_readers_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace read in dozens of chunks (64 KiB of lines each): the columns of one chunk never
    leak into the next, and the resources and entries stay aligned across chunks."""
    from mlaunch.trace import store_build

    run = tmp_path / "many"
    write_realistic_run(run, ranks=4, steps=40, seed=4, batch=29)
    monkeypatch.setattr(store_build, "CHUNK_BYTES", 64 << 10)
    taken = []
    parse = store_build.parse
    monkeypatch.setattr(store_build, "parse", lambda *a: taken.append(c := parse(*a)) or c)
    assert _store(run, columnar=True) == _store(run, columnar=False)
    assert sum(c is not None for c in taken) >= 40, "the run was not read in many chunks"


def test_values_written_once_per_distinct_value_give_the_readers_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSON text of a column of few distinct values (whole attribute lists, attribute
    entries, ``extra``) is written once per value and copied; at the usual threshold only big
    chunks take that path, so here it is lowered until these small runs take it everywhere
    (resources and links hold lists: no hash for those, their text is built row by row)."""
    monkeypatch.setattr(store_decode, "_MEMO_ROWS", 8)
    memo = []
    real = store_decode._distinct_lists
    monkeypatch.setattr(store_decode, "_distinct_lists",
                        lambda a: memo.append(r := real(a)) or r)  # fmt: skip
    hand = hand_example()[0].write_run_dir(tmp_path / "hand")
    real_run = tmp_path / "real"
    write_realistic_run(real_run, steps=30, seed=1, batch=37)
    for run in (hand, real_run):
        assert _store(run, columnar=True) == _store(run, columnar=False), run.name
    assert any(r is not None for r in memo)  # not vacuous: whole lists were copied
    assert _decoded_by_reader(real_run, monkeypatch) == 0


def test_a_chunk_of_many_small_requests_gives_the_readers_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request a span (an exporter that batches little): thousands of resources in one chunk,
    whose text is built row by row (a resource holds a list: no hash for it)."""
    run = tmp_path / "run"
    (run / "telemetry").mkdir(parents=True)
    res = resource_attributes(0, world_size=1)
    lines = [request_line(res, [_span("megatron.iteration", f"{i:016x}", i, i + 1)])
             for i in range(5000)]  # fmt: skip
    (run / "telemetry" / "traces-rank0.jsonl").write_text("\n".join(lines) + "\n")
    assert _store(run, columnar=True) == _store(run, columnar=False)
    assert _decoded_by_reader(run, monkeypatch) == 0


def _span(name: str, sid: str, start: int, end: int, **extra: Any) -> dict[str, Any]:
    return {"traceId": "ab" * 16, "spanId": sid, "parentSpanId": "cd" * 8, "flags": 256,
            "name": name, "kind": 1, "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(end), **extra, "status": extra.pop("status", {})}  # fmt: skip


def _hard_values() -> list[dict[str, Any]]:
    """Spans whose values the decoder must write back exactly."""
    attrs = encode_attributes({
        "quote": 'he said "hi" \\ C:\\path', "unicode": "zürich ✓ 東京", "one": 1.0,
        "big": 1e20, "tiny": 5e-324, "neg0": -0.0, "half": 2.5, "flag": False, "n": -7,
        "megatron.iteration": 3.7,
    })  # fmt: skip
    return [
        _span("megatron.iteration", "01" * 8, 100, 200, attributes=attrs),
        _span(
            "megatron.layer.forward",
            "02" * 8,
            300,
            250,  # an end before its start
            attributes=[
                {"key": "megatron.microbatch_id", "value": {"intValue": "2"}},
                {"key": "nemo.span.truncated", "value": {"boolValue": True}},
            ],
            status={"message": 'boom "x"', "code": 2},
        ),  # fmt: skip
        _span(
            "megatron.optimizer",
            "03" * 8,
            400,
            500,
            attributes=[],
            traceState="k=v",
            droppedAttributesCount=3,
            links=[
                {
                    "traceId": "ef" * 16,
                    "spanId": "12" * 8,
                    "flags": 1,
                    "attributes": encode_attributes({"why": "p2p"}),
                }
            ],
            events=[
                {
                    "timeUnixNano": "450",
                    "name": "exception",
                    "attributes": encode_attributes({"exception.type": "ValueError"}),
                }
            ],
            status={"code": 1},
        ),  # fmt: skip
        _span(
            "megatron.forward",
            "04" * 8,
            500,
            600,
            parentSpanId="",
            attributes=[
                {"key": "nemo.span.truncated", "value": {"boolValue": False}},
                {"key": "megatron.eval_iteration", "value": {}},
                {"key": "megatron.iteration", "value": {"intValue": "9"}},
            ],
        ),  # fmt: skip
        {
            "traceId": "ab" * 16,
            "spanId": "05" * 8,
            "name": "bare",
            "startTimeUnixNano": "1",
            "endTimeUnixNano": "2",
        },  # fmt: skip
    ]


def test_hard_values_and_lines_left_to_the_reader_give_the_readers_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    tel = run / "telemetry"
    tel.mkdir(parents=True)
    res0 = resource_attributes(0, world_size=2)
    res1 = resource_attributes(1, world_size=2)
    res2 = resource_attributes(2, world_size=2)
    hard = _hard_values()
    odd_int = _span("n", "06" * 8, 1, 2, attributes=[{"key": "k", "value": {"intValue": 5}}])
    array = _span("a", "07" * 8, 1, 2, attributes=encode_attributes({"xs": [1, "two"]}))
    control = _span("c", "08" * 8, 1, 2, attributes=encode_attributes({"s": "bell\x07"}))
    # a member the decoder infers (not in its parse schema) that comes back as a timestamp, and
    # a span key outside the OTLP schema: both refused, the reader keeps the text and the key
    dated = _span("d", "0d" * 8, 1, 2, status={"message": "2024-01-01", "code": 2})
    unknown = _span("u", "0e" * 8, 1, 2, sampled=True)
    old_scope = {"instrumentationLibrarySpans": [{"spans": [_span("i", "09" * 8, 1, 2)]}]}
    ils = json.dumps({"resourceSpans": [{"resource": {"attributes": encode_attributes(res2)},
                                         **old_scope}]})  # fmt: skip
    # rank 0: the hard values (column-wise), a metric line, a blank line, a torn last line
    lines0 = [request_line(res0, hard[:3]), json.dumps({"resourceMetrics": []}), "",
              request_line(res0, hard[3:])]  # fmt: skip
    (tel / "traces-rank0.jsonl").write_text(
        "\n".join(lines0) + "\n" + request_line(res0, hard)[:50]
    )
    # rank 2: lines the decoder refuses (the reader takes them)
    refused = [request_line(res2, [odd_int]), request_line(res2, [array]), ils,
               request_line(res2, [control])]  # fmt: skip
    (tel / "traces-rank2.jsonl").write_text("\n".join(refused) + "\n")
    for rank, span in ((3, dated), (4, unknown)):  # each alone: its own chunk
        res = resource_attributes(rank, world_size=5)
        (tel / f"traces-rank{rank}.jsonl").write_text(request_line(res, [span]) + "\n")
    # rank 1: a spool whose spans the traces file repeats (deduplicated), a second scope
    spooled = [_span("s", "0a" * 8, 1, 2), _span("t", "0b" * 8, 3, 4)]
    (tel / "spool-traces-rank1.jsonl").write_text(request_line(res1, spooled[:1]) + "\n")
    two_scopes = json.loads(request_line(res1, spooled))
    two_scopes["resourceSpans"][0]["scopeSpans"].append({"scope": {"name": "other"},
                                                         "spans": hard[4:]})  # fmt: skip
    (tel / "traces-rank1.jsonl").write_text(json.dumps(two_scopes) + "\n")
    # a collector's file: no rank in its name nor its resources (ranks by process, in order)
    anon = [{"service.instance.id": f"proc-{i}", "host.name": "h"} for i in (1, 0, 1)]
    (tel / "traces-launcher-node0.jsonl").write_text(
        request_line({"service.name": "mlaunch"}, [_span("mlaunch.job", "0c" * 8, 0, 900)]) + "\n"
    )
    assert _store(run, columnar=True) == _store(run, columnar=False)
    collector = tmp_path / "collector"
    collector.mkdir()
    (collector / "otel-traces.jsonl").write_text(
        "".join(request_line(a, hard[i : i + 2]) + "\n" for i, a in enumerate(anon))
    )
    built = []
    for columnar in (True, False):
        d = tmp_path / f"c-{columnar}"
        shutil.copytree(collector, d)
        man = build_store(d, TraceReader.open(d / "otel-traces.jsonl"), columnar=columnar)
        built.append((man.parts, man.read, pq.read_table(d / STORE_DIR / "resources.parquet")))
    assert built[0][0] == ["spans/rank=0/part-00000.parquet", "spans/rank=1/part-00000.parquet",
                           "spans/rank=0/part-00001.parquet"]  # fmt: skip
    assert built[0][1] == built[1][1] and built[0][2].equals(built[1][2])
    # the reader decoded: the metric and the torn line, the 4 refused lines, the dated and the
    # unknown key's, the spooled rank's 2
    assert _decoded_by_reader(run, monkeypatch) == 2 + 4 + 2 + 2


def test_a_malformed_span_is_named_by_the_readers_message(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_realistic_run(run, ranks=1, steps=4, pp=1, batch=5)
    path = run / "telemetry" / "traces-rank0.jsonl"
    lines = path.read_text().splitlines()
    bad = json.loads(lines[2])
    del bad["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["name"]
    lines[2] = json.dumps(bad, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    messages = []
    for columnar in (True, False):
        with pytest.raises(TraceInputError) as e:
            build_store(run, TraceReader.open(run), columnar=columnar)
        messages.append(e.value.render())
    assert messages[0] == messages[1]
    assert f"{path}:3: malformed span: a span without a 'name'" in messages[0]
    assert not (run / STORE_DIR).exists()


@pytest.mark.parametrize("events", [[None, None], [None]])
def test_a_list_of_nulls_is_named_by_the_readers_message_not_an_arrow_error(
    tmp_path: Path, events: list[None]
) -> None:
    """pyarrow infers a member left out of its schema; a list of nulls there (``events``) made
    it raise ArrowIndexError (not ArrowInvalid), which escaped the build as a traceback. Found by
    test_trace_store_decode_fuzz.py: any Arrow error refuses the chunk, and the reader names it."""
    run = tmp_path / "run"
    write_realistic_run(run, ranks=1, steps=2, pp=1, batch=5)
    path = run / "telemetry" / "traces-rank0.jsonl"
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["events"] = events
    lines[1] = json.dumps(bad, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    messages = []
    for columnar in (True, False):
        with pytest.raises(TraceInputError) as e:
            build_store(run, TraceReader.open(run), columnar=columnar)
        messages.append(e.value.render())
    assert messages[0] == messages[1]
    assert f"{path}:2: malformed span" in messages[0]
    assert not (run / STORE_DIR).exists()


def test_bytes_that_are_no_utf8_are_refused_as_the_reader_refuses_them(tmp_path: Path) -> None:
    """pyarrow's parser keeps such bytes in a string; the reader calls the line invalid JSON."""
    run = tmp_path / "run"
    write_realistic_run(run, ranks=1, steps=2, pp=1, batch=5)
    path = run / "telemetry" / "traces-rank0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b"megatron.", b"megatron\xff.", 1)
    path.write_bytes(b"".join(lines))
    messages = []
    for columnar in (True, False):
        with pytest.raises(TraceInputError) as e:
            build_store(run, TraceReader.open(run), columnar=columnar)
        messages.append(e.value.render())
    assert messages[0] == messages[1] and f"{path}:2: not valid JSON" in messages[0]
