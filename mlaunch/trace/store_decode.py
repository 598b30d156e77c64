"""The span store's column-wise decoder: OTLP-JSON lines straight into the store's columns.

Building the store through the JSON reader makes a Python dict per span (orjson), then walks
each span in Python to fill the columns: about 5x the bare decode (benchmarks/trace_read.py).
Here pyarrow's JSON parser (C++) reads a chunk of lines against the schema of the OTLP span (the
members most spans have explicit, the rare ones inferred, then checked against the schema), and
Arrow compute derives every column of :data:`mlaunch.trace.store.SPAN_SCHEMA` from the
parsed arrays, the JSON-text columns (``attributes``, ``links``, ``events``, ``extra``) included:
no Python object per span.

The JSON reader stays the reference. A chunk this decoder cannot take exactly is refused
(:func:`parse` returns None) and its lines go through the reader, which accepts or refuses them
with its own message: a key outside the schema (``instrumentationLibrarySpans``, an
``arrayValue``...), a value of another JSON type (an ``intValue`` written as a number, a rare
member's string that pyarrow infers as a timestamp: a status message "2024-01-01"), invalid
JSON, a line holding two objects, a null where the reader needs a value, a control character
in a string. What it takes, it writes as the reader's path would, value for value: the JSON
text of a column may differ in key order or number spelling (``1e+20`` for ``1e20``), never in
what it decodes to; an explicit ``null`` member is read as an absent one.

The one OTLP-JSON decoder of the store (issue 41 measured the candidates: ``python
benchmarks/trace_read.py --spans 1000000 --decoders``). First read (the build and the summary,
whole processes, 10^6 spans on a shared 2-core machine): 0.88-1.24x the CPU of the bare orjson
decode (goal <= 1.5x), where the reader's orjson decode feeding Arrow columns costs 3.0-3.6x and
DuckDB's ``read_ndjson`` (an explicit schema of the OTLP structure, unnested) 10-16x for the
decode alone; a hand-written C scanner (0.6-0.7x) was dropped as pyarrow meets the goal without
parsing untrusted input in C. At 2x10^5 spans the interpreter's and the libraries' import is a
larger share of the process.

Standalone like the reader: pyarrow and numpy only (both come with the store).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlaunch.model.spans import SPANS, TRUNCATED_ATTRS, Attr
from mlaunch.otlp.otlp_json import any_value

#: Where every line this decoder takes starts (what every OTLP-JSON trace writer writes first).
LINE_START = b'{"resourceSpans":['
#: Raw bytes of lines parsed in one pyarrow call: big enough that the per-call cost vanishes,
#: small enough that the parsed arrays of a chunk stay a few tens of MB.
CHUNK_BYTES = 16 << 20

#: A span name -> its group in the catalogue (the store's ``group`` column).
GROUPS: dict[str, str] = {name: str(d.group) for name, d in SPANS.items()}
#: The attributes the ``iteration`` and ``microbatch`` columns come from, first found first.
ITER_KEYS = (str(Attr.ITERATION), str(Attr.EVAL_ITERATION))
MB_KEYS = (str(Attr.MICROBATCH_ID), str(Attr.DL_MICROBATCH_ID))
#: Span keys that go to the ``extra`` column (every key of the schema without a column of its own).
_EXTRA_KEYS = ("traceState", "flags", "kind", "droppedAttributesCount", "droppedEventsCount",
               "droppedLinksCount", "status")  # fmt: skip

_SCHEMA: Any = None
_VALUE: Any = None  # the AnyValue struct type of the schema
_PARSE_SCHEMA: Any = None


def json_schema() -> Any:
    """The explicit schema pyarrow parses a request line against: the OTLP-JSON trace request with
    the scalar attribute values. Members are in the proto's order, as the writers put them."""
    global _SCHEMA, _VALUE
    if _SCHEMA is None:
        import pyarrow as pa

        s, i64 = pa.string(), pa.int64()
        value = pa.struct([("stringValue", s), ("boolValue", pa.bool_()), ("intValue", s),
                           ("doubleValue", pa.float64())])  # fmt: skip
        _VALUE = value
        kvs = pa.list_(pa.struct([("key", s), ("value", value)]))
        event = pa.struct([("timeUnixNano", s), ("name", s), ("attributes", kvs),
                           ("droppedAttributesCount", i64)])  # fmt: skip
        link = pa.struct([("traceId", s), ("spanId", s), ("traceState", s), ("attributes", kvs),
                          ("droppedAttributesCount", i64), ("flags", i64)])  # fmt: skip
        span = pa.struct([
            ("traceId", s), ("spanId", s), ("traceState", s), ("parentSpanId", s),
            ("flags", i64), ("name", s), ("kind", i64), ("startTimeUnixNano", s),
            ("endTimeUnixNano", s), ("attributes", kvs), ("droppedAttributesCount", i64),
            ("events", pa.list_(event)), ("droppedEventsCount", i64), ("links", pa.list_(link)),
            ("droppedLinksCount", i64), ("status", pa.struct([("message", s), ("code", i64)])),
        ])  # fmt: skip
        scope = pa.struct([("name", s), ("version", s), ("attributes", kvs),
                           ("droppedAttributesCount", i64)])  # fmt: skip
        scope_spans = pa.struct([("scope", scope), ("spans", pa.list_(span)), ("schemaUrl", s)])
        resource = pa.struct([("attributes", kvs), ("droppedAttributesCount", i64)])
        resource_spans = pa.struct(
            [("resource", resource), ("scopeSpans", pa.list_(scope_spans)), ("schemaUrl", s)]
        )
        _SCHEMA = pa.schema([("resourceSpans", pa.list_(resource_spans))])
    return _SCHEMA


