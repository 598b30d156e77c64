"""The span store's C scanner (mlaunch/trace/_cscan.c) against the pyarrow decoder behind it and
the JSON reader (the reference): the same store wherever it takes a chunk, and a refusal (None,
never a crash) for anything it does not take exactly, mutated and torn lines included."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.synthetic_traces import (
    encode_attributes,
    hand_example,
    request_line,
    resource_attributes,
    write_realistic_run,
)
from test_trace_hostile import MALFORMED, TOLERATED, _span_line
from test_trace_store_decode import _hard_values, _span

import mlaunch.trace
from mlaunch import envcontract
from mlaunch.trace import store_decode
from mlaunch.trace.reader import TraceFile, TraceInputError, TraceReader
from mlaunch.trace.store_build import _Columns, _Resources, build_store
from mlaunch.trace.store_layout import STORE_DIR, file_schema

BUILT = importlib.util.find_spec("mlaunch.trace._cscan") is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the C scanner is not built here")

_JSON_COLUMNS = ("attributes", "links", "events", "extra")
_MODES = ("c", "pyarrow", "reader")


def _rows(table: Any) -> dict[str, list[Any]]:
    """A table's columns as lists, the JSON-text ones decoded (their spelling is free)."""
    cols = table.to_pydict()
    for c in _JSON_COLUMNS:
        cols[c] = [None if x is None else orjson.loads(x) for x in cols[c]]
    return cols


