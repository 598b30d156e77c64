"""Doctor checks that need no peer and no torch: versions, configuration, run directory,
SLURM/Kubernetes, host name, and the result shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlaunch.doctor.configuration import check_configuration
from mlaunch.doctor.host import (
    check_hostname,
    check_kubernetes,
    check_run_dir,
    check_slurm,
    checkpoint_bytes,
)
from mlaunch.doctor.packages import check_packages, check_python, satisfies
from mlaunch.doctor.results import CheckResult, exit_code, summarize, to_json
from mlaunch.launcher.cluster_env import expand_nodelist
from mlaunch.settings import load_settings


def named(results: list[CheckResult], name: str) -> list[CheckResult]:
    return [r for r in results if r.name == name]


def only(results: list[CheckResult], name: str) -> CheckResult:
    found = named(results, name)
    assert len(found) == 1, (name, results)
    return found[0]


def statuses(results: list[CheckResult]) -> set[str]:
    return {r.status for r in results}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# --- versions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("2.13.0+cpu", ">=2.3,<2.15", True),
        ("2.15.0", ">=2.3,<2.15", False),
        ("1.24.9", ">=1.25,<2", False),
        ("1.45.2", ">=1.25,<2", True),
        ("2.13.0+cpu", "==2.13.0", True),
        ("2.4.6", ">=1.26", True),
        ("", ">=1", False),
    ],
)
def test_version_ranges_compare_release_numbers(version: str, spec: str, expected: bool) -> None:
    assert satisfies(version, spec) is expected


def test_installed_packages_are_within_the_declared_ranges() -> None:
    results = check_packages()
    assert statuses(results) == {"pass"}, results
    assert {r.name for r in results} >= {"torch", "numpy", "opentelemetry-sdk", "mlaunch"}


def test_incompatible_torch_fails_with_the_tested_install_command() -> None:
    [result] = check_packages(["torch"], ranges={"torch": ">=99"})
    assert result.status == "fail"
    assert "outside the supported range >=99" in result.message
    assert result.fix == "pip install 'torch==2.13.0'"


def test_missing_package_fails_with_its_install_command() -> None:
    [result] = check_packages(["no-such-dist-mlaunch"], ranges={"no-such-dist-mlaunch": ">=1,<2"})
    assert result.status == "fail"
    assert "not installed" in result.message
    assert result.fix == "pip install 'no-such-dist-mlaunch>=1,<2'"


def test_old_python_fails() -> None:
    [result] = check_python((3, 9, 18))
    assert result.status == "fail"
    assert "3.9.18" in result.message and ">=3.11" in result.message


def test_this_python_passes() -> None:
    assert check_python()[0].status == "pass"


# --- configuration --------------------------------------------------------------------------


def test_empty_environment_is_a_valid_configuration() -> None:
    results, settings = check_configuration({})
    assert statuses(results) == {"pass"}, results
    assert "defaults apply" in only(results, "configuration").message
    assert settings.telemetry.exporter == "file"


def test_misspelled_variable_fails_with_did_you_mean_and_a_rename() -> None:
    results, _ = check_configuration({"MEGATRON_OTEL_ENABLD": "true"})
    result = only(results, "unknown variable")
    assert result.status == "fail"
    assert "did you mean MEGATRON_OTEL_ENABLED?" in result.message
    assert result.fix == "rename MEGATRON_OTEL_ENABLD to MEGATRON_OTEL_ENABLED"
    assert not named(results, "configuration")  # not reported as valid


def test_near_miss_of_a_standard_otel_variable_warns() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPIONT": "http://127.0.0.1:4317", "OTEL_PYTHON_LOG_LEVEL": "x"}
    results, _ = check_configuration(env)
    result = only(results, "unknown variable")
    assert result.status == "warn"
    assert "did you mean OTEL_EXPORTER_OTLP_ENDPOINT?" in result.message
    assert result.fix == "rename OTEL_EXPORTER_OTLP_ENDPIONT to OTEL_EXPORTER_OTLP_ENDPOINT"


def test_every_problem_is_reported_at_once() -> None:
    results, _ = check_configuration(
        {
            "NEMO_LENS_SPAN_GROUP": "all",
            "OTEL_TRACES_SAMPLER": "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "1.5",
            "MEGATRON_OTEL_EXPORT_STRATEGY": "single_rnk",
        }
    )
    fails = [r for r in results if r.status == "fail"]
    text = "\n".join(r.message for r in fails)
    assert "NEMO_LENS_SPAN_GROUP" in text and "NEMO_LENS_SPAN_GROUPS" in text
    assert "OTEL_TRACES_SAMPLER_ARG" in text and "1.5" in text
    assert "single_rnk" in text and "single_rank" in text


def test_differing_values_under_both_prefixes_warn_and_name_the_winner() -> None:
    env = {"MEGATRON_OTEL_SPAN_GROUPS": "all", "NEMO_LENS_SPAN_GROUPS": "per_step"}
    results, settings = check_configuration(env)
    result = only(results, "prefix conflict")
    assert result.status == "warn"
    assert "MEGATRON_OTEL_SPAN_GROUPS wins" in result.message
    assert result.fix.startswith("unset NEMO_LENS_SPAN_GROUPS")
    assert settings.telemetry.span_groups == "all"  # and the settings agree on the winner


def test_equal_values_under_both_prefixes_do_not_warn() -> None:
    results, _ = check_configuration({"MEGATRON_OTEL_ENABLED": "true", "NEMO_LENS_ENABLED": "1"})
    assert not named(results, "prefix conflict")


def test_alias_under_one_prefix_conflicting_with_the_other_prefix_warns() -> None:
    env = {"MEGATRON_OTEL_RANK_STRATEGY": "all_ranks", "NEMO_LENS_EXPORT_STRATEGY": "single_rank"}
    results, settings = check_configuration(env)
    assert "MEGATRON_OTEL_RANK_STRATEGY wins" in only(results, "prefix conflict").message
    assert settings.telemetry.export_strategy == "all_ranks"


def test_rank_strategy_alias_is_honoured_and_noted_as_ignored_by_the_reference() -> None:
    results, settings = check_configuration({"MEGATRON_OTEL_RANK_STRATEGY": "all_ranks"})
    note = only(results, "alias")
    assert note.status == "pass"
    assert "ignores RANK_STRATEGY" in note.message
    assert "MEGATRON_OTEL_EXPORT_STRATEGY" in note.fix
    assert settings.telemetry.export_strategy == "all_ranks"


def test_sdk_disabled_while_telemetry_is_enabled_warns() -> None:
    results, settings = check_configuration(
        {"MEGATRON_OTEL_ENABLED": "1", "OTEL_SDK_DISABLED": "true"}
    )
    assert only(results, "sdk disabled").status == "warn"
    # Resolved as telemetry off with the variable named, not "enabled" beside a warning.
    assert not settings.telemetry.enabled
    telemetry = only(results, "telemetry")
    assert telemetry.message.startswith("disabled by OTEL_SDK_DISABLED=true")
    assert "unset it" in telemetry.fix and "ENABLED=true" not in telemetry.fix
    results, _ = check_configuration({"OTEL_SDK_DISABLED": "true"})
    assert not named(results, "sdk disabled")


def test_sampler_ratio_outside_zero_one_fails() -> None:
    env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}
    results, _ = check_configuration(env)
    result = only(results, "sampler")
    assert result.status == "fail"
    assert "1.5" in result.message
    assert "[0, 1]" in result.fix


def test_unknown_sampler_fails_with_did_you_mean() -> None:
    results, _ = check_configuration({"OTEL_TRACES_SAMPLER": "traceidratoi"})
    result = only(results, "sampler")
    assert result.status == "fail"
    assert "did you mean 'traceidratio'" in result.message


def test_sampler_argument_without_a_ratio_sampler_warns() -> None:
    results, _ = check_configuration({"OTEL_TRACES_SAMPLER_ARG": "0.1"})
    assert only(results, "sampler").status == "warn"


def test_trace_and_rank_samplers_compose_in_the_report() -> None:
    env = {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
        "MEGATRON_OTEL_SAMPLER_ENABLED": "true",
        "MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "0.1",
    }
    results, _ = check_configuration(env)
    result = only(results, "sampler")
    assert result.status == "pass"
    assert "about 0.01 of traces kept" in result.message


def test_otlp_timeout_that_looks_like_milliseconds_warns() -> None:
    results, _ = check_configuration({"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"})
    result = only(results, "otlp timeout")
    assert result.status == "warn"
    assert "milliseconds" in result.message and "seconds" in result.message
    assert result.fix == "set OTEL_EXPORTER_OTLP_TIMEOUT=10 (seconds)"
    results, _ = check_configuration({"OTEL_EXPORTER_OTLP_TIMEOUT": "10"})
    assert only(results, "otlp timeout").status == "pass"
    # Above 600 s, as mlaunch train's summary warns (one rule: settings.otlp_timeout_warning).
    results, _ = check_configuration({"OTEL_EXPORTER_OTLP_TIMEOUT": "601"})
    assert only(results, "otlp timeout").status == "warn"
    results, _ = check_configuration({"OTEL_EXPORTER_OTLP_TIMEOUT": "600"})
    assert only(results, "otlp timeout").status == "pass"


def test_exporting_ranks_follow_the_configured_world_size(tmp_path: Path) -> None:
    config = write(tmp_path, "[launch]\nnnodes = 2\nnproc_per_node = 4\n")
    env = {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORT_STRATEGY": "first_rank_per_node"}
    results, _ = check_configuration(env, config)
    result = only(results, "exporting ranks")
    assert result.status == "pass"
    assert "rank(s) 0, 4 of world size 8 (2 node(s) x 4)" in result.message
    results, _ = check_configuration({**env, "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks"}, config)
    assert "rank(s) 0-7 of world size 8" in only(results, "exporting ranks").message


def test_a_sampled_strategy_that_exports_no_rank_warns() -> None:
    env = {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_EXPORT_STRATEGY": "sampled",
        "MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "0",
    }
    results, _ = check_configuration(env)
    assert only(results, "exporting ranks").status == "warn"


def test_config_file_that_fails_validation_is_a_failed_check(tmp_path: Path) -> None:
    config = write(tmp_path, "[telemetry]\nspan_group = 'all'\n[model]\nnum_layers = 0\n")
    results, settings = check_configuration({}, config)
    fails = [r for r in results if r.status == "fail"]
    assert any("span_group" in r.message and "span_groups" in r.message for r in fails)
    assert settings is not None  # the other checks still get settings to work with


def test_valid_parts_survive_a_bad_variable_for_the_other_checks() -> None:
    env = {
        "OTEL_TRACES_SAMPLER_ARG": "1.5",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4999",
    }
    _, settings = check_configuration(env)
    assert settings.telemetry.otel.endpoint == "http://127.0.0.1:4999"
    assert settings.telemetry.exporter == "otlp"


# --- run directory --------------------------------------------------------------------------


def test_run_dir_under_a_regular_file_fails(tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("not a directory")
    config = write(tmp_path, f"[launch]\nrun_dir = '{tmp_path / 'file.txt' / 'runs'}'\n")
    settings = load_settings(environ={}, config=config)
    [result] = check_run_dir(settings, cwd=tmp_path)
    assert result.status == "fail"
    assert "file.txt is a file, not a directory" in result.message
    assert "run_dir" in result.fix


def test_default_run_dir_is_checked_without_being_created(tmp_path: Path) -> None:
    results = check_run_dir(load_settings(environ={}), cwd=tmp_path)
    assert statuses(results) == {"pass"}, results
    assert str(tmp_path / "runs") in only(results, "run directory").message
    assert list(tmp_path.iterdir()) == []  # doctor leaves nothing behind


def test_run_dir_and_save_expand_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As mlaunch train does: "~/runs" is under the home directory, not a folder named "~".
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    config = write(tmp_path, "[launch]\nrun_dir = '~/runs'\n[training]\nsave = '~/ckpt'\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    results = check_run_dir(load_settings(environ={}, config=config), cwd=cwd)
    assert statuses(results) == {"pass"}, results
    assert f"{home / 'runs'} (to be created in {home})" in only(results, "run directory").message
    assert f"free at {home};" in only(results, "disk space").message
    assert list(cwd.iterdir()) == []


def test_a_run_dir_name_too_long_for_the_os_is_a_failed_check(tmp_path: Path) -> None:
    config = write(tmp_path, f"[launch]\nrun_dir = '{'r' * 5000}'\n")
    [result] = check_run_dir(load_settings(environ={}, config=config), cwd=tmp_path)
    assert result.status == "fail"
    assert "cannot use" in result.message and "(5" in result.message  # quoted, cut short
    assert len(result.message) < 300
    assert "run_dir" in result.fix


def test_checkpoints_larger_than_the_free_space_fail(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "[model]\nnum_layers = 1000\nhidden_size = 1000000\n[training]\nsave_interval = 10\n",
    )
    results = check_run_dir(load_settings(environ={}, config=config), cwd=tmp_path)
    result = only(results, "disk space")
    assert result.status == "fail"
    assert "2 checkpoint(s)" in result.message and "keep_last" in result.fix


def test_checkpoint_estimate_counts_the_trainers_exact_parameters() -> None:
    settings = load_settings(environ={})  # L=2, h=64, seq=64, keep_last=2
    params, size = checkpoint_bytes(settings)
    # Per layer 12h² + 13h; token and position embeddings; the final norm; the head is tied.
    assert params == 2 * (12 * 64**2 + 13 * 64) + (256 + 64) * 64 + 2 * 64 == 120_576
    assert size == params * 12 * 2


# --- SLURM / Kubernetes / host name ---------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node01", "node01"),
        ("node[01-04,07]", "node01"),
        ("gpu[07-09],cpu1", "gpu07"),
        ("cpu1,gpu[1-2]", "cpu1"),
        ("rack[2-3]-node[010-012]", "rack2-node010"),
        ("n[5,1-3]", "n5"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert expand_nodelist(nodelist)[0] == first


def test_slurm_values_mlaunch_derives() -> None:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-09],cpu1",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "1",
    }
    [result] = check_slurm(env, load_settings(environ={}))
    assert result.status == "pass"
    assert result.message == (
        "SLURM job 4242: nnodes=4, node rank=1, rendezvous host=gpu07, rendezvous id=4242"
    )


def test_slurm_without_a_node_list_warns() -> None:
    [result] = check_slurm({"SLURM_JOB_ID": "7"}, load_settings(environ={}))
    assert result.status == "warn" and "--rdzv-endpoint" in result.fix


def test_explicit_nnodes_that_contradicts_slurm_warns(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3"}
    settings = load_settings(environ={}, config=write(tmp_path, "[launch]\nnnodes = 2\n"))
    [result] = check_slurm(env, settings)
    assert result.status == "warn" and "nnodes=2" in result.message
    assert "3 nodes" in result.fix


def test_outside_slurm_and_kubernetes_passes() -> None:
    assert check_slurm({}, load_settings(environ={}))[0].status == "pass"
    assert check_kubernetes({})[0].status == "pass"


def test_kubernetes_names_from_the_downward_api(tmp_path: Path) -> None:
    env = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "POD_NAME": "trainer-0",
        "POD_NAMESPACE": "ml",
        "NODE_NAME": "node-a",
    }
    [result] = check_kubernetes(env, namespace_file=tmp_path / "absent")
    assert result.status == "pass"
    assert result.message == "Kubernetes: pod=trainer-0, namespace=ml, node=node-a"


def test_kubernetes_without_node_name_warns_and_reads_the_namespace_file(tmp_path: Path) -> None:
    ns = tmp_path / "namespace"
    ns.write_text("research\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "trainer-1"}
    [result] = check_kubernetes(env, namespace_file=ns)
    assert result.status == "warn"
    assert "pod=trainer-1, namespace=research, node=?" in result.message
    assert "NODE_NAME" in result.fix and "downward API" in result.fix


def test_host_name_resolution() -> None:
    assert check_hostname("localhost")[0].status == "pass"
    [bad] = check_hostname("no-such-host.invalid")
    assert bad.status == "fail" and "/etc/hosts" in bad.fix


# --- shape ----------------------------------------------------------------------------------


def test_json_shape_summary_and_exit_code() -> None:
    results = [
        CheckResult("a", "pass", "fine"),
        CheckResult("b", "warn", "hmm", "do x"),
        CheckResult("c", "fail", "bad", "do y"),
    ]
    assert to_json(results) == {
        "checks": [
            {"name": "a", "status": "pass", "message": "fine", "fix": ""},
            {"name": "b", "status": "warn", "message": "hmm", "fix": "do x"},
            {"name": "c", "status": "fail", "message": "bad", "fix": "do y"},
        ],
        "summary": {"pass": 1, "warn": 1, "fail": 1},
    }
    assert summarize(results[:2]) == {"pass": 1, "warn": 1, "fail": 0}
    assert exit_code(results[:2]) == 0
    assert exit_code(results) == 1


def test_a_crashing_check_becomes_a_failed_result() -> None:
    from mlaunch.doctor import _guard

    def broken() -> list[CheckResult]:
        raise RuntimeError("boom")

    [result] = _guard("broken", broken)
    assert result.status == "fail"
    assert result.message == "the check itself crashed: RuntimeError: boom"


def test_hang_stacks_are_checked_by_reading_a_real_process(monkeypatch) -> None:  # noqa: ANN001
    from mlaunch.doctor import hang_stacks

    settings = load_settings(environ={})
    (result,) = hang_stacks.check_hang_stacks(settings)
    assert result.status == "pass" and "py-spy reads a worker's stacks" in result.message
    off = load_settings(flags={"launch.hang_timeout": "off"}, environ={})
    assert hang_stacks.check_hang_stacks(off)[0].message.startswith("the hang watchdog is off")
    monkeypatch.setattr(hang_stacks, "py_spy", lambda: None)
    (missing,) = hang_stacks.check_hang_stacks(settings)
    assert missing.status == "warn" and missing.fix == "pip install py-spy"