class _Refused(Exception):
    """The chunk holds something this decoder does not take exactly: the reader reads it."""


def parse_schema() -> Any:
    """The schema pyarrow is given: :func:`json_schema` less the members of a span (and of its
    children) that most spans lack. pyarrow fills every member of an explicit schema that a
    row lacks with a null, and for the span's rare members (events, links, the dropped counts,
    traceState, flags) that costs about a fifth of its parse; a member not given is inferred
    from what the chunk holds, and :func:`_conform` then checks it against :func:`json_schema`.
    The members of the resource and scope stay explicit: they come once a line, so cost nothing,
    and an inferred string can come back as a timestamp (an ISO date in an attribute value)."""
    global _PARSE_SCHEMA
    if _PARSE_SCHEMA is None:
        import pyarrow as pa

        def keep(t: Any, names: tuple[str, ...]) -> Any:
            return pa.struct([f for f in t if f.name in names])

        full = json_schema().field(0).type.value_type  # a resourceSpans entry
        scope_spans = full.field("scopeSpans").type.value_type
        span = keep(scope_spans.field("spans").type.value_type,
                    ("traceId", "spanId", "parentSpanId", "name", "kind", "startTimeUnixNano",
                     "endTimeUnixNano", "attributes"))  # fmt: skip
        scope_spans = pa.struct([f if f.name != "spans" else pa.field("spans", pa.list_(span))
                                 for f in scope_spans])  # fmt: skip
        entry = pa.struct([f if f.name != "scopeSpans" else
                           pa.field("scopeSpans", pa.list_(scope_spans)) for f in full])  # fmt: skip
        _PARSE_SCHEMA = pa.schema([("resourceSpans", pa.list_(entry))])
    return _PARSE_SCHEMA


def _conform(a: Any, t: Any) -> Any:
    """The parsed array ``a`` as type ``t`` (of :func:`json_schema`): members it lacks added as
    nulls, a member all null (pyarrow infers the type null) typed; refused where ``a`` holds a
    member ``t`` has not, or a value of another type (what the explicit schema refuses)."""
    import pyarrow as pa

    if a.type == t:
        return a
    if pa.types.is_null(a.type):
        return pa.nulls(len(a), t)
    mask = a.is_null() if a.null_count else None
    if pa.types.is_struct(t) and pa.types.is_struct(a.type):
        have = {f.name: i for i, f in enumerate(a.type)}
        if any(n not in t.names for n in have):
            raise _Refused  # a key outside the schema
        kids = [_conform(a.field(have[f.name]), f.type) if f.name in have
                else pa.nulls(len(a), f.type) for f in t]  # fmt: skip
        return pa.StructArray.from_arrays(kids, fields=list(t), mask=mask)
    if pa.types.is_list(t) and pa.types.is_list(a.type):
        return pa.ListArray.from_arrays(a.offsets, _conform(a.values, t.value_type), t, mask=mask)
    raise _Refused  # another type: a number for a string, a timestamp inferred from a string...


