"""Spans straight from their recorded fields to OTLP: protobuf wire bytes for gRPC / HTTP and
OTLP/JSON lines for the file and console exporters and the spool.

Why not the SDK's encoder: it needs an SDK ``ReadableSpan`` per span, builds a protobuf message
tree attribute by attribute, and the JSON form then goes through ``json_format`` and a
base64-to-hex id rewrite. That cost more CPU per fine-grained span than the training thread spent
recording it. Here:

- a span's protobuf ``Span`` message is written as wire bytes field by field (the field numbers of
  ``opentelemetry/proto/trace/v1/trace.proto``), and the request around a batch is assembled from
  bytes; the resource and the instrumentation scope, which never change, are encoded once with
  ``opentelemetry-proto``'s own messages;
- a span's OTLP/JSON object is a plain dict serialised by orjson, keys in the proto's declaration
  order as the collector's file exporter writes them: lowerCamelCase names, hex ids, 64-bit
  integers as decimal strings, enums as integers, fields at their default value omitted (built
  by :func:`mlaunch.otlp.encode.span_dict`, as the receiver's are; the plain-span fast path
  writes the same object's text directly).

Attribute values and the wire-format primitives are OTLP's own (:mod:`mlaunch.otlp.encode`); what
is here is the part that knows mlaunch's records and the SDK's span limits.

Attributes are cleaned by the SDK's rules (``BoundedAttributes``: count limit dropping the oldest,
value length limit, invalid keys dropped, invalid values converted or nulled, each with the SDK's
log line) with a fast path for the usual ``str``/``int``/``float``/``bool`` values that needs no
cleaning. A value the OTLP encoding cannot carry (an integer outside int64) is dropped from its
span, logged once, as the SDK's encoder drops it.

Inputs are mlaunch's :class:`~mlaunch.telemetry._spans.FineSpan` records (kind INTERNAL, local
parent) and SDK ``ReadableSpan`` objects (coarse spans, or spans of another provider, e.g. the
launcher's), grouped by resource and scope as the SDK's encoder groups them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from mlaunch.otlp.encode import (
    FIXED32,
    FIXED64,
    FLAG_HAS_IS_REMOTE,
    FLAG_IS_REMOTE,
    INT64_MAX,
    INT64_MIN,
    KIND_INTERNAL,
    VARINT1,
    Unencodable,
    delimited,
    event_dict,
    json_value,
    pb_kv,
    pb_value,
    span_dict,
    varint,
)
from mlaunch.telemetry._spans import FineSpan

log = logging.getLogger("mlaunch.telemetry")

_PLAIN = frozenset((str, int, float, bool))
#: Entries per attribute cache of the fast path (iteration numbers and losses keep changing; the
#: cache pays for the repeated ones: layer numbers, names, flags).
_CACHE_MAX = 8192


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode("utf-8")


class Limits:
    """The span limits the SDK applies (``SpanLimits`` from the environment, or given)."""

    __slots__ = ("attributes", "events", "links", "event_attributes", "link_attributes", "length")

    def __init__(self, sdk_limits: Any = None) -> None:
        if sdk_limits is None:
            from opentelemetry.sdk.trace import SpanLimits

            sdk_limits = SpanLimits()
        self.attributes = sdk_limits.max_span_attributes
        self.events = sdk_limits.max_events
        self.links = sdk_limits.max_links
        self.event_attributes = sdk_limits.max_event_attributes
        self.link_attributes = sdk_limits.max_link_attributes
        self.length = sdk_limits.max_span_attribute_length


def clean_attributes(
    attributes: Mapping[str, Any] | None, maxlen: int | None, max_value_len: int | None
) -> tuple[Mapping[str, Any], int]:
    """``(attributes, dropped count)`` as the SDK's ``BoundedAttributes`` would hold them."""
    if not attributes:
        return {}, 0
    if maxlen is None or len(attributes) <= maxlen:
        plain = _PLAIN
        for key, value in attributes.items():
            tv = type(value)
            if tv not in plain or type(key) is not str or not key:
                break
            if tv is str and max_value_len is not None and len(value) > max_value_len:
                break
        else:
            return attributes, 0
    from opentelemetry.attributes import BoundedAttributes

    bounded = BoundedAttributes(maxlen, attributes, immutable=False, max_value_len=max_value_len)
    return dict(bounded), bounded.dropped


