"""The store's OTLP-JSON decoder (mlaunch/trace/store_decode.py: pyarrow's JSON parser and Arrow
compute) fuzzed against the reader's orjson decode, the reference it stands in for. Hypothesis
writes hostile lines (random byte mutations, truncations, deep nesting, huge numbers, bytes that
are no UTF-8, members of the wrong JSON type) from valid requests; for each, the decoder either
refuses the chunk (None: the reader then reads it and names what is wrong) or gives the store
exactly what the reader's decode gives, and never takes what the reader refuses. A whole build of
such a file writes the reader's store or stops with the reader's error, never anything else.
Derandomized: the same examples on every run."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.synthetic_traces import request_line, resource_attributes
from test_trace_store_decode import _hard_values, _span

from mlaunch.trace import store_decode
from mlaunch.trace.reader import TraceFile, TraceInputError, TraceReader
from mlaunch.trace.store_build import _Columns, _Resources, build_store
from mlaunch.trace.store_layout import STORE_DIR, file_schema

_JSON_COLUMNS = ("attributes", "links", "events", "extra")
#: What a mutation writes: JSON's structure, what strings and numbers hold, and hostile bytes.
_ALPHABET = [*b'{}[]:,"\\ 0123456789-+.eEtrufalsn', *b"abkz/", 0, 7, 10, 13, 0x7F, 0x80, 0xC3,
             0xE2, 0xED, 0xF0, 0xFF]  # fmt: skip


def _rows(table: Any) -> dict[str, list[Any]]:
    """A table's columns as lists, the JSON-text ones decoded (their spelling is free) with an
    explicit ``null`` member read as an absent one (the decoder's documented rule)."""
    cols = table.to_pydict()
    for c in _JSON_COLUMNS:
        cols[c] = [None if x is None else _no_nulls(orjson.loads(x)) for x in cols[c]]
    return cols


def _no_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _no_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_no_nulls(x) for x in v]
    return v


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


def _decoded(data: bytes, lines: int) -> tuple[Any, list[Any]] | None:
    """What the decoder gives the store for the chunk, as the builder uses it (None: refused)."""
    chunk = store_decode.parse(data, lines)
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


def _store(run: Path, columnar: bool) -> dict[str, Any] | str:
    """Everything a build of a copy of ``run`` writes (the decoder's, or the reader's alone),
    or the one-line error it stops with."""
    copy = run.parent / f"{run.name}-{columnar}"
    shutil.copytree(run, copy)
    try:
        man = build_store(copy, TraceReader.open(copy), columnar=columnar)
    except TraceInputError as e:
        return e.render().replace(str(copy), "RUN")
    parts = [(rel.split("/")[1], _rows(pq.read_table(copy / STORE_DIR / rel))) for rel in man.parts]
    res = pq.read_table(copy / STORE_DIR / "resources.parquet").to_pylist()
    man.read["torn_lines"] = [[Path(p).relative_to(copy), n] for p, n in man.read["torn_lines"]]
    return {"parts": parts, "resources": res, "read": man.read, "complete": man.complete}


FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,  # no flaky CI: the examples are a function of the test
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _bases() -> list[bytes]:
    """Valid request lines the decoder takes: the hard values, an iteration/microbatch/truncation span."""
    res = resource_attributes(0, world_size=2)
    hard = _hard_values()
    iteration = _span("megatron.forward", "0b" * 8, 3, 9, attributes=[
        {"key": "megatron.iteration", "value": {"intValue": "12"}},
        {"key": "megatron.microbatch_id", "value": {"doubleValue": 2.75}},
        {"key": "mlaunch.span.truncated", "value": {"stringValue": "y"}}])  # fmt: skip
    return [request_line(res, hard[:3]).encode(), request_line(res, hard[3:]).encode(),
            request_line({"service.instance.id": "p1"}, [iteration]).encode()]  # fmt: skip


BASES = _bases()


