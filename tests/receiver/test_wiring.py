"""When ``mlaunch train`` hosts the OTLP receiver and what the workers are handed: the mode table,
the ``--otlp-relay`` setting (flag, config key), the worker environment (loopback endpoint, the
user's protocol, no secrets), the upstream taken from the user's settings, and a launch whose
receiver cannot start (training goes on)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.otlp import RECEIVER_TOKEN

from mlaunch.launcher import plan as lp
from mlaunch.launcher import receiver_wiring as wiring
from mlaunch.receiver import Receiver
from mlaunch.receiver.upstream import Upstream
from mlaunch.settings import flag_name

CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
EP = "http://collector.example:4317"
OTLP = {"telemetry.exporter": "otlp"}


def build(tmp_path: Path, flags: dict, env: dict | None = None) -> lp.LaunchPlan:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('hi')\n")
    base = {"telemetry.enabled": True, "launch.run_dir": str(tmp_path / "run")}
    if flags.pop("script", True):
        base["launch.script"] = str(script)
    return lp.build_plan(
        flags={**base, **flags}, config=None, environ={**CLEAN, **(env or {})}, cwd=tmp_path
    )


@pytest.mark.parametrize(
    ("flags", "env", "mode"),
    [
        ({}, {}, "embedded"),  # a script, no endpoint: the default
        ({"telemetry.exporter": "otlp"}, {}, "embedded"),  # what the translated plan says
        ({"telemetry.exporter": "console"}, {}, None),
        ({"telemetry.enabled": False}, {}, None),
        ({}, {"OTEL_SDK_DISABLED": "true"}, None),
        ({**OTLP}, {"OTEL_EXPORTER_OTLP_ENDPOINT": EP}, "relay"),  # relay: on for scripts
        ({**OTLP, "launch.otlp_relay": False}, {"OTEL_EXPORTER_OTLP_ENDPOINT": EP}, None),
        # The shipped tiny config says "file", but an endpoint the user set wins over a shipped
        # config's exporter (the seed's env-only configuration): relayed to it.
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": EP}, "relay"),
        ({"script": False}, {}, None),  # mlaunch's trainer: its own file exporter
        ({**OTLP, "script": False}, {"OTEL_EXPORTER_OTLP_ENDPOINT": EP}, None),  # spools itself
        (
            {**OTLP, "script": False, "launch.otlp_relay": True},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": EP},
            "relay",
        ),  # fmt: skip
    ],
)
def test_receiver_mode(tmp_path: Path, flags: dict, env: dict, mode: str | None) -> None:
    assert wiring.receiver_mode(build(tmp_path, dict(flags), env).settings) == mode


def test_otlp_relay_is_a_launch_setting_with_its_flag_and_config_key(tmp_path: Path) -> None:
    assert flag_name("launch.otlp_relay") == "--otlp-relay"
    cfg = tmp_path / "c.toml"
    cfg.write_text('[launch]\notlp_relay = false\n[telemetry]\nenabled = true\nexporter = "otlp"\n')
    (tmp_path / "s.py").write_text("")
    plan = lp.build_plan(
        flags={"launch.script": str(tmp_path / "s.py")}, config=str(cfg),
        environ={**CLEAN, "OTEL_EXPORTER_OTLP_ENDPOINT": EP}, cwd=tmp_path,
    )  # fmt: skip
    assert plan.settings.launch.otlp_relay is False
    assert wiring.receiver_mode(plan.settings) is None


def test_worker_env_points_at_loopback_and_keeps_secrets_in_the_launcher(tmp_path: Path) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": EP,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": EP + "/x",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "k=v",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem",
        "OTEL_EXPORTER_OTLP_INSECURE": "false",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7",
        "OTEL_SERVICE_NAME": "svc",
        "MEGATRON_OTEL_EXPORTER": "otlp",
    }
    rx = Receiver(tmp_path, token=RECEIVER_TOKEN, log=lambda m: None).start()
    try:
        out = wiring.worker_env(rx, env)
    finally:
        rx.close()
    assert out is not None
    assert out["OTEL_EXPORTER_OTLP_ENDPOINT"] == rx.http_endpoint  # the protocol the user chose
    assert out["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert out["OTEL_EXPORTER_OTLP_INSECURE"] == "true"
    for gone in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
                 "OTEL_EXPORTER_OTLP_CERTIFICATE"):  # fmt: skip
        assert gone not in out
    # The workers' only header is the receiver's token (the user's stay for the upstream leg).
    assert out["OTEL_EXPORTER_OTLP_HEADERS"] == f"authorization=Bearer%20{RECEIVER_TOKEN}"
    assert "abc" not in "".join(out.values())
    assert out["OTEL_EXPORTER_OTLP_TIMEOUT"] == "7" and out["OTEL_SERVICE_NAME"] == "svc"
    # The upstream is what the worker's own exporter would have used.
    up = Upstream.from_env(env, "traces")
    assert (up.protocol, up.endpoint, up.headers, up.certificate, up.insecure, up.timeout_s) == (
        "http/protobuf", EP + "/x", {"authorization": "Bearer abc"}, "/ca.pem", False, 7.0
    )  # fmt: skip
    assert Upstream.from_env(env, "metrics").endpoint == EP + "/v1/metrics"
    assert Upstream.from_env(env, "metrics").headers == {"k": "v"}
    assert "abc" not in repr(up) and "abc" not in up.describe()


def test_embedded_mode_points_the_translated_otlp_exporter_at_the_receiver(tmp_path: Path) -> None:
    plan = build(tmp_path, {})
    assert plan.embedded_receiver
    assert plan.child_env[wiring.EXPORTER_KEY] == "otlp"  # translated: nemo-lens has no "file"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in plan.child_env  # filled in at launch
    rx, env = wiring.start(plan)
    try:
        assert rx is not None
        assert env[wiring.EXPORTER_KEY] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == rx.grpc_endpoint
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
        # A fresh token per launch, in the workers' environment only (resolved.env and
        # resolved.json are written from the plan, which never has it).
        assert env["OTEL_EXPORTER_OTLP_HEADERS"] == f"authorization=Bearer%20{rx.token}"
        assert rx.token not in plan.resolved_env_text(True) + plan.resolved_json_text(True)
        assert rx.token not in " ".join(plan.argv)
    finally:
        assert rx is not None
        rx.close()


def test_a_receiver_that_cannot_start_leaves_the_launch_as_planned(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from mlaunch.receiver import frontends

    def broken(_receiver):  # type: ignore[no-untyped-def]
        raise OSError("address in use")

    monkeypatch.setattr(frontends, "GrpcFrontend", broken)
    monkeypatch.setattr(frontends, "HttpFrontend", broken)
    plan = build(tmp_path, {})
    rx, env = wiring.start(plan)
    assert rx is None and env is plan.child_env
    assert "address in use" in capsys.readouterr().err


class _Exited:
    pid = 0

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


@pytest.mark.parametrize("how", ["ok", "failed", "exception"])
def test_execute_closes_the_receiver_on_every_way_out(tmp_path: Path, how: str) -> None:
    """Normal exit, a failed job, an exception in the launcher: the receiver is closed (its
    listeners gone, its counts written) before execute() returns or raises."""
    import socket

    from mlaunch.launcher import run as lrun
    from mlaunch.rundir import layout as lay

    plan = build(tmp_path, {})
    seen: dict = {}

    def spawn(argv, env, log):  # type: ignore[no-untyped-def]
        seen["endpoint"] = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        if how == "exception":
            raise RuntimeError("launcher bug")
        return _Exited(0 if how == "ok" else 1)

    class Display:
        def record(self, record):  # type: ignore[no-untyped-def]
            pass

        def interrupted(self, signum):  # type: ignore[no-untyped-def]
            pass

        def restarted(self, restart, max_restarts):  # type: ignore[no-untyped-def]
            pass

        def worker_output(self, text):  # type: ignore[no-untyped-def]
            pass

    if how == "exception":
        with pytest.raises(RuntimeError):
            lrun.execute(plan, Display, spawn_fn=spawn)
    else:
        result = lrun.execute(plan, Display, spawn_fn=spawn)
        assert result.receiver is not None and result.receiver.mode == "embedded"
    assert lay.receiver_stats_file(plan.run_dir).exists()
    host, port = seen["endpoint"].removeprefix("http://").split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass  # nothing listens any more