# ------------------------------------------------------------------------------------------------
# A span's fields, whatever recorded it


class _View:
    """The fields of one span to encode (a FineSpan is read directly; others are copied here)."""

    __slots__ = (
        "name",
        "trace_id",
        "span_id",
        "parent_id",
        "flags",
        "kind",
        "start",
        "end",
        "attributes",
        "dropped_attributes",
        "events",
        "dropped_events",
        "links",
        "dropped_links",
        "status_code",
        "status_message",
        "trace_state",
    )


def _trace_state(ctx: Any) -> str:
    state = getattr(ctx, "trace_state", None)
    return ",".join(f"{k}={v}" for k, v in state.items()) if state else ""


def _link_fields(link: Any, limits: Limits) -> tuple[int, int, str, Mapping[str, Any], int, int]:
    """(trace id, span id, trace state, attributes, dropped attributes, flags) of a Link.

    The trace state is left empty: the SDK's encoder does not send a link's trace state."""
    ctx = link.context
    dropped = getattr(link, "dropped_attributes", 0) or 0
    attrs, more = clean_attributes(link.attributes, limits.link_attributes, limits.length)
    flags = FLAG_HAS_IS_REMOTE | (FLAG_IS_REMOTE if ctx.is_remote else 0)
    return ctx.trace_id, ctx.span_id, "", attrs, dropped + more, flags


def view(span: Any, limits: Limits) -> _View:
    """The encodable fields of a FineSpan or an SDK ``ReadableSpan``."""
    v = _View()
    v.name = span.name
    if type(span) is FineSpan:
        v.trace_id, v.span_id, v.parent_id = span.trace_id, span.span_id, span.parent_id
        v.flags = FLAG_HAS_IS_REMOTE
        v.kind = KIND_INTERNAL
        v.start, v.end = span.start, span.end
        v.attributes, v.dropped_attributes = clean_attributes(
            span.attributes, limits.attributes, limits.length
        )
        events = span.events or ()
        if limits.events is not None and len(events) > limits.events:
            v.dropped_events = len(events) - limits.events
            events = events[len(events) - limits.events :]
        else:
            v.dropped_events = 0
        v.events = [
            (ts, name, *clean_attributes(attrs, limits.event_attributes, limits.length))
            for name, attrs, ts in events
        ]
        links = span.links or ()
        if limits.links is not None and len(links) > limits.links:
            v.dropped_links = len(links) - limits.links
            links = links[len(links) - limits.links :]
        else:
            v.dropped_links = 0
        v.links = [_link_fields(link, limits) for link in links]
        code, message = span.status or (0, "")
        v.status_code, v.status_message = code, message or ""
        v.trace_state = ""
        return v
    ctx = span.get_span_context()
    parent = span.parent
    v.trace_id, v.span_id = ctx.trace_id, ctx.span_id
    v.parent_id = parent.span_id if parent else 0
    v.flags = FLAG_HAS_IS_REMOTE | (FLAG_IS_REMOTE if parent and parent.is_remote else 0)
    v.kind = span.kind.value + 1
    v.start, v.end = span.start_time or 0, span.end_time or 0
    v.attributes = span.attributes or {}
    v.dropped_attributes = span.dropped_attributes
    v.events = [
        (ev.timestamp, ev.name, ev.attributes or {}, ev.dropped_attributes) for ev in span.events
    ]
    v.dropped_events = span.dropped_events
    v.links = [
        (
            ln.context.trace_id,
            ln.context.span_id,
            "",  # as in the SDK's encoder: no link trace state
            ln.attributes or {},
            ln.dropped_attributes,
            FLAG_HAS_IS_REMOTE | (FLAG_IS_REMOTE if ln.context.is_remote else 0),
        )
        for ln in span.links
    ]
    v.dropped_links = span.dropped_links
    status = span.status
    v.status_code = status.status_code.value if status is not None else 0
    v.status_message = (status.description or "") if status is not None else ""
    v.trace_state = _trace_state(ctx)
    return v


