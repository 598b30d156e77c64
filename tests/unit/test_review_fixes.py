"""Regression tests for defects found in review (one test per fixed defect)."""

from __future__ import annotations

import pytest

from mlaunch.trace.replay import ReplayInputError, parse_headers


def test_replay_bad_header_entry_is_reported_without_its_secret() -> None:
    # `--headers "Authorization: Bearer TOKEN"` (HTTP's colon): the error must not print TOKEN.
    with pytest.raises(ReplayInputError) as info:
        parse_headers("team=ml,Authorization: Bearer S3CR3T")
    assert "S3CR3T" not in str(info.value)
    assert "#2" in str(info.value)


def test_replay_headers_are_percent_decoded_like_otel_exporter_otlp_headers() -> None:
    # The value a run used (OTEL_EXPORTER_OTLP_HEADERS) must authenticate the replay too: the
    # exporter sends "Bearer TOKEN" for it, so replay must not send "Bearer%20TOKEN".
    assert parse_headers("Authorization=Bearer%20TOKEN,x-team=ml") == {
        "authorization": "Bearer TOKEN",
        "x-team": "ml",
    }
