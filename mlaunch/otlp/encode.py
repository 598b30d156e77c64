"""OTLP's encodings of a span, shared by every producer: attribute values as protobuf wire bytes
and as OTLP/JSON ``AnyValue`` objects, the wire-format primitives, and the one builder of a span's
OTLP/JSON object (:func:`span_dict`), which the runtime's encoder (:mod:`mlaunch.telemetry._encode`,
from recorded fields) and the receiver (:mod:`mlaunch.otlp.from_proto`, from protobuf messages)
both call.

OTLP/JSON as the collector's file exporter writes it: lowerCamelCase names, hex ids, 64-bit
integers as decimal strings, enums as integers, fields at their default value omitted. Protobuf
field numbers are those of ``opentelemetry/proto/{common,trace}/v1/*.proto``. Standard library only.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

#: ``SpanFlags``: the parent's remoteness is known (always set), and the parent is remote.
FLAG_HAS_IS_REMOTE = 0x100
FLAG_IS_REMOTE = 0x200
KIND_INTERNAL = 1  # Span.SpanKind.SPAN_KIND_INTERNAL; the SDK maps API kind k to k + 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

DOUBLE = struct.Struct("<d").pack
FIXED64 = struct.Struct("<Q").pack
FIXED32 = struct.Struct("<I").pack
VARINT1 = [bytes((i,)) for i in range(128)]


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (negative int64 as two's complement)."""
    if 0 <= n < 128:
        return VARINT1[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 127:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    n = len(payload)
    return tag + (VARINT1[n] if n < 128 else varint(n)) + payload


class Unencodable(ValueError):
    """An attribute value OTLP cannot carry (the SDK's encoder drops the key)."""


# ------------------------------------------------------------------------------------------------
# OTLP/JSON values


def json_double(value: float) -> Any:
    if math.isfinite(value):
        return value
    if value != value:
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def json_value(value: Any) -> dict[str, Any]:
    """An attribute value as an OTLP/JSON ``AnyValue``."""
    tv = type(value)
    if tv is str:
        return {"stringValue": value}
    if tv is bool:
        return {"boolValue": value}
    if tv is int:
        if not INT64_MIN <= value <= INT64_MAX:
            raise Unencodable(f"int {value} is out of the int64 range")
        return {"intValue": str(value)}
    if tv is float:
        return {"doubleValue": json_double(value)}
    return _json_value_slow(value)


def _json_value_slow(value: Any) -> dict[str, Any]:
    # Subclasses and containers, in the order the SDK's _encode_value checks them.
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": bool(value)}
    if isinstance(value, str):
        return {"stringValue": str(value)}
    if isinstance(value, int):
        return json_value(int(value))
    if isinstance(value, float):
        return {"doubleValue": json_double(float(value))}
    if isinstance(value, bytes):
        return (
            {"bytesValue": base64.b64encode(value).decode("ascii")} if value else {"bytesValue": ""}
        )
    if isinstance(value, Sequence):
        values = [json_value(v) for v in value]
        return {"arrayValue": {"values": values} if values else {}}
    if isinstance(value, Mapping):
        kvs = [{"key": str(k), "value": json_value(v)} for k, v in value.items()]
        return {"kvlistValue": {"values": kvs} if kvs else {}}
    raise Unencodable(f"invalid type {type(value).__name__}")


# ------------------------------------------------------------------------------------------------
# Protobuf values (AnyValue: string 1, bool 2, int 3, double 4, array 5, kvlist 6, bytes 7)


def pb_value(value: Any) -> bytes:
    """An attribute value as serialised ``AnyValue`` bytes."""
    tv = type(value)
    if tv is str:
        try:
            return delimited(b"\x0a", value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: a collector would refuse the whole batch
            raise Unencodable("a string that is not valid UTF-8") from None
    if tv is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if tv is int:
        if not INT64_MIN <= value <= INT64_MAX:
            raise Unencodable(f"int {value} is out of the int64 range")
        return b"\x18" + varint(value)
    if tv is float:
        return b"\x21" + DOUBLE(value)
    return _pb_value_slow(value)


def _pb_value_slow(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bool):
        return pb_value(bool(value))
    if isinstance(value, str):
        return pb_value(str(value))
    if isinstance(value, int):
        return pb_value(int(value))
    if isinstance(value, float):
        return pb_value(float(value))
    if isinstance(value, bytes):
        return delimited(b"\x3a", bytes(value))
    if isinstance(value, Sequence):
        return delimited(b"\x2a", b"".join(delimited(b"\x0a", pb_value(v)) for v in value))
    if isinstance(value, Mapping):
        return delimited(
            b"\x32", b"".join(delimited(b"\x0a", pb_kv(str(k), v)) for k, v in value.items())
        )
    raise Unencodable(f"invalid type {type(value).__name__}")


def pb_kv(key: str, value: Any) -> bytes:
    try:
        kb = key.encode("utf-8")
    except UnicodeEncodeError:
        raise Unencodable("a key that is not valid UTF-8") from None
    return delimited(b"\x0a", kb) + delimited(b"\x12", pb_value(value))


# ------------------------------------------------------------------------------------------------
# A span's OTLP/JSON object


def span_dict(
    trace_id: str,
    span_id: str,
    trace_state: str,
    parent_span_id: str,
    flags: int,
    name: str,
    kind: int,
    start: int,
    end: int,
    attributes: list[dict[str, Any]] | None,
    dropped_attributes: int,
    events: list[dict[str, Any]] | None,
    dropped_events: int,
    links: list[dict[str, Any]] | None,
    dropped_links: int,
    status: dict[str, Any] | None,
    flags_last: bool = False,
) -> dict[str, Any]:
    """One ``Span`` in OTLP/JSON from its fields, already in OTLP/JSON form (hex ids, "" when
    absent; times as ints, 0 when absent; encoded attributes, events and links). A falsy field is
    left out, as protobuf's printer leaves out defaults; ``status`` is left out only when None (an
    empty status is ``{}``).

    Keys follow the proto's declaration order (``flags`` after ``parentSpanId``), as the
    collector's file exporter writes them; ``flags_last`` puts ``flags`` at the end instead, in
    field-number order, which is what protobuf's ``MessageToDict`` gives (the receiver's files).
    Positional on purpose: the receiver calls this once per span it relays.
    """
    d: dict[str, Any] = {}
    if trace_id:
        d["traceId"] = trace_id
    if span_id:
        d["spanId"] = span_id
    if trace_state:
        d["traceState"] = trace_state
    if parent_span_id:
        d["parentSpanId"] = parent_span_id
    if flags and not flags_last:
        d["flags"] = flags
    if name:
        d["name"] = name
    if kind:
        d["kind"] = kind
    if start:
        d["startTimeUnixNano"] = str(start)
    if end:
        d["endTimeUnixNano"] = str(end)
    if attributes:
        d["attributes"] = attributes
    if dropped_attributes:
        d["droppedAttributesCount"] = dropped_attributes
    if events:
        d["events"] = events
    if dropped_events:
        d["droppedEventsCount"] = dropped_events
    if links:
        d["links"] = links
    if dropped_links:
        d["droppedLinksCount"] = dropped_links
    if status is not None:
        d["status"] = status
    if flags and flags_last:
        d["flags"] = flags
    return d


def event_dict(
    time: int, name: str, attributes: list[dict[str, Any]] | None, dropped_attributes: int
) -> dict[str, Any]:
    """One ``Span.Event`` in OTLP/JSON (the rules of :func:`span_dict`)."""
    d: dict[str, Any] = {}
    if time:
        d["timeUnixNano"] = str(time)
    if name:
        d["name"] = name
    if attributes:
        d["attributes"] = attributes
    if dropped_attributes:
        d["droppedAttributesCount"] = dropped_attributes
    return d
