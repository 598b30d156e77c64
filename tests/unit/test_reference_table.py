"""The translation table for ``--script``/``--module`` workers (mlaunch/launcher/lens_names.py):
every row, through the launch plan a real ``mlaunch train`` would run. No process is started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlaunch import envcontract as ec
from mlaunch.launcher import lens_names as ref
from mlaunch.launcher import plan as lp
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spec import format_groups, resolve
from mlaunch.settings import ALIAS_KEYS, OTEL_ENV, SECTIONS, TELEMETRY_KEYS, SettingsError

CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
ON = {"telemetry.enabled": True}
#: The default config (tiny) pins the file exporter; these rows are about a user's collector.
OTLP = {**ON, "telemetry.exporter": "otlp"}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "pretrain_gpt.py"
    path.write_text("")
    return path


def plan(script: Path, flags: dict | None = None, env: dict | None = None, **kw):
    return lp.build_plan(
        flags={"launch.script": str(script), "launch.device": "cpu", **(flags or {})},
        environ={**CLEAN, **(env or {})},
        cwd=script.parent,
        **kw,
    )


def entry(p) -> list[str]:
    """The script's arguments (after the script path)."""
    script = next(a for a in p.argv if a.endswith(".py") and "torch" not in a)
    return p.argv[p.argv.index(script) + 1 :]


def refused(script: Path, flags: dict | None = None, env: dict | None = None) -> dict[str, str]:
    with pytest.raises(SettingsError) as info:
        plan(script, flags, env)
    return dict(info.value.problems)


# ---- the table covers everything -----------------------------------------------------------


def test_every_telemetry_setting_has_a_row():
    covered = {p for rule in ref.RULES for p in rule.paths}
    telemetry = {f"telemetry.{f}" for f in SECTIONS["telemetry"].model_fields if f != "otel"}
    otel = {
        f"telemetry.otel.{f}"
        for f in SECTIONS["telemetry"].model_fields["otel"].annotation.model_fields
    }
    assert telemetry | otel == covered
    settings_of_vars = {f"{s}.{f}" for s, f in OTEL_ENV.values()}
    assert settings_of_vars <= covered
    names = " ".join(rule.setting for rule in ref.RULES)
    for alias in ALIAS_KEYS:
        assert alias in names
    assert "NEMO_LENS_" in names and "CUDA_DEVICE_MAX_CONNECTIONS" in names
    assert all(rule.worker for rule in ref.RULES)
    # a row that can refuse says when, why and what instead (the docs column)
    for rule in ref.RULES:
        if rule.refuse is not ref._never:
            assert rule.refused, rule.setting


def test_docs_train_md_carries_the_table():
    docs = Path(__file__).resolve().parents[2] / "docs" / "train.md"
    assert ref.markdown_table() in docs.read_text()


# ---- ENABLED, service name -------------------------------------------------------------------


def test_enabled_is_passed_and_the_flag_given_only_when_on(script):
    on, off = plan(script, ON), plan(script, {"telemetry.enabled": False})
    assert on.worker_env["MEGATRON_OTEL_ENABLED"] == "true" and "--otel-enabled" in entry(on)
    assert off.worker_env["MEGATRON_OTEL_ENABLED"] == "false" and "--otel-enabled" not in entry(off)


def test_service_name_is_one_argument_even_when_it_starts_with_a_dash(script):
    p = plan(script, {**ON, "telemetry.service_name": "-svc"})
    assert "--otel-service-name=-svc" in entry(p)
    assert p.worker_env["OTEL_SERVICE_NAME"] == "-svc"


# ---- SPAN_GROUPS -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["all,-layer", "goodput", "-layer,all", "default", "per_step,microbatch"]
)
def test_span_spec_is_written_as_the_resolved_group_list(script, spec):
    p = plan(script, {**ON, "telemetry.span_groups": spec})
    groups = format_groups(resolve(spec))
    assert p.worker_env["MEGATRON_OTEL_SPAN_GROUPS"] == groups
    args = entry(p)
    assert f"--otel-span-groups={groups}" in args  # one argv item: never split, never an option
    assert not any(a == "--otel-span-groups" for a in args)
    assert p.resolved_json()["reference"]["span_groups"] == sorted(resolve(spec))


@pytest.mark.parametrize("spec", ["", "all,-all", "-layer"])
def test_a_spec_resolving_to_no_group_is_refused_with_telemetry_on(script, spec):
    problems = refused(script, {**ON, "telemetry.span_groups": spec})
    message = problems["--otel-span-groups"]
    assert "'default'" in message and "--no-otel-traces-enabled" in message


