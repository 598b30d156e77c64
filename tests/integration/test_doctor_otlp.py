"""The OTLP endpoint check against real peers on 127.0.0.1: OTLP receivers (gRPC, HTTP, TLS),
a plain HTTP server, a service-less gRPC server, a hanging server and a closed port. Each
failure mode has its own message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.otlp import GrpcOtlpReceiver, HangingServer, HttpOtlpReceiver, closed_port_endpoint
from support.peers import (
    PlainGrpcServer,
    PlainHttpServer,
    TlsGrpcOtlpServer,
    TlsHttpOtlpServer,
    self_signed_cert,
)

from mlaunch.doctor.otlp import check_otlp
from mlaunch.doctor.results import CheckResult
from mlaunch.settings import load_settings

TIMEOUT = 1.0


def otlp(env: dict[str, str]) -> list[CheckResult]:
    """The OTLP checks for this environment, through the same settings as mlaunch train."""
    return check_otlp(load_settings(environ=env), timeout_s=TIMEOUT)


def probe(env: dict[str, str]) -> CheckResult:
    results = otlp(env)
    assert [r.name for r in results] == ["otlp endpoint", "otlp connect", "otlp probe"], results
    assert results[0].status == results[1].status == "pass"
    return results[2]


def grpc_env(url: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}


def http_env(url: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def grpc_rx() -> Iterator[GrpcOtlpReceiver]:
    with GrpcOtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def http_rx() -> Iterator[HttpOtlpReceiver]:
    with HttpOtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def plain_http() -> Iterator[PlainHttpServer]:
    with PlainHttpServer() as server:
        yield server


# --- no collector needed --------------------------------------------------------------------


def test_file_exporter_needs_no_collector() -> None:
    [result] = otlp({})
    assert result.status == "pass"
    assert result.message.startswith("file exporter: no collector needed")


# --- healthy receivers ----------------------------------------------------------------------


def test_grpc_receiver_passes_and_gets_the_headers(grpc_rx: GrpcOtlpReceiver) -> None:
    env = {
        **grpc_env(grpc_rx.endpoint),
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cr3t",
    }
    results = otlp(env)
    assert {r.status for r in results} == {"pass"}, results
    assert f"{grpc_rx.endpoint} over grpc" in results[0].message
    assert "OTLP/gRPC receiver" in results[2].message
    assert {"authorization": "Bearer s3cr3t"}.items() <= grpc_rx.headers[-1].items()
    assert not any("s3cr3t" in r.message + r.fix for r in results)


def test_http_receiver_passes_at_v1_traces(http_rx: HttpOtlpReceiver) -> None:
    env = {**http_env(http_rx.endpoint), "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=k3y"}
    result = probe(env)
    assert result.status == "pass"
    assert http_rx.traces_url in result.message and "OTLP/HTTP receiver" in result.message
    assert http_rx.headers[-1]["x-api-key"] == "k3y"
    assert http_rx.headers[-1]["content-type"] == "application/x-protobuf"


def test_tls_receivers_pass_with_their_certificate(cert: tuple[Path, Path]) -> None:
    with TlsHttpOtlpServer(*cert) as https, TlsGrpcOtlpServer(*cert) as grpcs:
        for env in (http_env(https.endpoint), grpc_env(grpcs.endpoint)):
            env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = str(cert[0])
            assert probe(env).status == "pass"


def test_untrusted_tls_certificate_is_named(cert: tuple[Path, Path]) -> None:
    with TlsHttpOtlpServer(*cert) as https, TlsGrpcOtlpServer(*cert) as grpcs:
        for env in (http_env(https.endpoint), grpc_env(grpcs.endpoint)):
            result = probe(env)
            assert result.status == "fail"
            assert "certificate" in result.message and "not trusted" in result.message
            assert "OTEL_EXPORTER_OTLP_CERTIFICATE" in result.fix


# --- the wrong peer -------------------------------------------------------------------------


def test_closed_port_is_connection_refused() -> None:
    results = otlp(grpc_env(closed_port_endpoint()))
    assert [r.name for r in results] == ["otlp endpoint", "otlp connect"]
    assert results[1].status == "fail"
    assert "connection refused" in results[1].message
    assert "4317" in results[1].fix and "OTEL_EXPORTER_OTLP_ENDPOINT" in results[1].fix


def test_hanging_server_times_out() -> None:
    with HangingServer() as hang:
        for env in (grpc_env(hang.endpoint), http_env(hang.endpoint)):
            result = check_otlp(load_settings(environ=env), timeout_s=0.5)[-1]
            assert result.status == "fail"
            assert "accepts connections but never answers (no reply within 0.5 s)" in result.message


def test_plain_http_server_on_a_grpc_endpoint(plain_http: PlainHttpServer) -> None:
    result = probe(grpc_env(plain_http.endpoint))
    assert result.status == "fail"
    assert "HTTP/1.1 server (not OTLP/gRPC) answers on the gRPC endpoint" in result.message


def test_otlp_http_receiver_on_a_grpc_endpoint_suggests_the_protocol(
    http_rx: HttpOtlpReceiver,
) -> None:
    result = probe(grpc_env(http_rx.endpoint))
    assert result.status == "fail"
    assert "OTLP/HTTP receiver answers" in result.message and "protocol is grpc" in result.message
    assert result.fix == "set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"


def test_otlp_grpc_receiver_on_an_http_endpoint_suggests_the_protocol(
    grpc_rx: GrpcOtlpReceiver,
) -> None:
    result = probe(http_env(grpc_rx.endpoint))
    assert result.status == "fail"
    assert "OTLP/gRPC receiver answers" in result.message
    assert result.fix == "set OTEL_EXPORTER_OTLP_PROTOCOL=grpc"


def test_grpc_server_that_is_not_otlp() -> None:
    with PlainGrpcServer() as server:
        on_grpc = probe(grpc_env(server.endpoint))
        on_http = probe(http_env(server.endpoint))
    assert on_grpc.status == "fail" and "without the OTLP trace service" in on_grpc.message
    assert on_http.status == "fail"
    assert "gRPC (HTTP/2) server, not an OTLP/HTTP receiver" in on_http.message


def test_plain_http_server_on_an_http_endpoint(plain_http: PlainHttpServer) -> None:
    result = probe(http_env(plain_http.endpoint))
    assert result.status == "fail"
    assert "501" in result.message and "not an OTLP/HTTP protobuf receiver" in result.message
    with PlainHttpServer(post_status=200) as ok200:
        result = probe(http_env(ok200.endpoint))
    assert result.status == "fail" and "200 with text/html" in result.message


def test_missing_v1_traces_path_is_a_404(http_rx: HttpOtlpReceiver) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": http_rx.endpoint + "/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    result = probe(env)
    assert result.status == "fail"
    assert result.message.startswith("404 at") and "/v1/traces" in result.message


def test_base_endpoint_that_already_ends_with_v1_traces(http_rx: HttpOtlpReceiver) -> None:
    result = probe(http_env(http_rx.traces_url))
    assert result.status == "fail"
    assert "already ended with /v1/traces" in result.message
    assert result.fix == "set OTEL_EXPORTER_OTLP_ENDPOINT to the base URL, without /v1/traces"


def test_https_url_to_a_plaintext_server(
    http_rx: HttpOtlpReceiver, grpc_rx: GrpcOtlpReceiver
) -> None:
    for env in (
        http_env(http_rx.endpoint.replace("http://", "https://")),
        grpc_env(grpc_rx.endpoint.replace("http://", "https://")),
    ):
        result = probe(env)
        assert result.status == "fail"
        assert result.message.startswith("TLS on one side only: the URL is https://")
        assert result.fix.startswith("use http://127.0.0.1:")


def test_http_url_to_a_tls_server(cert: tuple[Path, Path]) -> None:
    with TlsHttpOtlpServer(*cert) as https, TlsGrpcOtlpServer(*cert) as grpcs:
        for env in (
            http_env(https.endpoint.replace("https://", "http://")),
            grpc_env(grpcs.endpoint.replace("https://", "http://")),
        ):
            result = probe(env)
            assert result.status == "fail"
            assert result.message.startswith("TLS on one side only: the URL is http://")
            assert result.message.endswith("expects TLS")
            assert result.fix.startswith("use https://127.0.0.1:")


def test_rejected_credentials_never_show_the_headers() -> None:
    with PlainHttpServer(post_status=401) as server:
        env = {**http_env(server.endpoint), "OTEL_EXPORTER_OTLP_HEADERS": "authorization=t0ken"}
        result = probe(env)
    assert result.status == "fail"
    assert "rejected the request with the configured headers" in result.message
    assert "t0ken" not in result.message + result.fix


def test_missing_certificate_file_is_named(grpc_rx: GrpcOtlpReceiver, tmp_path: Path) -> None:
    env = {**grpc_env(grpc_rx.endpoint.replace("http://", "https://"))}
    env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = str(tmp_path / "missing.pem")
    result = probe(env)
    assert result.status == "fail" and "missing.pem is not a file" in result.message
