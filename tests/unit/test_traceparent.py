"""The one W3C ``traceparent`` reader (mlaunch.otlp.traceparent)."""

from __future__ import annotations

import pytest

from mlaunch.otlp import traceparent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_a_valid_traceparent_gives_its_ids_and_flags() -> None:
    parsed = traceparent.parse(f" 00-{TRACE}-{SPAN}-01\n")
    assert parsed == (int(TRACE, 16), int(SPAN, 16), 1)
    assert parsed.sampled
    assert not traceparent.parse(f"00-{TRACE}-{SPAN}-00").sampled


def test_upper_case_hex_is_read_as_lower_case() -> None:
    upper = traceparent.parse(f"00-{TRACE.upper()}-{SPAN.upper()}-01")
    assert upper == traceparent.parse(f"00-{TRACE}-{SPAN}-01")


def test_a_later_version_may_carry_more_fields_and_version_00_may_not() -> None:
    assert traceparent.parse(f"01-{TRACE}-{SPAN}-01-more") == (int(TRACE, 16), int(SPAN, 16), 1)
    assert traceparent.parse(f"00-{TRACE}-{SPAN}-01-more") is None


@pytest.mark.parametrize(
    "value",
    [
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero span id
        f"00-{TRACE[:-1]}-{SPAN}-01",  # trace id too short
        f"00-{TRACE}-{SPAN}0-01",  # span id too long
        f"00-{TRACE}-{SPAN}-1",  # flags too short
        f"0-{TRACE}-{SPAN}-01",  # version too short
        f"00-{TRACE}-{SPAN}",  # no flags
        f"00-{TRACE[:-1]}g-{SPAN}-01",  # not hex
        f"00-{TRACE[:-2]}_1-{SPAN}-01",  # int() would take the underscore
        "",
        None,
        "garbage",
    ],
)
def test_an_invalid_traceparent_is_none(value: str | None) -> None:
    assert traceparent.parse(value) is None