def test_with_telemetry_off_an_empty_spec_writes_nothing(script):
    p = plan(script, {"telemetry.enabled": False, "telemetry.span_groups": ""},
             env={"MEGATRON_OTEL_SPAN_GROUPS": ""})  # fmt: skip
    assert "MEGATRON_OTEL_SPAN_GROUPS" not in p.worker_env
    assert not any(a.startswith("--otel-span-groups") for a in entry(p))


def test_the_trainer_keeps_the_spec_and_empty_groups(tmp_path):
    p = lp.build_plan(flags={"telemetry.span_groups": "all,-layer"}, environ=CLEAN, cwd=tmp_path)
    assert p.worker_env["MEGATRON_OTEL_SPAN_GROUPS"] == "all,-layer"
    assert "reference" not in p.resolved_json()


# ---- EXPORTER --------------------------------------------------------------------------------


def test_file_exporter_becomes_otlp_to_the_embedded_receiver(script):
    p = plan(
        script,
        {**ON, "telemetry.exporter": "file"},
        env={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        },
    )
    assert p.worker_env["MEGATRON_OTEL_EXPORTER"] == "otlp" and p.embedded_receiver
    # the launcher points the workers at its receiver: no user endpoint may win in the SDK
    assert not set(p.worker_env) & set(ec.OTLP_TARGET_VARS)
    assert {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"} <= set(
        p.removed_env
    )
    assert not set(p.child_env) & set(ec.OTLP_TARGET_VARS)
    assert p.resolved_json()["embedded_receiver"] is True


def test_no_endpoint_means_the_embedded_receiver(script):
    p = plan(script, ON)
    assert p.settings.telemetry.exporter == "file" and p.embedded_receiver
    assert any("embedded OTLP receiver" in t for t in ref.translations(p.settings))


@pytest.mark.parametrize("exporter", ["otlp", "console"])
def test_otlp_and_console_are_passed(script, exporter):
    p = plan(script, {**ON, "telemetry.exporter": exporter,
                      "telemetry.otel.base_endpoint": "http://c:4317"})  # fmt: skip
    assert p.worker_env["MEGATRON_OTEL_EXPORTER"] == exporter and not p.embedded_receiver
    if exporter == "otlp":
        assert p.worker_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://c:4317"


def test_none_exporter_is_refused(script):
    problems = refused(script, {**ON, "telemetry.exporter": "none"})
    assert "no 'none' exporter" in problems["--otel-exporter"]


def test_none_exporter_with_telemetry_off_is_harmless(script):
    p = plan(script, {"telemetry.enabled": False, "telemetry.exporter": "none"})
    assert p.worker_env["MEGATRON_OTEL_EXPORTER"] == "otlp" and not p.embedded_receiver


# ---- strategies and aliases -------------------------------------------------------------------


def test_builtin_strategy_is_passed_lower_case(script):
    p = plan(script, ON, env={"MEGATRON_OTEL_EXPORT_STRATEGY": "All_Ranks"})
    assert p.worker_env["MEGATRON_OTEL_EXPORT_STRATEGY"] == "all_ranks"


@pytest.mark.parametrize("enabled", [True, False])
def test_custom_strategy_is_refused_even_with_telemetry_off(script, enabled):
    problems = refused(script, {"telemetry.enabled": enabled},
                       env={"MEGATRON_OTEL_EXPORT_STRATEGY": "builtins:bool"})  # fmt: skip
    message = problems["MEGATRON_OTEL_EXPORT_STRATEGY"]
    assert "registered name" in message and "single_rank" in message


def test_custom_strategy_still_works_for_the_trainer(tmp_path):
    p = lp.build_plan(flags=ON, environ={**CLEAN, "MEGATRON_OTEL_EXPORT_STRATEGY": "builtins:bool"},
                      cwd=tmp_path)  # fmt: skip
    assert p.worker_env["MEGATRON_OTEL_EXPORT_STRATEGY"] == "builtins:bool"


