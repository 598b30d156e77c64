"""``mlaunch trace replay``: sending a run's spool to a collector later.

Endpoints go through the one parser (mlaunch/endpoints.py): IPv6 literals keep their brackets, a
malformed URL is one ``field: message`` line (exit 2), credentials are never echoed, the wrong
protocol is named as a mismatch, and a file-exporter run says why there is nothing to replay.
``--headers`` reads the OTEL_EXPORTER_OTLP_HEADERS format and never echoes a secret.
Real servers: an HTTP/protobuf receiver on ``[::1]``, the test gRPC receiver, real CLI subprocesses.
The whole relay story (an outage spooled, then replayed with nothing lost) is pinned by
tests/receiver/test_relay.py and the integration tests test_fault_collector.py and
test_receiver_script.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlaunch.otlp import otlp_json
from mlaunch.trace.replay import ReplayInputError, parse_headers
from tests.support.otlp import GrpcOtlpReceiver, HttpOtlpReceiver

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str | Path) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "replay", *map(str, args)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def make_run(tmp_path: Path, *, spans: int = 2, exporter: str = "otlp") -> Path:
    run = tmp_path / "run"
    tel = run / "telemetry"
    tel.mkdir(parents=True)
    (run / "resolved.json").write_text(
        json.dumps({"settings": {"telemetry.exporter": {"value": exporter, "source": "default"}}})
    )
    if spans:
        line = otlp_json.trace_request(
            {"service.name": "t"},
            "s",
            [
                otlp_json.encode_span(
                    name=f"s{i}", trace_id="ab" * 16, span_id=f"{i + 1:016x}", start_ns=1, end_ns=2
                )
                for i in range(spans)
            ],
        )
        (tel / "spool-traces-rank0.jsonl").write_text(json.dumps(line) + "\n")
    return run


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def test_replay_to_an_ipv6_http_receiver_with_url_credentials(tmp_path: Path) -> None:
    got: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    server = _V6Server(("::1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        run = make_run(tmp_path)
        url = f"http://user:s3cret@[::1]:{port}"
        code, out, err = cli(run, "--endpoint", url, "--protocol", "http/protobuf")
        assert code == 0, err
        assert got and got[0][0] == "/v1/traces" and got[0][1].startswith("Basic ")
        assert f"[::1]:{port}" in out and "s3cret" not in out + err
    finally:
        server.shutdown()


def test_replay_malformed_url_is_one_line_exit_2_no_credentials(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    for url in ("http://[::1", "http://u:s3cret@host:bad", "http://u:s3cret@"):
        code, out, err = cli(run, "--endpoint", url)
        assert code == 2, (url, err)
        assert "Traceback" not in err and "s3cret" not in err + out
        assert len(err.strip().splitlines()) == 1, err


def test_replay_wrong_protocol_names_the_mismatch(tmp_path: Path) -> None:
    with GrpcOtlpReceiver() as grpc_rx:
        code, out, err = cli(
            make_run(tmp_path), "--endpoint", grpc_rx.endpoint, "--protocol", "http/protobuf"
        )
    assert code == 1
    assert "protocol mismatch" in err and "--protocol grpc" in err, err
    assert "run the same command again" not in err and "\\x00" not in err and "\x00" not in err
    with HttpOtlpReceiver() as http_rx:
        code, out, err = cli(
            make_run(tmp_path / "b"), "--endpoint", http_rx.endpoint, "--protocol", "grpc",
            "--timeout", "3",
        )  # fmt: skip
    assert code == 1
    assert "protocol mismatch" in err and "--protocol http/protobuf" in err, err


def test_file_exporter_run_says_there_is_no_spool(tmp_path: Path) -> None:
    run = make_run(tmp_path, spans=0, exporter="file")
    code, out, err = cli(run, "--endpoint", "http://localhost:4317")
    assert code == 0
    assert "file exporter" in out and "every export was delivered" not in out


def test_a_malformed_header_entry_is_named_by_position_without_its_secret() -> None:
    # `--headers "Authorization: Bearer TOKEN"` (HTTP's colon): the error must not print TOKEN.
    with pytest.raises(ReplayInputError) as info:
        parse_headers("team=ml,Authorization: Bearer S3CR3T")
    assert "S3CR3T" not in str(info.value)
    assert "#2" in str(info.value)


def test_headers_are_percent_decoded_like_otel_exporter_otlp_headers() -> None:
    # The value a run used (OTEL_EXPORTER_OTLP_HEADERS) must authenticate the replay too: the
    # exporter sends "Bearer TOKEN" for it, so replay must not send "Bearer%20TOKEN".
    assert parse_headers("Authorization=Bearer%20TOKEN,x-team=ml") == {
        "authorization": "Bearer TOKEN",
        "x-team": "ml",
    }