def _check(data: bytes) -> str:
    """The property, for one chunk: the decoder refuses it, or gives the reader's table and
    resources.
    Returns which (the tests check both happen)."""
    n = data.count(b"\n")
    got = _decoded(data, n)
    if got is None:
        return "refused"
    ref = _reference(data)
    assert ref is not None, data  # the decoder took a line the reader refuses
    assert _rows(got[0]) == _rows(ref[0]), data
    assert got[1] == ref[1], data
    return "taken"


def _lines(*lines: bytes) -> bytes:
    return b"".join(x + b"\n" for x in lines)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(("set", "insert", "delete", "repeat")),
        st.floats(0, 1),
        st.floats(0, 1),
        st.sampled_from(_ALPHABET),
    ),  # fmt: skip
    min_size=1,
    max_size=4,
)


def _mutated(line: bytes, ops: list[tuple[str, float, float, int]]) -> bytes:
    b = bytearray(line)
    for op, x, y, byte in ops:
        i = int(x * len(b))
        if op == "set" and i < len(b):
            b[i] = byte
        elif op == "insert":
            b.insert(i, byte)
        elif op == "delete" and i < len(b):
            del b[i]
        elif op == "repeat":
            j = int(y * len(b))
            b[i:i] = b[min(i, j) : max(i, j)][:64]
    return bytes(b)


@FUZZ
@given(base=st.sampled_from(BASES), ops=_OPS, good=st.booleans())
def test_random_byte_mutations(base: bytes, ops: list[Any], good: bool) -> None:
    # (a good line beside the mutated one: the chunk is refused or taken whole)
    _check(_lines(_mutated(base, ops), *([BASES[0]] if good else [])))


@FUZZ
@given(base=st.sampled_from(BASES), cut=st.floats(0, 1))
def test_truncations(base: bytes, cut: float) -> None:
    torn = base[: int(cut * (len(base) - 1))]  # never the whole line: no valid JSON
    if torn:
        assert _check(_lines(torn)) == "refused"
    # a chunk whose last line has no newline yet (a file being written): refused, not read short
    assert _decoded(_lines(base) + torn, 2) is None
    assert torn == b"" or _decoded(_lines(base) + torn, 1) is None


#: Where a JSON value sits in the first base line: a span member, an attribute value, a time.
_SLOTS = (b'"kind":1', b'"status":{}', b'"doubleValue":2.5', b'"intValue":"-7"',
          b'"startTimeUnixNano":"100"', b'"name":"megatron.iteration"', b'"code":2')  # fmt: skip


def _in_slot(slot: bytes, value: bytes) -> bytes:
    base = next(b for b in BASES if slot in b)
    key = slot.split(b":", 1)[0]
    return base.replace(slot, key + b":" + value, 1)


@FUZZ
@given(slot=st.sampled_from(_SLOTS), depth=st.integers(1, 20_000), kind=st.sampled_from("[{"),
       closed=st.booleans())  # fmt: skip
def test_deep_nesting(slot: bytes, depth: int, kind: str, closed: bool) -> None:
    open_, close = (b"[", b"]") if kind == "[" else (b'{"a":', b"}")
    value = open_ * depth + b"1" + (close * depth if closed else b"")
    assert _check(_lines(_in_slot(slot, value))) == "refused"


_HUGE = st.one_of(
    st.integers(-(10**40), 10**40).map(lambda i: str(i).encode()),
    st.integers(-(10**40), 10**40).map(lambda i: b'"%d"' % i),  # an integer as OTLP writes it
    st.sampled_from(
        [
            b"1e400",
            b"-1e400",
            b"1e-400",
            b"1E308",
            b"9223372036854775808",
            b'"9223372036854775808"',
            b'"-9223372036854775809"',
            b"-0",
            b"0.0e0",
            b'"1e3"',
            b'"0x10"',
            b'" 5"',
            b'"+5"',
            b"1" * 400,
            b'"' + b"9" * 400 + b'"',
            b"123456789012345678901234567890.5",
        ]
    ),  # fmt: skip
)