def test_rank_strategy_alias_is_written_as_export_strategy(script):
    p = plan(script, ON, env={"NEMO_LENS_RANK_STRATEGY": "all_ranks"})
    assert p.worker_env["MEGATRON_OTEL_EXPORT_STRATEGY"] == "all_ranks"
    assert "NEMO_LENS_RANK_STRATEGY" in p.removed_env
    assert "NEMO_LENS_RANK_STRATEGY" not in p.child_env
    assert any("RANK_STRATEGY" in t and "EXPORT_STRATEGY=all_ranks" in t
               for t in ref.translations(p.settings))  # fmt: skip


@pytest.mark.parametrize(("value", "written"), [("rank_aware", "true"), ("none", "false")])
def test_sampling_strategy_alias_is_written_as_sampler_enabled(script, value, written):
    p = plan(script, ON, env={"MEGATRON_OTEL_SAMPLING_STRATEGY": value})
    assert p.worker_env["MEGATRON_OTEL_SAMPLER_ENABLED"] == written
    assert "MEGATRON_OTEL_SAMPLING_STRATEGY" in p.removed_env


def test_nemo_lens_fallback_is_written_under_the_primary_prefix(script):
    p = plan(script, ON, env={"NEMO_LENS_EXPORT_RANK": "0", "NEMO_LENS_USER_ID": "team"})
    assert p.worker_env["MEGATRON_OTEL_EXPORT_RANK"] == "0"
    assert p.worker_env["MEGATRON_OTEL_USER_ID"] == "team"
    assert not any(k.startswith("NEMO_LENS_") for k in p.child_env)
    assert any("NEMO_LENS_EXPORT_RANK" in t for t in ref.translations(p.settings))


# ---- plain values -----------------------------------------------------------------------------


def test_rank_rate_and_signal_switches_are_passed(script):
    p = plan(script, {**ON, "telemetry.export_rank": 1, "telemetry.export_sample_rate": 0.5,
                      "telemetry.traces_enabled": False, "telemetry.metrics_enabled": True,
                      "telemetry.logs_enabled": True})  # fmt: skip
    env = p.worker_env
    assert env["MEGATRON_OTEL_EXPORT_RANK"] == "1"
    assert env["MEGATRON_OTEL_EXPORT_SAMPLE_RATE"] == "0.5"
    assert env["MEGATRON_OTEL_TRACES_ENABLED"] == "false"
    assert env["MEGATRON_OTEL_METRICS_ENABLED"] == "true"
    assert env["MEGATRON_OTEL_LOGS_ENABLED"] == "true"


def test_run_id_is_always_the_chosen_one(script):
    p = plan(script, ON)
    assert p.worker_env["MEGATRON_OTEL_RUN_ID"] == p.run_id


def test_empty_user_id_is_not_written(script):
    p = plan(script, ON, env={"MEGATRON_OTEL_USER_ID": "  "})
    assert "MEGATRON_OTEL_USER_ID" not in p.worker_env
    assert "MEGATRON_OTEL_USER_ID" not in p.child_env


def test_logs_over_http_to_an_endpoint_are_refused(script):
    problems = refused(script, {**OTLP, "telemetry.logs_enabled": True},
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})  # fmt: skip
    assert "OTLP/gRPC" in problems["--otel-logs-enabled"]
    plan(
        script,
        {**OTLP, "telemetry.logs_enabled": True},
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
    )  # fmt: skip  (grpc: fine)


# ---- samplers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["traceidratio", "parentbased_traceidratio", "always_off"])
def test_rank_sampler_with_a_dropping_trace_sampler_is_refused(script, sampler):
    problems = refused(script, {**ON, "telemetry.sampler_enabled": True},
                       env={"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0.1"})  # fmt: skip
    assert "replaces OTEL_TRACES_SAMPLER" in problems["--otel-sampler-enabled"]


def test_rank_sampler_is_described_as_replacing_the_trace_sampler(script):
    p = plan(script, {**ON, "telemetry.sampler_enabled": True},
             env={"OTEL_TRACES_SAMPLER": "ALWAYS_ON"})  # fmt: skip
    assert p.worker_env["OTEL_TRACES_SAMPLER"] == "always_on"  # validated, lower case
    text = ref.rank_sampler_text(p.settings)
    assert "replaces the trace sampler" in text and "composed" not in text
    assert any("replaced by nemo-lens's rank-aware" in t for t in ref.translations(p.settings))