# ------------------------------------------------------------------------------------------------
# The encoder


OnDrop = Callable[[str, str], None]  # (cause, message)


class SpanEncoder:
    """Encodes batches of spans; one per runtime (it caches the resource, scope and names).

    ``on_drop(cause, message)`` is called for an attribute or a span that cannot be encoded (the
    caller logs it once per cause and counts dropped spans).
    """

    def __init__(
        self,
        resource: Any,
        scope: Any,
        limits: Limits | None = None,
        on_drop: OnDrop | None = None,
    ) -> None:
        self.resource = resource
        self.scope = scope
        self.limits = limits or Limits()
        self.on_drop = on_drop or _log_drop
        self._names: dict[str, bytes] = {}
        self._keys: dict[str, bytes] = {}
        # The fast path for plain FineSpans (no events, links or status; plain attributes):
        # encoded attribute fields per (key, type, value), names, the last trace id.
        self._kv_json: dict[tuple[str, type, Any], str] = {}
        self._kv_pb: dict[tuple[str, type, Any], bytes] = {}
        self._json_names: dict[str, str] = {}
        self._json_tid: tuple[int, str] = (-1, "")
        self._pb_tid: tuple[int, bytes] = (-1, b"")
        # Keyed by id(resource): each value holds the resource too, so the id cannot be reused.
        self._pb_heads: dict[tuple[int, Any], tuple[bytes, bytes, bytes, Any]] = {}
        self._json_heads: dict[
            tuple[int, Any], tuple[dict[str, Any], dict[str, Any], str, Any]
        ] = {}

    # --- grouping -------------------------------------------------------------------------------

    def _groups(self, spans: Iterable[Any]) -> list[tuple[Any, Any, list[Any]]]:
        """(resource, scope, spans) in first-seen order, as the SDK's encoder groups them."""
        groups: dict[tuple[int, Any], tuple[Any, Any, list[Any]]] = {}
        fine: list[Any] | None = None
        last_key: Any = None
        last: list[Any] = []
        for span in spans:
            if type(span) is FineSpan:  # the runtime's resource and scope: no lookups
                if fine is None:
                    key = (id(self.resource), self.scope)
                    group = groups.get(key)
                    if group is None:
                        group = groups[key] = (self.resource, self.scope, [])
                    fine = group[2]
                fine.append(span)
                continue
            resource, scope = span.resource, span.instrumentation_scope
            key = (id(resource), scope)
            if key != last_key:
                group = groups.get(key)
                if group is None:
                    group = groups[key] = (resource, scope, [])
                last_key, last = key, group[2]
            last.append(span)
        return list(groups.values())

    # --- attributes -----------------------------------------------------------------------------

    def _json_attrs(self, attrs: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
        out = []
        for key, value in attrs.items():
            try:
                kv = {"key": key, "value": json_value(value)}
                try:
                    orjson.dumps(kv)  # a lone surrogate would fail the whole span later
                except (orjson.JSONEncodeError, TypeError) as exc:
                    raise Unencodable(str(exc)) from None
                out.append(kv)
            except Unencodable as exc:
                self.on_drop(f"attr:{key}", f"dropped attribute {key!r} of {where!r} ({exc})")
        return out

    def _pb_attrs(self, tag: bytes, attrs: Mapping[str, Any], where: str) -> list[bytes]:
        out = []
        keys = self._keys
        for key, value in attrs.items():
            try:
                kb = keys.get(key)
                if kb is None:
                    try:
                        kb = keys[key] = delimited(b"\x0a", key.encode("utf-8"))
                    except UnicodeEncodeError:
                        raise Unencodable("a key that is not valid UTF-8") from None
                out.append(delimited(tag, kb + delimited(b"\x12", pb_value(value))))
            except Unencodable as exc:
                self.on_drop(f"attr:{key}", f"dropped attribute {key!r} of {where!r} ({exc})")
        return out

    # --- OTLP/JSON ------------------------------------------------------------------------------

    def _json_head(self, resource: Any, scope: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
        key = (id(resource), scope)
        head = self._json_heads.get(key)
        if head is None:
            res: dict[str, Any] = {}
            attrs = self._json_attrs(getattr(resource, "attributes", None) or {}, "resource")
            if attrs:
                res["attributes"] = attrs
            sc: dict[str, Any] = {}
            if scope is not None:
                if scope.name:
                    sc["name"] = scope.name
                if scope.version:
                    sc["version"] = scope.version
                scope_attrs = self._json_attrs(getattr(scope, "attributes", None) or {}, "scope")
                if scope_attrs:
                    sc["attributes"] = scope_attrs
            schema = getattr(resource, "schema_url", "") or ""
            head = self._json_heads[key] = (res, sc, schema, resource)
        return head[:3]

    def _json_span(self, span: Any) -> dict[str, Any]:
        v = view(span, self.limits)
        name = v.name
        json_attrs = self._json_attrs
        events = None
        if v.events:
            events = [
                event_dict(
                    ts, ev_name, json_attrs(ev_attrs, name) if ev_attrs else None, ev_dropped
                )
                for ts, ev_name, ev_attrs, ev_dropped in v.events
            ]
        links = None
        if v.links:
            links = []
            for tid, sid, state, ln_attrs, ln_dropped, flags in v.links:
                ln: dict[str, Any] = {"traceId": f"{tid:032x}", "spanId": f"{sid:016x}"}
                if state:
                    ln["traceState"] = state
                if ln_attrs:
                    attrs = json_attrs(ln_attrs, name)
                    if attrs:
                        ln["attributes"] = attrs
                if ln_dropped:
                    ln["droppedAttributesCount"] = ln_dropped
                ln["flags"] = flags
                links.append(ln)
        status: dict[str, Any] = {}
        if v.status_message:
            status["message"] = v.status_message
        if v.status_code:
            status["code"] = v.status_code
        return span_dict(
            f"{v.trace_id:032x}",
            f"{v.span_id:016x}",
            v.trace_state,
            f"{v.parent_id:016x}" if v.parent_id else "",
            v.flags,
            name,
            v.kind,
            v.start,
            v.end,
            json_attrs(v.attributes, name) if v.attributes else None,
            v.dropped_attributes,
            events,
            v.dropped_events,
            links,
            v.dropped_links,
            status,
        )

    def json_request(self, spans: Iterable[Any]) -> tuple[dict[str, Any], int]:
        """``(ExportTraceServiceRequest as an OTLP/JSON dict, spans dropped)``."""
        resource_spans: list[dict[str, Any]] = []
        by_resource: dict[int, dict[str, Any]] = {}
        dropped = 0
        for resource, scope, group in self._groups(spans):
            res, sc, schema = self._json_head(resource, scope)
            encoded = []
            for span in group:
                try:
                    encoded.append(self._json_span(span))
                except Exception as exc:  # one bad record must not take the batch with it
                    dropped += 1
                    self.on_drop(f"span:{type(exc).__name__}", f"dropped a span ({exc})")
            rs = by_resource.get(id(resource))
            if rs is None:
                rs = {"resource": res, "scopeSpans": []} if res else {"scopeSpans": []}
                if schema:
                    rs["schemaUrl"] = schema
                by_resource[id(resource)] = rs
                resource_spans.append(rs)
            ss: dict[str, Any] = {"scope": sc} if sc else {}
            if encoded:
                ss["spans"] = encoded
            schema_url = getattr(scope, "schema_url", "") if scope is not None else ""
            if schema_url:
                ss["schemaUrl"] = schema_url
            rs["scopeSpans"].append(ss)
        request = {"resourceSpans": resource_spans} if resource_spans else {}
        return request, dropped

    def json_line(self, spans: Iterable[Any]) -> tuple[bytes, int]:
        """``(one OTLP/JSON line without the newline, spans dropped)``: the bytes orjson writes
        for :meth:`json_request`'s document, assembled from per-span pieces."""
        resources: dict[int, tuple[str, str, list[str]]] = {}
        dropped = 0
        fast = self._json_fine_fast
        for resource, scope, group in self._groups(spans):
            res, sc, schema = self._json_head(resource, scope)
            encoded = []
            for span in group:
                try:
                    frag = fast(span) if type(span) is FineSpan else None
                    encoded.append(frag or _dumps(self._json_span(span)))
                except Exception as exc:  # one bad record must not take the batch with it
                    dropped += 1
                    self.on_drop(f"span:{type(exc).__name__}", f"dropped a span ({exc})")
            entry = resources.get(id(resource))
            if entry is None:
                res_part = f'"resource":{_dumps(res)},' if res else ""
                schema_part = f',"schemaUrl":{_dumps(schema)}' if schema else ""
                entry = resources[id(resource)] = (res_part, schema_part, [])
            parts = [f'"scope":{_dumps(sc)}'] if sc else []
            if encoded:
                parts.append(f'"spans":[{",".join(encoded)}]')
            schema_url = getattr(scope, "schema_url", "") if scope is not None else ""
            if schema_url:
                parts.append(f'"schemaUrl":{_dumps(schema_url)}')
            entry[2].append("{" + ",".join(parts) + "}")
        if not resources:
            return b"{}", dropped
        body = ",".join(
            f'{{{res_part}"scopeSpans":[{",".join(scopes)}]{schema_part}}}'
            for res_part, schema_part, scopes in resources.values()
        )
        return f'{{"resourceSpans":[{body}]}}'.encode(), dropped

    def _plain_attributes(self, rec: FineSpan, cache: dict, build: Any) -> list[Any] | None:
        """The encoded attributes of a plain FineSpan (no events, links or status; every value
        of a plain type; within the limits) from ``cache``, building new ones with ``build``;
        None when the span needs the general path. Shared by the JSON and protobuf fast paths."""
        if rec.events is not None or rec.links is not None or rec.status is not None:
            return None
        attrs = rec.attributes
        if not attrs:
            return []
        limit = self.limits.attributes
        if limit is not None and len(attrs) > limit:
            return None
        out = []
        for key, value in attrs.items():
            tv = type(value)
            if tv not in _PLAIN:
                return None
            frag = cache.get((key, tv, value))
            if frag is None:
                frag = build(key, tv, value)
                if frag is None:
                    return None
            out.append(frag)
        return out

    def _json_fine_fast(self, rec: FineSpan) -> str | None:
        """A plain FineSpan's JSON object, or None when it needs the general path."""
        frags = self._plain_attributes(rec, self._kv_json, self._json_kv_new)
        if frags is None:
            return None
        attr_part = ',"attributes":[' + ",".join(frags) + "]" if frags else ""
        name = rec.name
        name_part = self._json_names.get(name)
        if name_part is None:
            if type(name) is not str or not name:
                return None
            name_part = self._json_names[name] = f'"name":{_dumps(name)}'
        tid = rec.trace_id
        cached = self._json_tid
        if cached[0] != tid:
            cached = self._json_tid = (tid, f'{{"traceId":"{tid:032x}","spanId":"')
        pid = rec.parent_id
        parent = f'","parentSpanId":"{pid:016x}' if pid else ""
        return (
            f'{cached[1]}{rec.span_id:016x}{parent}","flags":256,{name_part},"kind":1,'
            f'"startTimeUnixNano":"{rec.start}","endTimeUnixNano":"{rec.end}"{attr_part},'
            '"status":{}}'
        )

    def _fast_kv(self, key: Any, tv: type, value: Any) -> bool:
        """Whether an attribute of a plain type needs no cleaning (a non-empty string key, a
        string within the length limit, an int within int64): the fast paths' one check."""
        if type(key) is not str or not key:
            return False
        if tv is str:
            limit = self.limits.length
            return limit is None or len(value) <= limit
        return tv is not int or INT64_MIN <= value <= INT64_MAX

    def _json_kv_new(self, key: Any, tv: type, value: Any) -> str | None:
        """A plain attribute's JSON KeyValue (cached), or None when it needs cleaning."""
        if not self._fast_kv(key, tv, value):
            return None
        try:
            frag = f'{{"key":{_dumps(key)},"value":{_dumps(json_value(value))}}}'
        except (orjson.JSONEncodeError, TypeError):  # e.g. a lone surrogate: the general path
            return None
        if len(self._kv_json) < _CACHE_MAX:
            self._kv_json[(key, tv, value)] = frag
        return frag

    # --- protobuf -------------------------------------------------------------------------------

    def _pb_head(self, resource: Any, scope: Any) -> tuple[bytes, bytes, bytes]:
        """(ResourceSpans ``resource`` and ``schema_url`` fields, ScopeSpans ``scope`` field): built with
        opentelemetry-proto's messages, once per resource and scope."""
        key = (id(resource), scope)
        head = self._pb_heads.get(key)
        if head is None:
            from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
            from opentelemetry.proto.resource.v1.resource_pb2 import Resource

            res_attrs = b"".join(
                self._pb_attrs(b"\x0a", getattr(resource, "attributes", None) or {}, "resource")
            )
            res_msg = Resource()
            res_msg.MergeFromString(res_attrs)
            scope_msg = InstrumentationScope()
            if scope is not None:
                scope_msg.name = scope.name or ""
                scope_msg.version = scope.version or ""
                scope_msg.MergeFromString(
                    b"".join(
                        self._pb_attrs(b"\x1a", getattr(scope, "attributes", None) or {}, "scope")
                    )
                )
            res_field = delimited(b"\x0a", res_msg.SerializeToString())
            schema = getattr(resource, "schema_url", "") or ""
            schema_field = delimited(b"\x1a", schema.encode()) if schema else b""
            scope_field = delimited(b"\x0a", scope_msg.SerializeToString())
            head = self._pb_heads[key] = (res_field, schema_field, scope_field, resource)
        return head[:3]

    def _pb_fine_fast(self, rec: FineSpan) -> bytes | None:
        """A plain FineSpan's ``spans`` field, or None when it needs the general path."""
        fields = self._plain_attributes(rec, self._kv_pb, self._pb_kv_new)
        if fields is None:
            return None
        attr_bytes = b"".join(fields)
        name = rec.name
        nb = self._names.get(name)
        if nb is None:
            if type(name) is not str or not name:
                return None
            nb = self._names[name] = delimited(b"\x2a", name.encode("utf-8"))
        tid = rec.trace_id
        cached = self._pb_tid
        if cached[0] != tid:
            cached = self._pb_tid = (tid, b"\x0a\x10" + tid.to_bytes(16, "big") + b"\x12\x08")
        pid = rec.parent_id
        body = b"".join(
            (
                cached[1],
                rec.span_id.to_bytes(8, "big"),
                b"\x22\x08" + pid.to_bytes(8, "big") if pid else b"",
                nb,
                b"\x30\x01\x39",
                FIXED64(rec.start),
                b"\x41",
                FIXED64(rec.end),
                attr_bytes,
                b"\x7a\x00\x85\x01\x00\x01\x00\x00",  # status {}, flags 256
            )
        )
        n = len(body)
        return b"\x12" + (VARINT1[n] if n < 128 else varint(n)) + body

    def _pb_kv_new(self, key: Any, tv: type, value: Any) -> bytes | None:
        """A plain attribute's ``attributes`` field (cached), or None when it needs cleaning."""
        if not self._fast_kv(key, tv, value):
            return None
        field = delimited(b"\x4a", pb_kv(key, value))
        if len(self._kv_pb) < _CACHE_MAX:
            self._kv_pb[(key, tv, value)] = field
        return field

    def _pb_span(self, span: Any) -> bytes:
        if type(span) is FineSpan:
            fast = self._pb_fine_fast(span)
            if fast is not None:
                return fast
        v = view(span, self.limits)
        name = v.name
        nb = self._names.get(name)
        if nb is None:
            nb = self._names[name] = delimited(b"\x2a", name.encode("utf-8"))
        parts = [
            b"\x0a\x10",
            v.trace_id.to_bytes(16, "big"),
            b"\x12\x08",
            v.span_id.to_bytes(8, "big"),
        ]
        if v.trace_state:
            parts.append(delimited(b"\x1a", v.trace_state.encode()))
        if v.parent_id:
            parts.append(b"\x22\x08")
            parts.append(v.parent_id.to_bytes(8, "big"))
        parts.append(nb)
        if v.kind:
            parts.append(b"\x30" + varint(v.kind))
        if v.start:
            parts.append(b"\x39" + FIXED64(v.start))
        if v.end:
            parts.append(b"\x41" + FIXED64(v.end))
        if v.attributes:
            parts.extend(self._pb_attrs(b"\x4a", v.attributes, name))
        if v.dropped_attributes:
            parts.append(b"\x50" + varint(v.dropped_attributes))
        for ts, ev_name, ev_attrs, ev_dropped in v.events:
            ev = [b"\x09" + FIXED64(ts)] if ts else []
            if ev_name:
                ev.append(delimited(b"\x12", ev_name.encode("utf-8")))
            if ev_attrs:
                ev.extend(self._pb_attrs(b"\x1a", ev_attrs, name))
            if ev_dropped:
                ev.append(b"\x20" + varint(ev_dropped))
            parts.append(delimited(b"\x5a", b"".join(ev)))
        if v.dropped_events:
            parts.append(b"\x60" + varint(v.dropped_events))
        for tid, sid, state, ln_attrs, ln_dropped, flags in v.links:
            ln = [b"\x0a\x10", tid.to_bytes(16, "big"), b"\x12\x08", sid.to_bytes(8, "big")]
            if state:
                ln.append(delimited(b"\x1a", state.encode()))
            if ln_attrs:
                ln.extend(self._pb_attrs(b"\x22", ln_attrs, name))
            if ln_dropped:
                ln.append(b"\x28" + varint(ln_dropped))
            ln.append(b"\x35" + FIXED32(flags))
            parts.append(delimited(b"\x6a", b"".join(ln)))
        if v.dropped_links:
            parts.append(b"\x70" + varint(v.dropped_links))
        status = b""
        if v.status_message:
            status += delimited(b"\x12", v.status_message.encode("utf-8"))
        if v.status_code:
            status += b"\x18" + varint(v.status_code)
        parts.append(delimited(b"\x7a", status))
        parts.append(b"\x85\x01" + FIXED32(v.flags))  # flags = 16, fixed32
        return delimited(b"\x12", b"".join(parts))  # ScopeSpans.spans = 2

    def pb_request(self, spans: Iterable[Any]) -> tuple[bytes, int]:
        """``(serialised ExportTraceServiceRequest, spans dropped)``."""
        by_resource: dict[int, tuple[bytes, bytes, list[bytes]]] = {}
        dropped = 0
        for resource, scope, group in self._groups(spans):
            res_field, schema_field, scope_field = self._pb_head(resource, scope)
            encoded = [scope_field]
            for span in group:
                try:
                    encoded.append(self._pb_span(span))
                except Exception as exc:  # one bad record must not take the batch with it
                    dropped += 1
                    self.on_drop(f"span:{type(exc).__name__}", f"dropped a span ({exc})")
            scope_schema = getattr(scope, "schema_url", "") if scope is not None else ""
            if scope_schema:
                encoded.append(delimited(b"\x1a", scope_schema.encode()))
            entry = by_resource.get(id(resource))
            if entry is None:
                entry = by_resource[id(resource)] = (res_field, schema_field, [])
            entry[2].append(delimited(b"\x12", b"".join(encoded)))  # ResourceSpans.scope_spans = 2
        return (
            b"".join(
                delimited(b"\x0a", res + b"".join(scopes) + schema)
                for res, schema, scopes in by_resource.values()
            ),
            dropped,
        )


def _log_drop(cause: str, message: str) -> None:
    log.warning("mlaunch telemetry: %s", message)


_ENCODER: SpanEncoder | None = None


def encode_spans_line(spans: Iterable[Any]) -> str:
    """SDK ``ReadableSpan`` objects as one OTLP/JSON line (no trailing newline): the document the
    SDK's encoder + protobuf's JSON mapping give, keys in the proto's declaration order as the
    collector writes them."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = SpanEncoder(None, None)
    line, _ = _ENCODER.json_line(spans)
    return line.decode("utf-8")
