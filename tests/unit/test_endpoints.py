"""URL endpoints (mlaunch/endpoints.py, the one parser behind train, doctor and replay):
IPv6 literals keep their brackets, malformed URLs are refused, and credentials in a URL are never
shown, by the parser or by doctor."""

from __future__ import annotations

import pytest

from mlaunch.endpoints import EndpointError, parse_endpoint, redact


def test_parser_keeps_ipv6_brackets_and_redacts_credentials() -> None:
    ep = parse_endpoint("http://user:s3cret@[::1]:4318/", "http/protobuf")
    assert (ep.host, ep.port, ep.hostport) == ("::1", 4318, "[::1]:4318")
    assert "s3cret" not in ep.shown and "s3cret" not in repr(ep)
    assert parse_endpoint("https://[2001:db8::1]").hostport == "[2001:db8::1]:4317"
    for bad in ("http://[::1", "localhost:4317", "http://host:99999", "ftp://x", "http://:80"):
        with pytest.raises(EndpointError):
            parse_endpoint(bad)
    with pytest.raises(EndpointError) as info:
        parse_endpoint("http://bob:hunter2@host:notaport")
    assert "hunter2" not in str(info.value)
    assert redact("http://a:b@h:1/p") == "http://***@h:1/p"


def test_doctor_never_shows_url_credentials() -> None:
    from mlaunch.doctor.configuration import check_configuration
    from mlaunch.doctor.otlp import probe_otlp

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://u:s3cret@[::1]:1"}
    results, _ = check_configuration(env, None)
    assert all("s3cret" not in r.message + r.fix for r in results)
    probe = probe_otlp("http://u:s3cret@[::1]:1/v1/traces", "http/protobuf", {}, 1.0)
    assert "s3cret" not in probe.message + probe.fix and "[::1]:1" in probe.message