@dataclass
class Chunk:
    """A parsed chunk of request lines."""

    #: Per ``resourceSpans`` entry, in order: its ``resource`` as OTLP-JSON text (None when absent).
    resources: list[str | None]
    #: Per entry: how many spans it holds.
    span_counts: Any  # numpy int64
    #: Per span: the index of its entry.
    span_entry: Any  # numpy int64
    spans: Any  # pyarrow StructArray, one row a span
    escaped: bool  # the raw lines hold a backslash: strings are escaped when written back


def parse(data: bytes, lines: int) -> Chunk | None:
    """``lines`` complete request lines (``data``, each starting with :data:`LINE_START`) parsed,
    or None when the reader must read them (see the module docstring)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    if not data.isascii():  # (a check that costs about nothing for the usual ASCII lines)
        try:
            data.decode("utf-8")  # pyarrow keeps bytes that are no UTF-8; the reader refuses them
        except UnicodeDecodeError:
            return None
    try:
        table = pj.read_json(
            pa.BufferReader(data),
            read_options=pj.ReadOptions(use_threads=False, block_size=max(len(data) + 1, 1 << 20)),
            parse_options=pj.ParseOptions(explicit_schema=parse_schema(),
                                          unexpected_field_behavior="infer"),
        )  # fmt: skip
        if table.num_rows != lines or table.num_columns != 1:
            return None  # two objects on one line, or a key beside resourceSpans: the reader's
        per_line = _conform(table.column(0).combine_chunks(), json_schema().field(0).type)
        entries = _flat(per_line)
        scopes_of = entries.field("scopeSpans")
        scopes = _flat(scopes_of)
        spans_of = scopes.field("spans")
        spans = _flat(spans_of)
        escaped = b"\\" in data
        resources = _text(entries.field("resource"), escaped).to_pylist()
    except (pa.ArrowException, _Refused):  # any Arrow error: the reader reads (and names) it
        return None
    scope_entry = pc.list_parent_indices(scopes_of).to_numpy()
    span_entry = scope_entry[pc.list_parent_indices(spans_of).to_numpy()]
    counts = np.bincount(span_entry, minlength=len(entries))
    return Chunk(resources, counts, span_entry, spans, escaped)


def _flat(lists: Any) -> Any:
    """The entries of a list array (the reader refuses a null list entry: not an object)."""
    flat = lists.flatten()
    if flat.null_count:
        raise _Refused
    return flat


def span_table(chunk: Chunk, resource_ids: Any, nodes: list[str | None], schema: Any) -> Any:
    """The chunk's spans as a table of ``schema`` (the store's span schema less ``rank``, the
    partition key); ``resource_ids`` and ``nodes`` are per ``resourceSpans`` entry. None when a
    span is one the reader refuses (no name, a time that is no integer...): the reader then
    reads the chunk."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    sp, esc = chunk.spans, chunk.escaped
    n = len(sp)
    f = {name: sp.field(name) for name in sp.type.names}
    try:
        name = f["name"]
        if name.null_count:
            raise _Refused
        start, end = _int(f["startTimeUnixNano"]), _int(f["endTimeUnixNano"])
        end = pc.max_element_wise(start, end)  # an end before its start: an instant span
        enc = pc.dictionary_encode(name)
        groups = pa.array([GROUPS.get(x) for x in enc.dictionary.to_pylist()], pa.string())
        parent = f["parentSpanId"]
        parent = pc.if_else(pc.equal(parent, ""), pa.scalar(None, pa.string()), parent)
        code = pc.fill_null(f["status"].flatten()[1], 0)
        status = pc.if_else(pc.is_in(code, pa.array([1, 2])), code, 0).cast(pa.int8())
        attrs = f["attributes"]
        kv = attrs.flatten()
        if kv.null_count:
            raise _Refused
        kv_span = pc.list_parent_indices(attrs).to_numpy()
        events = f["events"]
        ev = events.flatten()
        if ev.null_count:
            raise _Refused
        # The reader makes an event's time an int in place: its JSON text has the number.
        ev_time = _int(ev.field("timeUnixNano"))
        ev = pa.StructArray.from_arrays(
            [ev_time, *(ev.field(k) for k in ev.type.names[1:])], names=ev.type.names
        )
        events = pa.ListArray.from_arrays(_offsets(events), ev, mask=events.is_null())
        links = f["links"]
        if links.flatten().null_count:
            raise _Refused
        extra = pa.StructArray.from_arrays([f[k] for k in _EXTRA_KEYS], names=_EXTRA_KEYS)
        extra_text = _text(extra, esc)
        cols = {
            "trace_id": f["traceId"], "span_id": f["spanId"], "parent_id": parent,
            "name": name, "group": pc.take(groups, enc.indices),
            "node": pc.take(pa.array(nodes, pa.string()), chunk.span_entry),
            "iteration": _int_attr(kv, kv_span, n, ITER_KEYS),
            "microbatch": _int_attr(kv, kv_span, n, MB_KEYS),
            "start_ns": start, "end_ns": end, "status": status,
            "truncated": _truncated(kv, kv_span, n),
            "attributes": _nonempty(attrs, esc), "links": _nonempty(links, esc),
            "events": _nonempty(events, esc),
            "extra": pc.if_else(pc.equal(extra_text, "{}"), pa.scalar(None, pa.string()),
                                extra_text),
            "resource_id": pa.array(np.asarray(resource_ids, np.int32)[chunk.span_entry]),
        }  # fmt: skip
    except (pa.ArrowException, _Refused):  # any Arrow error: the reader reads (and names) it
        return None
    return pa.Table.from_pydict(cols, schema)