def _store(run: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Everything a store of a copy of ``run`` holds, built the ``mode`` way; and how many
    chunks the C scanner took."""
    copy = run.parent / f"{run.name}-{mode}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy)
    taken = []
    real = store_decode.scan
    with monkeypatch.context() as m:
        m.setattr(store_decode, "scan", lambda *a: taken.append(r := real(*a)) or r)
        if mode != "c":
            m.setenv(envcontract.PURE_PYTHON_STORE, "1")
        else:
            m.delenv(envcontract.PURE_PYTHON_STORE, raising=False)
        man = build_store(copy, TraceReader.open(copy), columnar=mode != "reader")
    parts = [(rel.split("/")[1], _rows(pq.read_table(copy / STORE_DIR / rel))) for rel in man.parts]
    res = pq.read_table(copy / STORE_DIR / "resources.parquet").to_pylist()
    man.read["torn_lines"] = [[Path(p).relative_to(copy), n] for p, n in man.read["torn_lines"]]
    return {"parts": parts, "resources": res, "read": man.read, "complete": man.complete,
            "taken": sum(r is not None for r in taken)}  # fmt: skip


def _same_stores(run: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Asserts the three builds of ``run`` write the same store; the chunks C took."""
    stores = {mode: _store(run, mode, monkeypatch) for mode in _MODES}
    taken = stores["c"].pop("taken")
    assert stores["pyarrow"].pop("taken") == stores["reader"].pop("taken") == 0
    assert stores["c"] == stores["pyarrow"], run.name
    assert stores["c"] == stores["reader"], run.name
    return taken


def test_the_c_store_equals_the_pyarrow_and_the_readers_on_synthetic_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hand = hand_example()[0].write_run_dir(tmp_path / "hand")
    legacy = hand_example(legacy=True, job=(0, 500))[0].write_run_dir(tmp_path / "legacy")
    real = tmp_path / "real"
    write_realistic_run(real, steps=30, seed=1, batch=37)
    real2 = tmp_path / "real2"
    write_realistic_run(real2, ranks=2, steps=12, pp=1, microbatches=2, layers=2, batch=7, seed=3)
    for run in (hand, legacy, real, real2):
        assert _same_stores(run, monkeypatch) > 0, run.name  # not vacuous: C read the chunks


def test_many_chunks_and_parts_give_the_same_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace read in dozens of chunks (64 KiB of lines each) is the same store by every path:
    the C columns of one chunk never leak into the next, and the resources and entries stay
    aligned across chunks."""
    from mlaunch.trace import store_build

    run = tmp_path / "many"
    write_realistic_run(run, ranks=4, steps=40, seed=4, batch=29)
    monkeypatch.setattr(store_build, "CHUNK_BYTES", 64 << 10)
    assert _same_stores(run, monkeypatch) >= 40, "the run was not read in many chunks"


def test_the_c_text_columns_are_the_pyarrow_paths_text_for_compact_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slices of compact lines written in the proto's order: the very text the pyarrow path
    composes (the store's bytes do not depend on which path built it)."""
    real = tmp_path / "real"
    write_realistic_run(real, ranks=1, steps=6, seed=2, batch=50)
    data = (real / "telemetry" / "traces-rank0.jsonl").read_bytes()
    lines = data.count(b"\n")
    tables = {}
    for mode in ("c", "pyarrow"):
        monkeypatch.setenv(envcontract.PURE_PYTHON_STORE, "" if mode == "c" else "1")
        chunk = store_decode.parse(data, lines)
        assert chunk is not None and (chunk.columns is not None) is (mode == "c")
        k = len(chunk.resources)
        tables[mode] = store_decode.span_table(chunk, list(range(k)), ["n"] * k, file_schema())
    tables["c"].validate(full=True)
    assert tables["c"].equals(tables["pyarrow"])


def test_hard_values_and_hostile_spans_give_the_readers_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """store_decode's hard values (escapes, unicode, doubles, events, links, statuses, an end
    before its start), whitespace between tokens, spans the pyarrow path refuses, and the spans
    the hostile tests tolerate."""
    run = tmp_path / "run"
    tel = run / "telemetry"
    tel.mkdir(parents=True)
    res0 = resource_attributes(0, world_size=3)
    hard = _hard_values()
    # ", " and ": " between tokens (the line's start compact: the builder hands C only those)
    spaced = json.dumps(json.loads(request_line(res0, hard))).replace(
        '{"resourceSpans": [', store_decode.LINE_START.decode(), 1
    )
    emoji = _span("e", "0f" * 8, 5, 6, attributes=encode_attributes({"s": "🚀 ok", "z": 0.0}))
    # what the pyarrow path leaves to the reader and C takes: an escaped control character, a
    # status message pyarrow infers as a timestamp
    control = _span("c", "08" * 8, 1, 2, attributes=encode_attributes({"s": "bell\x07"}))
    dated = _span("d", "0d" * 8, 1, 2, status={"message": "2024-01-01", "code": 2})
    lines0 = [request_line(res0, hard[:3]), spaced,
              request_line(res0, hard[3:] + [emoji, control, dated])]  # fmt: skip
    (tel / "traces-rank0.jsonl").write_text("\n".join(lines0) + "\n")
    assert _same_stores(run, monkeypatch) == 1
    for name, mutate in TOLERATED.items():
        (tel / "traces-rank1.jsonl").write_text(_span_line(mutate) + "\n")
        _same_stores(run, monkeypatch)  # C may refuse (a string status...): the store is the same
        (tel / "traces-rank1.jsonl").unlink()
        assert name


def test_a_malformed_span_is_named_by_the_readers_message(tmp_path: Path) -> None:
    """C refuses every span the reader refuses: the reader then names it, file and line."""
    run = tmp_path / "run"
    (run / "telemetry").mkdir(parents=True)
    path = run / "telemetry" / "traces-rank0.jsonl"
    for name, mutate in MALFORMED.items():
        data = (_span_line(mutate) + "\n").encode()
        assert store_decode.scan(data, 1) is None, name
        path.write_bytes(data)
        with pytest.raises(TraceInputError) as e:
            build_store(run, TraceReader.open(run))
        assert f"{path}:1: malformed span" in e.value.render(), name
        assert not (run / STORE_DIR).exists()


def _line(**span: Any) -> bytes:
    s = _span("megatron.iteration", "01" * 8, 10, 20)
    s.update(span)
    return request_line(resource_attributes(0, world_size=1), [s]).encode()


#: Lines C must refuse (the pyarrow path or the reader then reads them, with their rules).
REFUSED: dict[str, bytes] = {
    "escape-in-name": _line(name="a\\u0062"),
    "escape-in-id": _line(spanId="0\\n"),
    "int-value-a-number": _line(attributes=[{"key": "k", "value": {"intValue": 5}}]),
    "unknown-span-key": _line(sampled=True),
    "unknown-value-kind": _line(attributes=encode_attributes({"xs": [1, 2]})),
    "null-member": _line(traceState=None),
    "two-value-kinds": _line(attributes=[{"key": "k", "value": {"boolValue": True,
                                                                  "intValue": "1"}}]),
    "iteration-not-an-integer": _line(attributes=[{"key": "megatron.iteration",
                                                   "value": {"intValue": "3.5"}}]),
    "iteration-out-of-range": _line(attributes=[{"key": "megatron.iteration",
                                                 "value": {"doubleValue": 1e19}}]),
    "time-a-number": _line(startTimeUnixNano=10),
    "time-out-of-range": _line(endTimeUnixNano=str(2**63)),
    "kind-a-string": _line(kind="SPAN_KIND_SERVER"),
    "status-code-a-string": _line(status={"code": "STATUS_CODE_ERROR"}),
    "event-without-time": _line(events=[{"name": "x"}]),
    "no-name": _line(name=None).replace(b'"name":null,', b""),
}  # fmt: skip
_BASE = _line()
REFUSED.update({
    "not-utf8": _BASE.replace(b"megatron.", b"megatron\xff.", 1),
    "overlong-utf8": _BASE.replace(b"megatron.", b"megatron\xc0\xae", 1),
    "lone-surrogate": _BASE.replace(b"megatron.", b"megatron\\ud800.", 1),
    "raw-control-character": _BASE.replace(b"megatron.", b"megatron\x07.", 1),
    "two-objects-on-a-line": _BASE + b"{}",
    "torn": _BASE[:-7],
    "a-key-twice": _BASE.replace(b'"kind":1', b'"kind":1,"kind":2', 1),
    "leading-zero": _BASE.replace(b'"kind":1', b'"kind":01', 1),
    "infinite-double": _line(attributes=[{"key": "d", "value": {"doubleValue": 1.5}}]).replace(
        b"1.5", b"1e400"
    ),
    "nan": _line(attributes=[{"key": "d", "value": {"doubleValue": 1.5}}]).replace(b"1.5", b"NaN"),
    "beside-resourceSpans": _BASE[:-1] + b',"other":1}',
    "trailing-comma": _BASE.replace(b'"status":{}}', b'"status":{},}', 1),
    "trailing-comma-in-a-list": _BASE.replace(b'{}}]', b'{}},]', 1),
})  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_what_c_does_not_take_exactly_is_refused(case: str) -> None:
    data = REFUSED[case] + b"\n"
    assert store_decode.scan(data, 1) is None
    assert store_decode.scan(_BASE + b"\n", 1) is not None  # the line it was made from is taken


def test_a_chunk_is_refused_whole_and_its_line_count_checked() -> None:
    good = _BASE + b"\n"
    assert store_decode.scan(good * 3, 3) is not None
    assert store_decode.scan(good + REFUSED["unknown-span-key"] + b"\n" + good, 3) is None
    assert store_decode.scan(good * 3, 2) is None
    assert store_decode.scan(good * 3, 4) is None
    assert store_decode.scan(good[:-1], 1) is None  # no newline: a torn last line


def _reference(data: bytes) -> tuple[Any, list[Any]] | None:
    """What the reader's own decoding of ``data`` gives the store (None where it refuses a
    line): the span table and the resources' rows."""
    reader = TraceReader([TraceFile(Path("telemetry/otel-traces.jsonl"), None)])
    tf = reader.files[0]
    cols, resources = _Columns(), _Resources()
    try:
        # (numbered from 2: a first line that is no JSON makes the reader look at the file)
        for no, raw in enumerate(data.split(b"\n")[:-1], 2):
            reader.line_no = no
            raw += b"\n"
            for res, spans, flagged in reader.decode_line(tf, raw):
                rid = resources.id_of(res)
                cols.add(rid, resources.rows["node"][rid], spans, flagged)
    except (TraceInputError, OverflowError, pa.ArrowInvalid):
        return None
    return cols.table(), resources.table().to_pylist()


def _decoded(data: bytes, lines: int, mode: str) -> tuple[Any, list[Any]] | None:
    """What ``mode`` ("c" or "pyarrow") gives the store for the chunk, as the builder uses it."""
    chunk = (store_decode.scan(data, lines) if mode == "c" else
             store_decode.parse(data, lines))  # fmt: skip
    if chunk is None:
        return None
    reader = TraceReader([TraceFile(Path("telemetry/otel-traces.jsonl"), None)])
    resources = _Resources()
    seen: dict[str | None, Any] = {}
    rids = []
    for text, n in zip(chunk.resources, chunk.span_counts, strict=True):
        r = seen.get(text)
        if r is None:
            attrs = None if text is None else orjson.loads(text)
            try:
                r = seen[text] = reader.resource(attrs, reader.files[0])
            except ValueError:  # a rank that is no integer: the builder leaves it to the reader
                return None
        rids.append(resources.id_of(r) if n else -1)
    nodes = [resources.rows["node"][i] if i >= 0 else None for i in rids]
    table = store_decode.span_table(chunk, rids, nodes, file_schema())
    if table is None:
        return None
    table.validate(full=True)
    return table, resources.table().to_pylist()


#: What a mutation writes: JSON's structure, what strings and numbers hold, and hostile bytes.
_ALPHABET = [*b'{}[]:,"\\ 0123456789-+.eEtrufalsn', *b"abkz/", 0, 7, 10, 13, 0x7F, 0x80, 0xC3,
             0xE2, 0xED, 0xF0, 0xFF]  # fmt: skip


def _mutate(rng: random.Random, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(6)
        i = rng.randrange(len(b) + 1)
        if op == 0 and i < len(b):
            b[i] = rng.choice(_ALPHABET)
        elif op == 1:
            b.insert(i, rng.choice(_ALPHABET))
        elif op == 2 and i < len(b):
            del b[i]
        elif op == 3:
            del b[i:]  # torn
        elif op == 4:
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[min(i, j) : max(i, j)][:64]  # a piece repeated
        elif op == 5 and i < len(b):
            # a digit in a time or an id changed: still valid JSON, another value
            digits = [k for k in range(len(b)) if 48 <= b[k] <= 57]
            if digits:
                k = rng.choice(digits)
                b[k] = 48 + (b[k] - 48 + 1 + rng.randrange(9)) % 10
    return bytes(b)


def test_mutated_and_torn_lines_are_refused_or_read_as_the_reader_reads_them() -> None:
    """Thousands of lines mutated at random (fixed seed): C refuses each or gives the table
    (and resources) the reader's own decoding gives, and the pyarrow path's where that takes it;
    it never takes what the reader refuses, and never crashes."""
    res = resource_attributes(0, world_size=2)
    hard = _hard_values()
    spaced = json.dumps(json.loads(request_line(res, hard[:2])))
    bases = [request_line(res, hard[:3]), request_line(res, hard[3:]), spaced,
             request_line({"service.instance.id": "p1"}, [_span("x", "0a" * 8, 1, 2)]),
             request_line(res, [_span("megatron.forward", "0b" * 8, 3, 9, attributes=[
                 {"key": "megatron.iteration", "value": {"intValue": "12"}},
                 {"key": "megatron.microbatch_id", "value": {"doubleValue": 2.75}},
                 {"key": "mlaunch.span.truncated", "value": {"stringValue": "y"}}])])]  # fmt: skip
    bases = [b.encode() for b in bases]
    rng = random.Random(20251202)
    outcomes = {"refused": 0, "taken": 0, "pyarrow_too": 0}
    for _case in range(3000):
        picked = rng.sample(bases, rng.choice((1, 1, 2)))
        lines = [_mutate(rng, p) if rng.random() < 0.9 else p for p in picked]
        data = b"".join(x + b"\n" for x in lines)
        n = data.count(b"\n")
        got = _decoded(data, n, "c")
        if got is None:
            outcomes["refused"] += 1
            continue
        outcomes["taken"] += 1
        ref = _reference(data)
        assert ref is not None, data  # C took a line the reader refuses
        assert _rows(got[0]) == _rows(ref[0]) and got[1] == ref[1], data
        pa_got = _decoded(data, n, "pyarrow")
        if pa_got is not None:
            outcomes["pyarrow_too"] += 1
            assert _rows(got[0]) == _rows(pa_got[0]) and got[1] == pa_got[1], data
    # not vacuous: both outcomes, many times
    assert min(outcomes.values()) > 300, outcomes


def test_the_switch_and_a_missing_extension_fall_back_to_pyarrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    write_realistic_run(run, ranks=1, steps=3, pp=1, batch=9)
    monkeypatch.setenv(envcontract.PURE_PYTHON_STORE, "1")
    assert store_decode.c_scanner() is None
    monkeypatch.delenv(envcontract.PURE_PYTHON_STORE)
    assert store_decode.c_scanner() is not None
    off = _store(run, "pyarrow", monkeypatch)
    assert off.pop("taken") == 0
    # not built: the import fails, the pyarrow path reads every chunk
    monkeypatch.setitem(sys.modules, "mlaunch.trace._cscan", None)
    monkeypatch.delattr(mlaunch.trace, "_cscan")
    monkeypatch.setattr(store_decode, "_CSCAN", None)
    assert store_decode.c_scanner() is None
    missing = _store(run, "c", monkeypatch)
    assert missing.pop("taken") == 0 and missing == off
    monkeypatch.undo()
    monkeypatch.setattr(store_decode, "_CSCAN", None)
    on = _store(run, "c", monkeypatch)
    assert on.pop("taken") > 0 and on == off


@pytest.mark.parametrize("mode", ["c", "pyarrow"])
def test_a_rank_that_is_no_integer_is_named_by_the_readers_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Both column-wise paths take the resource's text as it is; the reader's rank rule then
    fails on it, and the chunk goes to the reader, which names the line (no traceback)."""
    if mode == "pyarrow":
        monkeypatch.setenv(envcontract.PURE_PYTHON_STORE, "1")
    run = tmp_path / "run"
    (run / "telemetry").mkdir(parents=True)
    path = run / "telemetry" / "traces-rank0.jsonl"
    res = {**resource_attributes(0, world_size=1), "dl.rank": "zero"}
    line = request_line(res, [_span("megatron.iteration", "01" * 8, 10, 20)])
    path.write_text(line.replace('{"stringValue":"zero"}', '{"intValue":"zero"}') + "\n")
    with pytest.raises(TraceInputError) as e:
        build_store(run, TraceReader.open(run))
    assert f"{path}:1: malformed OTLP/JSON structure (ValueError" in e.value.render()
