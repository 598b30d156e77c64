"""``mlaunch doctor`` end to end through the Typer app: exit codes, the text report, the pinned
JSON shape, and a new user's broken environment named problem by problem."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.otlp import GrpcOtlpReceiver, closed_port_endpoint
from support.peers import Listener
from typer.testing import CliRunner

from mlaunch.cli import app

LEAKY_PREFIXES = ("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "KUBERNETES_", "K8S_", "POD_")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No variable of the developer's shell reaches the assertions; ./runs lands in tmp."""
    for name in list(os.environ):
        if name.startswith(LEAKY_PREFIXES) or name in ("NODE_NAME", "MLAUNCH_RUN_DIR"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


class _Answered:
    """A torch probe that has already answered, with a real probe's recorded output."""

    def __init__(self, answer: tuple[int | None, str, str]) -> None:
        self.answer = answer

    def wait(self, timeout_s: float) -> tuple[int | None, str, str]:
        return self.answer

    def kill(self) -> None:
        pass


@pytest.fixture(scope="module")
def torch_answer() -> tuple[int | None, str, str]:
    """What doctor's torch subprocess answers on this machine, asked once for the module."""
    from mlaunch.doctor.process import ProbeProcess
    from mlaunch.doctor.torch_probe import _TORCH_PROBE, TORCH_TIMEOUT_S, _worker_env

    return ProbeProcess([sys.executable, "-c", _TORCH_PROBE], _worker_env()).wait(TORCH_TIMEOUT_S)


@pytest.fixture
def asked_once(monkeypatch: pytest.MonkeyPatch, torch_answer) -> None:
    """The tests here that are not about torch get the real probe's answer, asked once: each
    probe imports torch (about 2.5 CPU-s), and the healthy test still runs its own."""
    from mlaunch.doctor import torch_probe

    real = torch_probe.ProbeProcess

    def probe(argv, env=None):
        return _Answered(torch_answer) if argv[-1] == torch_probe._TORCH_PROBE else real(argv, env)

    monkeypatch.setattr(torch_probe, "ProbeProcess", probe)


def doctor(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(app, ["doctor", *args], env=env or {})
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_healthy_setup_passes_with_exit_zero() -> None:
    with GrpcOtlpReceiver() as rx:
        # EXPORTER: plain doctor checks tiny (plain train's config), whose exporter is "file"
        result = doctor(
            env={
                "MEGATRON_OTEL_ENABLED": "true",
                "MEGATRON_OTEL_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            }
        )
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.stdout
    assert "answers an empty trace export as an OTLP/gRPC receiver" in result.stdout
    assert result.stdout.rstrip().endswith(", 0 failed")


@pytest.mark.usefixtures("asked_once")
def test_broken_environment_names_each_problem_and_its_fix() -> None:
    env = {
        "MEGATRON_OTEL_ENABLED": "true",
        "MEGATRON_OTEL_SPAN_GRUOPS": "per_step",
        "MEGATRON_OTEL_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": closed_port_endpoint(),
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "1.5",
    }
    result = doctor(env=env)
    assert result.exit_code == 1
    out = result.stdout
    assert "MEGATRON_OTEL_SPAN_GRUOPS is not a telemetry variable" in out
    assert "fix: rename MEGATRON_OTEL_SPAN_GRUOPS to MEGATRON_OTEL_SPAN_GROUPS" in out
    assert "OTEL_TRACES_SAMPLER_ARG: expected a ratio in [0, 1], got '1.5'" in out
    assert "fix: set OTEL_TRACES_SAMPLER_ARG to a ratio in [0, 1]" in out
    assert "connection refused" in out and "nothing listens there" in out
    assert out.rstrip().endswith("3 failed")


@pytest.mark.usefixtures("asked_once")
def test_json_shape_is_pinned() -> None:
    result = doctor("--json", env={"OTEL_TRACES_SAMPLER": "nope"})
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert set(data) == {"checks", "summary"}
    assert set(data["summary"]) == {"pass", "warn", "fail"}
    for check in data["checks"]:
        assert set(check) == {"name", "status", "message", "fix"}
        assert check["status"] in ("pass", "warn", "fail")
        assert all(isinstance(v, str) for v in check.values())
    for status in ("pass", "warn", "fail"):
        assert data["summary"][status] == sum(c["status"] == status for c in data["checks"])
    names = [c["name"] for c in data["checks"]]
    for expected in ("python", "torch", "torch import", "gloo", "sampler", "otlp endpoint",
                     "hostname", "rendezvous port", "run directory", "disk space", "slurm",
                     "kubernetes", "hang stacks"):  # fmt: skip
        assert expected in names
    sampler = next(c for c in data["checks"] if c["name"] == "sampler")
    assert sampler["status"] == "fail" and "nope" in sampler["message"]


@pytest.mark.usefixtures("asked_once")
def test_plain_doctor_checks_the_config_plain_train_runs() -> None:
    # Plain `mlaunch train` runs tiny (telemetry on, all_ranks, file exporter, cpu): so does
    # plain doctor.
    data = json.loads(doctor("--json").stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert "tiny.toml" in checks["configuration"]["message"]
    telemetry = checks["telemetry"]["message"]
    assert telemetry.startswith("enabled (with tiny.toml); exporter file")
    assert "strategy all_ranks" in telemetry
    assert checks["otlp endpoint"]["status"] == "pass"  # the file exporter needs no collector
    assert checks["cuda"]["status"] == "pass"  # tiny's device is cpu: no CUDA needed


@pytest.mark.usefixtures("asked_once")
def test_the_seeds_env_only_configuration_is_probed_at_its_endpoint() -> None:
    # The seed's minimal configuration, nothing else: the endpoint the user set wins over the
    # shipped tiny.toml's exporter = "file", as in `mlaunch train`, so doctor probes it (a real
    # OTLP export to a real receiver).
    with GrpcOtlpReceiver() as rx:
        env = {
            "MEGATRON_OTEL_ENABLED": "1",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "MEGATRON_OTEL_SPAN_GROUPS": "default",
        }
        data = json.loads(doctor("--json", env=env).stdout)
        probes = len(rx.headers)  # one per request it answered
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["telemetry"]["message"].startswith("enabled (with tiny.toml); exporter otlp")
    endpoint = checks["otlp endpoint"]
    assert endpoint["status"] == "pass", endpoint
    assert probes >= 1  # the probe's export reached the receiver


@pytest.mark.usefixtures("asked_once")
def test_an_endpoint_the_users_own_configs_exporter_leaves_unused_is_a_warning(
    tmp_path: Path,
) -> None:
    # The user's own config file chose the file exporter: the endpoint from the environment does
    # not override that choice; doctor says the run will not send there.
    (tmp_path / "mine.toml").write_text('[telemetry]\nenabled = true\nexporter = "file"\n')
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    data = json.loads(doctor("--json", "--config", "mine.toml", env=env).stdout)
    endpoint = {c["name"]: c for c in data["checks"]}["otlp endpoint"]
    assert endpoint["status"] == "warn" and "is configured but not used" in endpoint["message"]
    assert "exporter is 'file' from" in endpoint["message"] and "mine.toml" in endpoint["message"]


def test_missing_config_file_is_a_bad_invocation(tmp_path: Path) -> None:
    result = doctor("--config", str(tmp_path / "nope.toml"))
    assert result.exit_code == 2
    # The same lookup and message as `mlaunch train --config`.
    assert result.stderr.startswith("--config: no config file")
    assert "shipped: " in result.stderr


@pytest.mark.usefixtures("asked_once")
def test_rdzv_endpoint_is_checked_as_train_checks_it_before_a_launch() -> None:
    def rendezvous(*args: str, env: dict[str, str] | None = None) -> dict[str, str]:
        data = json.loads(doctor("--json", *args, env=env).stdout)
        return next(c for c in data["checks"] if c["name"] == "rendezvous port")

    bad = rendezvous("--rdzv-endpoint", "badhost.invalid:29500")  # .invalid never resolves
    with Listener() as busy:  # a real socket holding the port
        held = rendezvous("--rdzv-endpoint", f"127.0.0.1:{busy.port}")
        joins = rendezvous(
            "--rdzv-endpoint", f"127.0.0.1:{busy.port}", "--nnodes", "2", "--node-rank", "1"
        )
        # Under SLURM, the launcher's own derivation: the job's first node, MASTER_PORT.
        slurm = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost,n2",
                 "MASTER_PORT": str(busy.port)}  # fmt: skip
        head = rendezvous(env={**slurm, "SLURM_NODEID": "0"})
        second = rendezvous(env={**slurm, "SLURM_NODEID": "1"})
    assert bad["status"] == "fail"
    assert "the rendezvous host 'badhost.invalid' does not resolve" in bad["message"]
    assert held["status"] == "fail" and f"port {busy.port} is in use" in held["message"]
    assert f"held by pid {os.getpid()}" in held["message"]  # this test process holds it
    assert "pick another port in --rdzv-endpoint" in held["fix"]
    # Node 1 only connects to the store node 0 hosts: the port taken is the store, reachable.
    assert joins["status"] == "pass" and "is reachable" in joins["message"]
    assert head["status"] == "fail" and f"localhost:{busy.port}" in head["message"]
    assert "MASTER_PORT" in head["fix"]
    assert second["status"] == "pass" and "is reachable" in second["message"]


def test_a_malformed_rendezvous_flag_is_a_bad_invocation() -> None:
    result = doctor("--rdzv-endpoint", "nohost")
    assert result.exit_code == 2
    assert result.stderr == "--rdzv-endpoint: 'nohost' is not host:port (e.g. 127.0.0.1:29500)\n"


@pytest.mark.usefixtures("asked_once")
def test_config_accepts_a_shipped_configs_name(tmp_path: Path) -> None:
    data = json.loads(doctor("--config", "pp2", "--json").stdout)
    config = [c for c in data["checks"] if c["name"] == "configuration"]
    assert config and config[0]["status"] == "pass"
    assert "pp2.toml" in config[0]["message"]


@pytest.mark.usefixtures("asked_once")
def test_the_megatron_config_passes_with_the_script_train_would_launch(tmp_path: Path) -> None:
    # Doctor took no --script, so the shipped megatron config (tensor parallel 2) always failed
    # with "mlaunch's trainer supports tensor parallel size 1 only; use --script".
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "train_me.py").write_text("")

    def config_checks(*args: str) -> list[dict]:
        data = json.loads(doctor("--config", "megatron", *args, "--json").stdout)
        return [c for c in data["checks"] if c["name"] in ("configuration", "config")]

    bare = config_checks()
    assert any("tensor parallel size 1 only" in c["message"] for c in bare)
    (checked,) = config_checks("--script", "pretrain_gpt.py")
    assert checked["status"] == "pass" and "megatron.toml" in checked["message"]
    (missing,) = config_checks("--script", "nope.py")
    assert missing["status"] == "fail"
    assert missing["message"] == "--script: script 'nope.py' does not exist or is not a file"
    (module,) = config_checks("--module", "train_me")
    assert module["status"] == "pass"


@pytest.mark.usefixtures("asked_once")
def test_config_file_that_fails_validation_is_a_failed_check(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[telemetry\nspan_groups = 'all'\n")
    result = doctor("--config", str(bad), "--json")
    assert result.exit_code == 1
    fails = [c for c in json.loads(result.stdout)["checks"] if c["status"] == "fail"]
    assert any("not valid TOML" in c["message"] for c in fails)


@pytest.mark.usefixtures("asked_once")
def test_otlp_headers_never_reach_the_output() -> None:
    with GrpcOtlpReceiver() as rx:
        env = {
            "MEGATRON_OTEL_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20sup3rs3cret",
        }
        text = doctor(env=env)
        as_json = doctor("--json", env=env)
    assert rx.headers and rx.headers[-1]["authorization"] == "Bearer sup3rs3cret"
    for result in (text, as_json):
        assert result.exit_code == 0, result.output  # nothing fails: exit 0, in both modes
        assert "sup3rs3cret" not in result.output
    assert json.loads(as_json.stdout)["summary"]["fail"] == 0
    assert "OTEL_EXPORTER_OTLP_HEADERS=<redacted>" in text.stdout


_PROBE = """
import contextlib, io, json, sys
sys.argv = ["mlaunch", "doctor", "--json"]
from mlaunch.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit:
        pass
print(json.dumps(sorted(sys.modules)))
"""


def test_doctor_never_imports_torch_or_the_sdk_in_process(tmp_path: Path) -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=tmp_path,
        check=True,
    )  # fmt: skip
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "grpc", "numpy")]
    heavy += [m for m in modules if m.startswith("opentelemetry.sdk")]
    assert heavy == []