def test_trace_sampler_alone_is_passed(script):
    p = plan(
        script, ON, env={"OTEL_TRACES_SAMPLER": "TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    )
    assert p.worker_env["OTEL_TRACES_SAMPLER"] == "traceidratio"
    assert p.worker_env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"


# ---- OTLP protocol and the other OTEL_* ---------------------------------------------------------


def test_http_json_is_accepted_for_a_script(script):
    p = plan(script, OTLP, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                               "OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/JSON"})  # fmt: skip
    assert p.worker_env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/json"
    assert any("protobuf" in t for t in ref.translations(p.settings))


def test_http_json_is_refused_for_the_trainer_only(tmp_path):
    with pytest.raises(SettingsError) as info:
        lp.build_plan(flags={}, environ={**CLEAN, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
                      cwd=tmp_path)  # fmt: skip
    [(field, message)] = info.value.problems
    assert field == "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" and "http/protobuf" in message


def test_other_standard_variables_are_passed(script):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20x",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7",
        "OTEL_RESOURCE_ATTRIBUTES": "team=a",
        "OTEL_METRIC_EXPORT_INTERVAL": "5000",
        "OTEL_SDK_DISABLED": "false",
        "OTEL_BSP_MAX_QUEUE_SIZE": "4096",  # not validated by mlaunch: travels as given
    }
    p = plan(script, OTLP, env=env)
    for var in env:
        assert var in p.worker_env, var
    assert p.worker_env["OTEL_METRIC_EXPORT_INTERVAL"] == "5000"
    assert p.worker_env["OTEL_BSP_MAX_QUEUE_SIZE"] == "4096"


# ---- mlaunch-only keys ------------------------------------------------------------------------


def test_mlaunch_only_keys_are_never_written(script):
    p = plan(script, ON)
    assert "MEGATRON_OTEL_SHUTDOWN_TIMEOUT" not in p.worker_env
    assert "MEGATRON_OTEL_TRACE_SEGMENT_ITERS" not in p.worker_env
    recorder = {k for k in TELEMETRY_KEYS if k.startswith("RECORDER_")}
    assert recorder and not {f"MEGATRON_OTEL_{k}" for k in recorder} & set(p.worker_env)
    mlaunch_only = {"SHUTDOWN_TIMEOUT", "TRACE_SEGMENT_ITERS", "USER_ID", *recorder}
    assert set(TELEMETRY_KEYS) - mlaunch_only <= {
        k.removeprefix("MEGATRON_OTEL_") for k in p.worker_env
    }


@pytest.mark.parametrize(
    ("env", "field", "fragment"),
    [
        ({"MEGATRON_OTEL_SHUTDOWN_TIMEOUT": "30"}, "MEGATRON_OTEL_SHUTDOWN_TIMEOUT", "5 s"),
        (
            {"MEGATRON_OTEL_TRACE_SEGMENT_ITERS": "10"},
            "MEGATRON_OTEL_TRACE_SEGMENT_ITERS",
            "--save-interval",
        ),
    ],
)
def test_mlaunch_only_keys_are_refused_when_set(script, env, field, fragment):
    assert fragment in refused(script, ON, env=env)[field]


def test_the_recorder_reaches_script_workers_and_the_summary_says_nemo_lens_has_none(script):
    # A --script may use mlaunch.telemetry, whose flight recorder reads these; nemo-lens ignores
    # keys it does not know. They were refused for every script before.
    p = plan(script, {**ON, "telemetry.recorder_groups": "all,-layer",
                      "telemetry.recorder_iters": 7})  # fmt: skip
    assert p.worker_env["MEGATRON_OTEL_RECORDER_GROUPS"] == format_groups(resolve("all,-layer"))
    assert p.worker_env["MEGATRON_OTEL_RECORDER_ITERS"] == "7"
    assert p.worker_env["MEGATRON_OTEL_RECORDER_MAX_MIB"] == "64.0"
    assert p.worker_env["MEGATRON_OTEL_RECORDER_SLOW_FACTOR"] == "2.0"
    [line] = [t for t in ref.translations(p.settings) if "flight recorder" in t]
    assert "mlaunch.telemetry" in line and "nemo-lens (Megatron-LM) worker has no flight" in line
    assert line in p.resolved_json()["reference"]["translations"]


def test_recorder_settings_without_recorder_groups_write_nothing(script):
    p = plan(script, ON, env={"MEGATRON_OTEL_RECORDER_ITERS": "5"})
    assert not [k for k in p.worker_env if "RECORDER" in k]
    assert not [t for t in ref.translations(p.settings) if "flight recorder" in t]


def test_shutdown_timeout_of_five_seconds_is_what_the_reference_does(script):
    plan(script, ON, env={"MEGATRON_OTEL_SHUTDOWN_TIMEOUT": "5"})


def test_a_refused_setting_creates_nothing(script):
    refused(script, ON, env={"MEGATRON_OTEL_EXPORT_STRATEGY": "builtins:bool"})
    assert not (script.parent / "runs").exists()


def test_otel_flags_after_double_dash_would_shadow_the_translation(script):
    with pytest.raises(SettingsError) as info:
        plan(script, ON, passthrough=["--otel-span-groups=all,-layer"])
    assert "--otel-span-groups" in info.value.problems[0][1]


# ---- CUDA_DEVICE_MAX_CONNECTIONS and context parallel --------------------------------------------


@pytest.mark.parametrize(
    ("flags", "value"),
    [
        ({"parallelism.tensor_model_parallel_size": 2}, "1"),
        ({"parallelism.context_parallel_size": 2}, "1"),
        ({}, None),
    ],
)
def test_cuda_device_max_connections_is_set_for_tensor_or_context_parallel(script, flags, value):
    p = plan(script, {**flags, "training.global_batch_size": 4})
    assert p.worker_env.get("CUDA_DEVICE_MAX_CONNECTIONS") == value
    assert bool(p.env_notes) == (value is not None)


def test_a_users_cuda_device_max_connections_is_kept(script):
    p = plan(script, {"parallelism.tensor_model_parallel_size": 2, "training.global_batch_size": 4},
             env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"})  # fmt: skip
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in p.worker_env
    assert p.child_env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert "yours" in p.env_notes[0]


def test_context_parallel_reaches_megatron_and_divides_the_world(script):
    p = plan(script, {"parallelism.context_parallel_size": 2, "training.global_batch_size": 4})
    args = entry(p)
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert p.settings.data_parallel_size == 1
    assert "--context-parallel-size" not in entry(plan(script, {}))


def test_the_trainer_refuses_context_parallel(tmp_path):
    with pytest.raises(SettingsError) as info:
        lp.build_plan(flags={"parallelism.context_parallel_size": 2}, environ=CLEAN, cwd=tmp_path)
    assert "context parallel size 1" in info.value.problems[0][1]


# ---- span names -------------------------------------------------------------------------------


def test_reference_span_names_leave_out_mlaunch_extras(monkeypatch):
    from mlaunch.model import spans

    names = ref.reference_span_names(SpanGroup)
    assert names == [d.name for d in spans.CATALOGUE if not d.extra]
    extra = spans.CATALOGUE[0]
    marked = tuple(
        d
        if d is not extra
        else type(d)(**{**{f: getattr(d, f) for f in d.__slots__}, "extra": True})
        for d in spans.CATALOGUE
    )
    monkeypatch.setattr(ref, "CATALOGUE", marked)
    assert extra.name not in ref.reference_span_names(SpanGroup)


# ---- the dry run ------------------------------------------------------------------------------


def test_dry_run_of_a_script_shows_translations_receiver_and_span_names(script, monkeypatch):
    from typer.testing import CliRunner

    from mlaunch.cli import build_app
    from mlaunch.model.spans import CATALOGUE

    monkeypatch.chdir(script.parent)
    monkeypatch.setenv("COLUMNS", "300")  # one line per row: the assertions read whole lines
    result = CliRunner().invoke(
        build_app("train"),
        ["train", "--script", str(script), "--otel-span-groups", "goodput", "--dry-run",
         "--tensor-model-parallel-size", "2", "--global-batch-size", "4"],
        env={**CLEAN, "MEGATRON_OTEL_RANK_STRATEGY": "single_rank"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    assert "otlp -> embedded OTLP receiver on loopback ->" in out and "/telemetry" in out
    assert "span groups 'goodput' -> job,checkpoint,model_init" in out
    assert "MEGATRON_OTEL_RANK_STRATEGY -> MEGATRON_OTEL_EXPORT_STRATEGY=single_rank" in out
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 set" in out
    assert "span names the worker will emit" in out
    on = [d.name for d in CATALOGUE if d.group in resolve("goodput") and not d.extra]
    off = [d.name for d in CATALOGUE if d.group not in resolve("goodput")]
    assert all(name in out for name in on)
    assert not any(f" {name}," in out or f" {name}\n" in out for name in off)
    assert "--otel-span-groups=job,checkpoint,model_init" in out
    assert not (script.parent / "runs").exists()