def _int(a: Any) -> Any:
    """Decimal strings as int64 (the reader refuses a span without its times: so does this)."""
    import pyarrow as pa

    if a.null_count:
        raise _Refused
    return a.cast(pa.int64())


def _offsets(lists: Any) -> Any:
    import pyarrow.compute as pc

    o = lists.offsets
    return pc.subtract(o, o[0]) if o[0].as_py() else o


def _int_attr(kv: Any, kv_span: Any, n: int, keys: tuple[str, ...]) -> Any:
    """Per span: the first attribute of ``keys`` with a value, as an int (``intValue``, else a
    ``doubleValue`` truncated; None when neither): :func:`mlaunch.trace.store._int_attr`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    value = kv.field("value")
    hit = np.flatnonzero(
        pc.and_(pc.is_in(kv.field("key"), pa.array(list(keys))), value.is_valid()).to_numpy(
            zero_copy_only=False
        )
    )
    out = np.zeros(n, np.int64)
    valid = np.zeros(n, bool)
    if len(hit):
        owner = kv_span[hit]
        first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # kv_span is sorted
        hit, owner = hit[first], owner[first]
        v = value.take(pa.array(hit))
        dbl = v.field("doubleValue")
        finite = pc.fill_null(pc.is_finite(dbl), True)
        if not pc.all(finite).as_py():
            raise _Refused  # int() refuses inf and nan: the reader stores None for those
        x = pc.coalesce(v.field("intValue").cast(pa.int64()), pc.trunc(dbl).cast(pa.int64()))
        ok = x.is_valid().to_numpy(zero_copy_only=False)
        out[owner[ok]] = x.filter(x.is_valid()).to_numpy()
        valid[owner[ok]] = True
    return pa.array(out, mask=~valid)


def _truncated(kv: Any, kv_span: Any, n: int) -> Any:
    """Per span: a truncation attribute with a true value (:func:`~mlaunch.trace.reader.
    is_truncated`). Rare: the few candidates are decoded in Python by the reader's own rule."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    out = np.zeros(n, bool)
    hit = np.flatnonzero(
        pc.is_in(kv.field("key"), pa.array(sorted(TRUNCATED_ATTRS))).to_numpy(zero_copy_only=False)
    )
    if len(hit):
        values = kv.field("value").take(pa.array(hit)).to_pylist()
        for i, v in zip(hit, values, strict=True):
            if v is not None and any_value({k: x for k, x in v.items() if x is not None}):
                out[kv_span[i]] = True
    return pa.array(out)


#: Rows from which an object column is written per distinct value (below, directly).
_MEMO_ROWS = 4096


