"""The one duration formatter: the terminal tables' aligned style and the HTML report's compact
style each keep the look their views had."""

from __future__ import annotations

import pytest

from mlaunch.trace.durations import format_ms


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0"),
        (0.00123, "1.23µs"),
        (0.5, "500µs"),
        (1.5, "1.50ms"),
        (15, "15.0ms"),
        (150, "150ms"),
        (999.9, "1.00s"),  # rounds up into the next unit rather than printing 1,000ms
        (1234.5, "1.23s"),
        (90_000, "90.0s"),
        (1_234_000, "1,234s"),  # seconds are the largest unit in a table
    ],
)
def test_aligned_style_keeps_three_digits_with_fixed_decimals(ms: float, text: str) -> None:
    assert format_ms(ms) == format_ms(ms, "aligned") == text


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0"),
        (0.00123, "1.23µs"),
        (0.5, "500µs"),
        (1.5, "1.5ms"),
        (15, "15ms"),
        (150, "150ms"),
        (1234.5, "1.23s"),
        (90_000, "1.5min"),
        (1_234_000, "20.6min"),
    ],
)
def test_compact_style_drops_trailing_zeros_and_uses_minutes(ms: float, text: str) -> None:
    assert format_ms(ms, "compact") == text
