"""Every span constructor routes a group the same way: off -> the null span; a flight-recorder
group -> a recorded span (no link, and a deferred link's buffer is never read); an exported fine
group -> a record (device-timed where the constructor asks for it); a group a live capture added
-> exported and marked with the capture's id; anything else -> an SDK span (goodput marked).
The constructors differ only in what they add to that: a link, device timing, a deferred link."""

from __future__ import annotations

from typing import Any

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr
from mlaunch.telemetry import _capture
from mlaunch.telemetry._context_ints import context_ints

NAME = "megatron.train.iteration"  # a goodput name: only the SDK path marks it
CARRIER = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}
CONTEXT = context_ints(int("1" * 32, 16), int("2" * 16, 16), True)

#: Group kind -> the group standing for it in the set-up below.
KINDS = {
    "off": G.ACTIVATION_OFFLOAD,
    "recorded fine": G.COMMUNICATION,
    "recorded coarse": G.OPTIMIZER,
    "exported fine": G.LAYER,
    "exported coarse": G.STEP,
    "captured fine": G.MICROBATCH,
    "captured coarse": G.FORWARD_BACKWARD,
}

NULL = ("NullSpan",)
REC = ("RecordedSpan", None, False, False)
FINE = ("FineSpan", None, False, False)
FINE_LINKED = ("FineSpan", None, False, True)
TIMED = ("DeviceTimedSpan", None, False, False, "reader: none")
TIMED_DEFERRED = ("DeviceTimedSpan", None, False, False, "reader: later")
COARSE = ("CoarseSpan", None, True, False)
COARSE_LINKED = ("CoarseSpan", None, True, True)
CFINE = ("FineSpan", "c1", False, False)
CFINE_LINKED = ("FineSpan", "c1", False, True)
CCOARSE = ("CoarseSpan", "c1", True, False)
CCOARSE_LINKED = ("CoarseSpan", "c1", True, True)

#: kind -> (span, linked_span, device_span without a timer, with one, deferred_linked_span).
WANT = {
    "off": (NULL, NULL, NULL, NULL, NULL),
    "recorded fine": (REC, REC, REC, REC, REC),
    "recorded coarse": (REC, REC, REC, REC, REC),
    "exported fine": (FINE, FINE_LINKED, FINE, TIMED, TIMED_DEFERRED),
    "exported coarse": (COARSE, COARSE_LINKED, COARSE, COARSE, COARSE_LINKED),
    "captured fine": (CFINE, CFINE_LINKED, CFINE, CFINE, CFINE_LINKED),
    "captured coarse": (CCOARSE, CCOARSE_LINKED, CCOARSE, CCOARSE, CCOARSE_LINKED),
}


def _describe(obj: Any, reads: list[int]) -> tuple[Any, ...]:
    """What the route decided: the span's kind, its capture id, goodput mark, link, and (device
    timed) when its link is read; a deferred link read at construction counts in ``reads``."""
    kind = type(obj).__name__
    if kind == "NullSpan":
        return (kind,)
    if kind == "RootRecordedSpan":
        kind = "RecordedSpan"
    inner = obj.span if kind == "DeviceTimedSpan" else obj
    attrs = {str(k): v for k, v in (inner.attributes or {}).items()}
    links = getattr(inner, "links", None)
    out = (kind, attrs.get(Attr.CAPTURE_ID.value), bool(attrs.get(Attr.IS_GOODPUT.value)))
    out += (bool(links) or bool(reads),)
    if kind == "DeviceTimedSpan":
        out += ("reader: later" if obj._link_reader is not None else "reader: none",)
        assert not reads  # read at the sync point only
    return out


def _routes(group: G) -> tuple[tuple[Any, ...], ...]:
    reads: list[int] = []

    def read() -> Any:
        reads.append(1)
        return CONTEXT

    got = []
    for make in (
        lambda: telemetry.span(group, NAME),
        lambda: telemetry.linked_span(group, NAME, CARRIER),
        lambda: telemetry.device_span(group, NAME),
        "timer",
        lambda: telemetry.deferred_linked_span(group, NAME, read),
    ):
        if make == "timer":
            telemetry.set_event_timer(telemetry.HostClock())
            try:
                got.append(_describe(telemetry.device_span(group, NAME), reads))
            finally:
                telemetry.set_event_timer(None)
            continue
        reads.clear()
        got.append(_describe(make(), reads))  # type: ignore[operator]
    return tuple(got)


def test_every_constructor_takes_the_one_route(make_settings, tmp_path):
    telemetry.setup(
        make_settings(
            SPAN_GROUPS="step,layer",
            RECORDER_GROUPS="communication,optimizer",
            EXPORTER="none",
        ),
        rank=0, world_size=1, run_dir=tmp_path,
    )  # fmt: skip
    capture = _capture.parse_capture(
        {"id": "c1", "groups": "microbatch,forward_backward", "iterations": 5, "start_iteration": 2}
    )
    _capture.CONTROL.schedule(capture)
    telemetry.set_iteration(1)
    assert capture.state == "scheduled"
    telemetry.set_iteration(2)
    assert capture.state == "running"
    got = {kind: _routes(group) for kind, group in KINDS.items()}
    assert got == WANT
    with telemetry.suppressed():  # suppressed: the null span whatever the route
        assert {_routes(group) for group in KINDS.values()} == {(NULL,) * 5}
    telemetry.set_iteration(7)  # the window is over: the captured groups are off again
    assert capture.state == "done"
    assert _routes(G.MICROBATCH) == (NULL,) * 5
    assert _routes(G.COMMUNICATION) == (REC,) * 5