def _hashable(t: Any) -> bool:
    """Whether :func:`_distinct` takes a struct of type ``t``: scalars, or structs of them (a
    list member, as a resource's or a link's attributes, has no hash kernel)."""
    import pyarrow as pa

    return all(_hashable(f.type) if pa.types.is_struct(f.type) else not pa.types.is_nested(f.type)
               for f in t)  # fmt: skip


def _distinct(a: Any) -> tuple[Any, Any]:
    """Per row of the struct array ``a`` (of scalar members, or structs of them): the index of
    its distinct value; and the first row of each distinct value. Each member is hashed
    (dictionary-encoded, null a value of its own) and its codes folded into the row's code; a
    member of one value (all null, say) adds nothing, and the codes are made dense again only
    when their product nears int64's range (a hash pass each: the cost of this)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    def leaves(x: Any) -> list[Any]:
        if pa.types.is_struct(x.type):
            valid = [x.is_valid()] if x.null_count else []
            return valid + [leaf for c in x.flatten() for leaf in leaves(c)]
        return [x]

    def dense(codes: Any) -> tuple[Any, int]:
        enc = pc.dictionary_encode(pa.array(codes))
        return enc.indices.to_numpy().astype(np.int64), len(enc.dictionary)

    n = len(a)
    codes, size = np.zeros(n, np.int64), 1
    for leaf in leaves(a):
        if leaf.null_count == n:
            continue
        enc = pc.dictionary_encode(leaf, null_encoding="encode")
        m = len(enc.dictionary)
        if m <= 1:
            continue
        if size * m >= 1 << 62:
            codes, size = dense(codes)
        codes = codes * m + enc.indices.to_numpy().astype(np.int64)
        size *= m
    if size <= 4 * n:  # dense by a lookup table: cheaper than a hash pass
        seen = np.zeros(size, bool)
        seen[codes] = True
        remap = np.cumsum(seen) - 1
        codes, k = remap[codes], int(remap[-1]) + 1
    else:
        codes, k = dense(codes)
    first = np.empty(k, np.int64)
    rows = np.arange(n, dtype=np.int64)
    first[codes[::-1]] = rows[::-1]  # repeated indices: the last write, the first row, wins
    return codes, first


def _distinct_lists(a: Any) -> tuple[Any, Any] | None:
    """:func:`_distinct` for a list array of structs (the attributes): each list's key is the
    bytes of its entries' codes, hashed once. None when the lists are mostly distinct."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    values = a.flatten()
    if len(values) < _MEMO_ROWS or not _hashable(values.type):
        return None
    codes, first = _distinct(values)
    if len(first) * 4 > len(values):
        return None
    offsets = _offsets(a).to_numpy().astype(np.int64) * 4
    if offsets[-1] >= 1 << 31:
        return None
    keys = pa.Array.from_buffers(pa.binary(), len(a), [
        None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(codes.astype(np.int32)),
    ])  # fmt: skip
    if a.null_count:  # a null list: a key of its own, not the empty list's
        keys = pc.if_else(a.is_valid(), keys, pa.scalar(None, pa.binary()))
    enc = pc.dictionary_encode(keys, null_encoding="encode")
    k = len(enc.dictionary)
    if k * 4 > len(a):
        return None
    lcodes = enc.indices.to_numpy().astype(np.int64)
    lfirst = np.empty(k, np.int64)
    rows = np.arange(len(a), dtype=np.int64)
    lfirst[lcodes[::-1]] = rows[::-1]
    return pa.array(lcodes), pa.array(lfirst)