@FUZZ
@given(slot=st.sampled_from(_SLOTS), value=_HUGE)
def test_huge_numbers(slot: bytes, value: bytes) -> None:
    _check(_lines(_in_slot(slot, value)))


@FUZZ
@given(raw=st.binary(min_size=1, max_size=8), where=st.sampled_from((b"megatron.", b"unicode",
                                                                       b'"k=v"', b"boom")))  # fmt: skip
def test_bytes_that_are_no_utf8_or_escapes_of_them(raw: bytes, where: bytes) -> None:
    base = next(b for b in BASES if where in b)
    _check(_lines(base.replace(where, where[:2] + raw + where[2:], 1)))
    # and as \u escapes: lone and paired surrogates, controls
    esc = b"".join(b"\\u%04x" % (0xD800 + x * 7 if x % 2 else x) for x in raw)
    _check(_lines(base.replace(where, where[:2] + esc + where[2:], 1)))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),  # fmt: skip
    max_leaves=6,
)

#: JSON paths (into the request object) of the members a decoder reads.
_PATHS = (
    ("resourceSpans", 0, "resource"), ("resourceSpans", 0, "resource", "attributes"),
    ("resourceSpans", 0, "resource", "attributes", 0, "value"), ("resourceSpans", 0, "scopeSpans"),
    ("resourceSpans", 0, "scopeSpans", 0, "spans"), ("resourceSpans", 0, "scopeSpans", 0, "scope"),
    *(("resourceSpans", 0, "scopeSpans", 0, "spans", 0, k) for k in (
        "traceId", "spanId", "parentSpanId", "name", "kind", "startTimeUnixNano",
        "endTimeUnixNano", "attributes", "status", "events", "links", "flags")),
    ("resourceSpans", 0, "scopeSpans", 0, "spans", 0, "attributes", 0),
    ("resourceSpans", 0, "scopeSpans", 0, "spans", 0, "attributes", 0, "key"),
    ("resourceSpans", 0, "scopeSpans", 0, "spans", 0, "attributes", 0, "value", "intValue"),
    ("resourceSpans", 0, "scopeSpans", 0, "spans", 0, "attributes", 0, "value", "doubleValue"),
    ("resourceSpans", 0, "scopeSpans", 0, "spans", 0, "attributes", 0, "value", "stringValue"),
    ("resourceSpans", 0, "scopeSpans", 0, "spans", 0, "status", "code"),
)  # fmt: skip


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> bool:
    for k in path[:-1]:
        try:
            doc = doc[k]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(doc, list) and not (isinstance(path[-1], int) and path[-1] < len(doc)):
        return False
    if isinstance(doc, dict) and isinstance(path[-1], int):
        return False
    doc[path[-1]] = value
    return True


@FUZZ
@given(base=st.sampled_from(BASES), path=st.sampled_from(_PATHS), value=_JSON)
def test_members_of_the_wrong_type(base: bytes, path: tuple[Any, ...], value: Any) -> None:
    doc = json.loads(base)
    if not _set(doc, path, value):
        return
    line = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    _check(_lines(line))


@settings(FUZZ, max_examples=40)
@given(base=st.sampled_from(BASES), ops=_OPS)
def test_a_build_of_a_hostile_file_is_the_readers_store_or_its_error(
    base: bytes, ops: list[Any]
) -> None:
    """The whole build (the decoder, the reader behind it) against the reader alone: the same
    store, or the same one-line error naming the file and line; nothing else raised."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        (run / "telemetry").mkdir(parents=True)
        (run / "telemetry" / "traces-rank0.jsonl").write_bytes(
            _lines(BASES[1], _mutated(base, ops), BASES[2])
        )
        assert _store(run, columnar=True) == _store(run, columnar=False)
