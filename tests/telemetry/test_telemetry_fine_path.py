# ruff: noqa: SIM117 - nested with-blocks mirror the span tree under test
"""The fine-grained record path exports exactly what the SDK path exports for the same calls."""

from __future__ import annotations

import json
from typing import Any

from mlaunch import telemetry
from mlaunch.model.groups import FINE_GRAINED_GROUPS
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr
from mlaunch.model.spans import SpanName as S
from mlaunch.rundir import layout as lay

_VOLATILE = (
    "traceId",
    "spanId",
    "parentSpanId",
    "startTimeUnixNano",
    "endTimeUnixNano",
    "timeUnixNano",
)


def _calls() -> None:
    """A mix of coarse and fine spans, attributes, events, links and an exception."""
    with telemetry.span(G.FORWARD_BACKWARD, S.FORWARD_BACKWARD):  # noqa: SIM117
        with telemetry.span(G.MICROBATCH, S.MICROBATCH_FORWARD, **{Attr.MICROBATCH_ID: 1}) as mb:
            mb.set_attribute("megatron.tokens", 128)
            mb.set_attributes({"ratio": 0.5, "flag": True, "tags": ["a", "b"]})
            mb.add_event("checkpoint-ish", {"k": "v"})
            with telemetry.span(G.LAYER, S.LAYER_FORWARD, **{Attr.LAYER_NUMBER: 2}):
                with telemetry.span(G.LAYER, S.LAYER_SELF_ATTENTION):
                    pass
        with telemetry.span(G.COMMUNICATION, S.P2P_SEND_FORWARD):
            carrier: dict[str, str] = {}
            telemetry.inject(carrier)
        with telemetry.linked_span(
            G.COMMUNICATION, S.PP_RECV_FORWARD_LINKED, carrier, **{Attr.PP_RANK: 1}
        ):
            pass
        try:
            with telemetry.span(G.ACTIVATION_OFFLOAD, S.ACTIVATION_OFFLOAD):
                raise KeyError("gone")
        except KeyError:
            pass
        with telemetry.trace_region("io"):
            pass


def _normalised(
    settings: Any, run_dir, force_sdk: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the calls; return the raw OTLP/JSON spans with ids/times replaced by names/ordinals."""
    telemetry.setup(settings, rank=0, world_size=1, run_dir=run_dir)
    if force_sdk:
        telemetry._FINE = frozenset()  # every group through the SDK path
    else:
        assert frozenset(g.value for g in FINE_GRAINED_GROUPS) == telemetry._FINE
    _calls()
    telemetry.shutdown()
    raw = []
    resource = None
    with open(lay.traces_file(run_dir, 0)) as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                resource = rs["resource"]
                for ss in rs["scopeSpans"]:
                    raw.extend((ss["scope"], sp) for sp in ss["spans"])
    names = {sp["spanId"]: sp["name"] for _, sp in raw}
    out = []
    for scope, sp in raw:
        sp = json.loads(json.dumps(sp))
        assert int(sp["startTimeUnixNano"]) <= int(sp["endTimeUnixNano"])
        sp["parent"] = names.get(sp.pop("parentSpanId", ""))
        for link in sp.get("links", ()):
            link["target"] = names[link.pop("spanId")]
            link.pop("traceId")
        for ev in sp.get("events", ()):
            ev.pop("timeUnixNano")
            for kv in ev.get("attributes", ()):
                if kv["key"] == "exception.stacktrace":
                    kv["value"] = {"stringValue": "<stack>"}
        for key in _VOLATILE:
            sp.pop(key, None)
        sp["scope"] = scope
        out.append(sp)
    out.sort(key=lambda s: s["name"])
    resource["attributes"] = [kv for kv in resource["attributes"] if kv["key"] != "process.pid"]
    return out, resource


def test_fine_path_exports_exactly_what_the_sdk_exports(make_settings, tmp_path):
    settings = make_settings()
    fine, fine_resource = _normalised(settings, tmp_path / "fine", force_sdk=False)
    sdk, sdk_resource = _normalised(settings, tmp_path / "sdk", force_sdk=True)
    assert [s["name"] for s in fine] == [s["name"] for s in sdk]
    for a, b in zip(fine, sdk, strict=True):
        assert a == b, a["name"]
    assert fine_resource == sdk_resource
    assert len(fine) == 8
    mb = next(s for s in fine if s["name"] == S.MICROBATCH_FORWARD)
    assert mb["parent"] == S.FORWARD_BACKWARD and len(mb["attributes"]) == 5 and mb["events"]
    linked = next(s for s in fine if s["name"] == S.PP_RECV_FORWARD_LINKED)
    assert [ln["target"] for ln in linked["links"]] == [S.P2P_SEND_FORWARD]
    offload = next(s for s in fine if s["name"] == S.ACTIVATION_OFFLOAD)
    assert offload["status"]["code"] == 2 and offload["events"][0]["name"] == "exception"