def _nonempty(lists: Any, escaped: bool) -> Any:
    """A list column as JSON text; None where the list is absent or empty (as the reader's
    columns have it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if lists.null_count == len(lists):  # a member no span of the chunk has (events, links...)
        return pa.nulls(len(lists), pa.string())
    return pc.if_else(
        pc.greater(pc.list_value_length(lists), 0), _text(lists, escaped),
        pa.scalar(None, pa.string()),
    )  # fmt: skip


def _text(a: Any, escaped: bool, pre: str = "", post: str = "", *, memo: bool = True) -> Any:
    """Each value of ``a`` as JSON text between ``pre`` and ``post`` (null where it is null):
    strings quoted, numbers as decimal (a double keeps a fraction or exponent, so it decodes back
    to a float), objects with their members that are not null, lists with their elements. Each
    level is one or two passes of a string kernel: the cost is the columns', not the spans'. An
    object column of few distinct values (the attribute entries, ``extra``) is written once per
    distinct value and copied: hashing its members is cheaper than building its text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = a.type
    if not len(a):
        return pa.array([], pa.string())
    if pa.types.is_string(t):
        if escaped:
            if pc.any(pc.match_substring_regex(a, "[\\x00-\\x1f]")).as_py():
                raise _Refused  # control characters need \\u escapes: rare, the reader does it
            a = pc.replace_substring(pc.replace_substring(a, "\\", "\\\\"), '"', '\\"')
        return pc.binary_join_element_wise(pre + '"', a, '"' + post, "")
    if pa.types.is_integer(t):
        return pc.binary_join_element_wise(pre, a.cast(pa.string()), post, "")
    if pa.types.is_floating(t):
        if not pc.all(pc.fill_null(pc.is_finite(a), True)).as_py():
            raise _Refused  # no JSON number for inf and nan
        s = a.cast(pa.string())
        return pc.if_else(pc.match_substring_regex(s, "[.e]"),
                          pc.binary_join_element_wise(pre, s, post, ""),
                          pc.binary_join_element_wise(pre, s, ".0" + post, ""))  # fmt: skip
    if pa.types.is_boolean(t):
        return pc.if_else(a, pre + "true" + post, pre + "false" + post)
    if pa.types.is_struct(t):
        if memo and len(a) >= _MEMO_ROWS and _hashable(t):
            codes, first = _distinct(a)
            if len(first) * 4 <= len(a):  # text for each distinct value once, then copies
                return _text(a.take(pa.array(first)), escaped, pre, post, memo=False).take(
                    pa.array(codes)
                )
        children = [(n, c) for n, c in zip(t.names, a.flatten(), strict=True)
                    if c.null_count < len(c)]  # fmt: skip
        if t == _VALUE:  # a oneof: one member at most, so no separators to place
            valid = [c.is_valid() for _, c in children]
            for i, v in enumerate(valid):
                for w in valid[i + 1 :]:
                    if pc.any(pc.and_(v, w)).as_py():
                        raise _Refused  # two kinds in one AnyValue: the reader keeps both
            members = [_text(c, escaped, f'"{n}":') for n, c in children]
            body = pc.coalesce(*members, "") if members else pa.array([""] * len(a), pa.string())
        elif all(not c.null_count for _, c in children):
            members = [_text(c, escaped, f'"{n}":') for n, c in children]
            body = (pc.binary_join_element_wise(*members, ",") if members
                    else pa.array([""] * len(a), pa.string()))  # fmt: skip
        else:
            # Each member that is not null with a comma after it, the last comma trimmed (no JSON
            # value ends with one). Not null_handling="skip": pyarrow 26 drops the rows where
            # every member is null.
            members = [pc.fill_null(_text(c, escaped, f'"{n}":', ","), "") for n, c in children]
            body = pc.utf8_rtrim(pc.binary_join_element_wise(*members, ""), characters=",")
        text = pc.binary_join_element_wise(pre + "{", body, "}" + post, "")
        return (
            pc.if_else(a.is_valid(), text, pa.scalar(None, pa.string())) if a.null_count else text
        )
    if pa.types.is_list(t):
        if memo and len(a) >= _MEMO_ROWS and pa.types.is_struct(t.value_type):
            distinct = _distinct_lists(a)
            if distinct is not None:  # text for each distinct list once, then copies
                codes, first = distinct
                text = _text(a.take(first), escaped, pre, post, memo=False).take(codes)
                return (pc.if_else(a.is_valid(), text, pa.scalar(None, pa.string()))
                        if a.null_count else text)  # fmt: skip
        items = pa.ListArray.from_arrays(_offsets(a), _text(a.flatten(), escaped))
        text = pc.binary_join_element_wise(pre + "[", pc.binary_join(items, ","), "]" + post, "")
        return (
            pc.if_else(a.is_valid(), text, pa.scalar(None, pa.string())) if a.null_count else text
        )
    raise _Refused  # pragma: no cover - the schema has no other type
