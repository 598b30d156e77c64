"""Settings: one test per precedence rule and per alias rule, and the validation paths."""

from __future__ import annotations

import pytest

from mlaunch.settings import SettingsError, Source, load_settings, load_telemetry_settings


def problems(**kwargs) -> list[tuple[str, str]]:
    with pytest.raises(SettingsError) as info:
        load_settings(**kwargs)
    return info.value.problems


@pytest.fixture
def config(tmp_path):
    def write(text: str):
        path = tmp_path / "run.toml"
        path.write_text(text)
        return path

    return write


# --- precedence --------------------------------------------------------------------------


def test_defaults_when_nothing_is_set() -> None:
    s = load_settings(environ={})
    assert s.telemetry.span_groups == "default"
    assert s.telemetry.export_strategy == "single_rank"
    assert s.telemetry.exporter == "file"
    assert s.telemetry.service_name == "megatron-lm"
    assert s.source("telemetry.span_groups") == Source("default", "")


def test_config_file_beats_defaults(config) -> None:
    s = load_settings(environ={}, config=config('[telemetry]\nspan_groups = "all"\n'))
    assert s.telemetry.span_groups == "all"
    assert s.source("telemetry.span_groups").kind == "file"
    assert "[telemetry] span_groups" in s.source("telemetry.span_groups").name


def test_nemo_lens_beats_the_config_file(config) -> None:
    s = load_settings(
        environ={"NEMO_LENS_SPAN_GROUPS": "per_step"},
        config=config('[telemetry]\nspan_groups = "all"\n'),
    )
    assert s.telemetry.span_groups == "per_step"
    assert s.source("telemetry.span_groups") == Source("env", "NEMO_LENS_SPAN_GROUPS")


def test_megatron_otel_beats_nemo_lens() -> None:
    s = load_settings(
        environ={"MEGATRON_OTEL_SPAN_GROUPS": "per_step", "NEMO_LENS_SPAN_GROUPS": "all"}
    )
    assert s.telemetry.span_groups == "per_step"
    assert s.source("telemetry.span_groups") == Source("env", "MEGATRON_OTEL_SPAN_GROUPS")


def test_empty_or_blank_primary_falls_back_to_nemo_lens() -> None:
    s = load_settings(environ={"MEGATRON_OTEL_SPAN_GROUPS": "  ", "NEMO_LENS_SPAN_GROUPS": "all"})
    assert s.telemetry.span_groups == "all"


def test_flags_beat_the_environment() -> None:
    s = load_settings(
        flags={"telemetry.span_groups": "goodput", "telemetry.enabled": None},
        environ={"MEGATRON_OTEL_SPAN_GROUPS": "per_step"},
    )
    assert s.telemetry.span_groups == "goodput"
    assert s.source("telemetry.span_groups") == Source("flag", "--otel-span-groups")
    assert s.source("telemetry.enabled").kind == "default"  # None = flag not given


def test_otel_service_name_beats_file_and_flag_beats_it(config) -> None:
    path = config('[telemetry]\nservice_name = "from-file"\n')
    env = {"OTEL_SERVICE_NAME": "from-env"}
    assert load_settings(environ=env, config=path).telemetry.service_name == "from-env"
    flagged = load_settings(flags={"telemetry.service_name": "from-flag"}, environ=env, config=path)
    assert flagged.telemetry.service_name == "from-flag"


def test_worker_overrides_sit_on_top_of_its_environment() -> None:
    t = load_telemetry_settings(
        {"MEGATRON_OTEL_ENABLED": "0", "MEGATRON_OTEL_SPAN_GROUPS": "all"},
        overrides={"enabled": True},
    )
    assert t.enabled is True and t.span_groups == "all"


# --- aliases -----------------------------------------------------------------------------


def test_rank_strategy_is_an_alias_of_export_strategy() -> None:
    s = load_settings(environ={"MEGATRON_OTEL_RANK_STRATEGY": "all_ranks"})
    assert s.telemetry.export_strategy == "all_ranks"
    assert s.source("telemetry.export_strategy") == Source("env", "MEGATRON_OTEL_RANK_STRATEGY")


def test_agreeing_aliases_are_accepted() -> None:
    env = {"MEGATRON_OTEL_RANK_STRATEGY": "ALL_RANKS", "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks"}
    assert load_settings(environ=env).telemetry.export_strategy == "all_ranks"


def test_conflicting_aliases_are_an_error() -> None:
    env = {"MEGATRON_OTEL_RANK_STRATEGY": "sampled", "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks"}
    [(field, message)] = problems(environ=env)
    assert field == "MEGATRON_OTEL_EXPORT_STRATEGY"
    assert "MEGATRON_OTEL_RANK_STRATEGY='sampled'" in message


def test_sampling_strategy_rank_aware_enables_the_sampler() -> None:
    s = load_settings(environ={"NEMO_LENS_SAMPLING_STRATEGY": "rank_aware"})
    assert s.telemetry.sampler_enabled is True


def test_sampling_strategy_conflicting_with_sampler_enabled() -> None:
    env = {"MEGATRON_OTEL_SAMPLING_STRATEGY": "rank_aware", "MEGATRON_OTEL_SAMPLER_ENABLED": "0"}
    assert problems(environ=env)[0][0] == "MEGATRON_OTEL_SAMPLER_ENABLED"


def test_unknown_sampling_strategy() -> None:
    [(field, message)] = problems(environ={"MEGATRON_OTEL_SAMPLING_STRATEGY": "random"})
    assert field == "MEGATRON_OTEL_SAMPLING_STRATEGY" and "rank_aware" in message


# --- validation --------------------------------------------------------------------------


def test_unknown_prefixed_variable_suggests_the_right_name() -> None:
    [(field, message)] = problems(environ={"MEGATRON_OTEL_SPAN_GROUP": "all"})
    assert field == "MEGATRON_OTEL_SPAN_GROUP"
    assert "did you mean MEGATRON_OTEL_SPAN_GROUPS?" in message
    [(field, message)] = problems(environ={"NEMO_LENS_EXPORTR": "file"})
    assert "did you mean NEMO_LENS_EXPORTER?" in message


@pytest.mark.parametrize("value", ["1", "true", "YES", "On"])
def test_booleans_accept_the_true_words(value: str) -> None:
    assert load_settings(environ={"MEGATRON_OTEL_ENABLED": value}).telemetry.enabled is True


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_booleans_accept_the_false_words(value: str) -> None:
    assert load_settings(environ={"MEGATRON_OTEL_ENABLED": value}).telemetry.enabled is False


@pytest.mark.parametrize("value", ["t", "y", "2", "maybe", "enabled"])
def test_other_boolean_words_are_errors_naming_the_variable(value: str) -> None:
    [(field, message)] = problems(environ={"MEGATRON_OTEL_ENABLED": value})
    assert field == "MEGATRON_OTEL_ENABLED" and "1/true/yes/on" in message


@pytest.mark.parametrize(
    ("env", "field", "fragment"),
    [
        ({"OTEL_TRACES_SAMPLER": "always-on"}, "OTEL_TRACES_SAMPLER", "did you mean 'always_on'"),
        ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG", "[0, 1]"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG", "[0, 1]"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/xml"}, "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},  # mlaunch's trainer: no JSON encoder
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "http/protobuf",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT", "URL"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "token"}, "OTEL_EXPORTER_OTLP_HEADERS", "key=value"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "a=1,b"}, "OTEL_RESOURCE_ATTRIBUTES", "key=value"),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "-5"}, "OTEL_METRIC_EXPORT_INTERVAL", "greater than 0"),
        ({"MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "1.2"}, "MEGATRON_OTEL_EXPORT_SAMPLE_RATE", "1"),
        ({"MEGATRON_OTEL_EXPORTER": "jaeger"}, "MEGATRON_OTEL_EXPORTER", "'otlp'"),
        ({"MEGATRON_OTEL_SPAN_GROUPS": "per_stepp"}, "MEGATRON_OTEL_SPAN_GROUPS", "'per_step'"),
        (
            {"MEGATRON_OTEL_EXPORT_STRATEGY": "al_ranks"},
            "MEGATRON_OTEL_EXPORT_STRATEGY",
            "all_ranks",
        ),
        ({"MEGATRON_OTEL_RUN_ID": "a b"}, "MEGATRON_OTEL_RUN_ID", "run id"),
    ],
)
def test_bad_values_name_the_variable(env: dict, field: str, fragment: str) -> None:
    found = problems(environ=env)
    assert found[0][0] == field
    assert fragment in found[0][1]


def test_all_environment_problems_are_reported_together() -> None:
    found = problems(environ={"MEGATRON_OTEL_SPAN_GROUP": "x", "NEMO_LENS_ENABLD": "1"})
    assert {f for f, _ in found} == {"MEGATRON_OTEL_SPAN_GROUP", "NEMO_LENS_ENABLD"}


def test_exporter_defaults_to_otlp_when_an_endpoint_is_configured() -> None:
    s = load_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert s.telemetry.exporter == "otlp"
    assert s.telemetry.otel.endpoint == "http://127.0.0.1:4317"


def test_http_endpoints_get_the_signal_path_and_per_signal_protocol_wins() -> None:
    s = load_settings(
        environ={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        }
    )
    assert s.telemetry.otel.protocol == "http/protobuf"
    assert s.telemetry.otel.endpoint == "http://collector:4318/v1/traces"
    assert s.telemetry.otel.metrics_protocol == "grpc"
    assert s.telemetry.otel.metrics_endpoint == "http://collector:4318/"


def test_headers_and_resource_attributes_are_parsed() -> None:
    s = load_settings(
        environ={
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20x,team=ml",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod",
        }
    )
    assert s.telemetry.otel.headers == {"authorization": "Bearer x", "team": "ml"}
    assert s.telemetry.otel.resource_attributes == {"deployment.environment": "prod"}


def test_a_malformed_header_entry_is_reported_without_its_secret_value() -> None:
    # "Authorization: Bearer TOKEN" (a colon, as in HTTP) is the common mistake: the error must
    # name the entry without printing the token on the terminal or in CI logs.
    found = problems(environ={"OTEL_EXPORTER_OTLP_HEADERS": "team=ml,Authorization: Bearer S3CR3T"})
    assert found and found[0][0] == "OTEL_EXPORTER_OTLP_HEADERS"
    assert "#2" in found[0][1]
    assert all("S3CR3T" not in msg for _, msg in found)
    # Resource attributes are no secret: their bad entry is still quoted.
    found = problems(environ={"OTEL_RESOURCE_ATTRIBUTES": "oops"})
    assert "'oops'" in found[0][1]


# --- config file -------------------------------------------------------------------------


def test_unknown_config_keys_and_sections_are_errors(config) -> None:
    found = problems(
        environ={}, config=config('[telemetry]\nspan_group = "all"\n[modle]\nnum_layers = 2\n')
    )
    assert any("span_group" in f and "did you mean 'span_groups'" in m for f, m in found)
    assert any("[modle]" in f and "did you mean 'model'" in m for f, m in found)


def test_config_file_type_errors_name_the_file_key(config) -> None:
    [(field, message)] = problems(environ={}, config=config('[model]\nnum_layers = "two"\n'))
    assert field.endswith("[model] num_layers")
    assert "integer" in message


def test_broken_toml_and_missing_file(config, tmp_path) -> None:
    [(field, message)] = problems(environ={}, config=config("[telemetry\n"))
    assert "not valid TOML" in message
    [(field, message)] = problems(environ={}, config=tmp_path / "missing.toml")
    assert "not found" in message


def test_nested_otel_table(config) -> None:
    s = load_settings(
        environ={},
        config=config('[telemetry.otel]\nbase_endpoint = "http://127.0.0.1:4317"\n'),
    )
    assert s.telemetry.exporter == "otlp"


# --- cross-field -------------------------------------------------------------------------


def test_world_size_must_split_into_model_parallel_sizes() -> None:
    found = problems(
        environ={},
        flags={"launch.nproc_per_node": 3, "parallelism.pipeline_model_parallel_size": 2},
    )
    assert found[0][0] == "--pipeline-model-parallel-size"
    assert "not divisible" in found[0][1]


def test_explicit_data_parallel_size_must_match() -> None:
    found = problems(environ={}, flags={"parallelism.data_parallel_size": 4})
    assert found[0][0] == "--data-parallel-size"


def test_global_batch_must_divide_by_micro_batch_times_dp() -> None:
    found = problems(environ={}, flags={"training.global_batch_size": 6})
    assert found[0][0] == "--global-batch-size" and "micro batch 2" in found[0][1]


def test_layers_must_split_across_stages() -> None:
    found = problems(
        environ={},
        flags={"model.num_layers": 3, "parallelism.pipeline_model_parallel_size": 2},
    )
    assert any(f == "--num-layers" for f, _ in found)


def test_export_rank_must_be_inside_the_world() -> None:
    [(field, message)] = problems(environ={"MEGATRON_OTEL_EXPORT_RANK": "2"})
    assert field == "MEGATRON_OTEL_EXPORT_RANK" and "outside the world size 2" in message


def test_derived_sizes() -> None:
    s = load_settings(
        environ={},
        flags={"launch.nproc_per_node": 4, "parallelism.pipeline_model_parallel_size": 2},
    )
    assert s.world_size == 4 and s.data_parallel_size == 2 and s.num_microbatches == 2


# --- problems as structured values ---------------------------------------------------------


def test_a_problem_is_its_field_and_message_with_a_kind_and_a_suggestion() -> None:
    [found] = problems(environ={"MEGATRON_OTEL_SPAN_GROUP": "all"})
    assert (found.field, found.kind, found.suggestion) == (
        "MEGATRON_OTEL_SPAN_GROUP",
        "unknown",
        "MEGATRON_OTEL_SPAN_GROUPS",
    )
    assert str(found) == f"{found.field}: {found.message}"
    assert found == (found.field, found.message)  # still the (field, message) pair


def test_a_file_key_typo_carries_the_key_it_meant(config) -> None:
    [found] = problems(environ={}, config=config("[training]\ntrain_iter = 3\n"))
    assert (found.kind, found.suggestion) == ("unknown", "train_iters")


def test_a_validator_names_the_word_it_meant() -> None:
    [found] = problems(environ={"MEGATRON_OTEL_SPAN_GROUPS": "defualt"})
    assert (found.kind, found.suggestion) == ("invalid", "default")
    [found] = problems(environ={"OTEL_TRACES_SAMPLER": "always_onn"})
    assert (found.kind, found.suggestion) == ("invalid", "always_on")


def test_settings_that_disagree_are_a_conflict() -> None:
    [found] = problems(environ={}, flags={"model.hidden_size": 65})
    assert found.kind == "conflict" and found.suggestion is None


def test_an_unreadable_config_file(tmp_path) -> None:
    [found] = problems(environ={}, config=tmp_path / "missing.toml")
    assert found.kind == "unreadable"


def test_otel_sdk_disabled_turns_telemetry_off_with_itself_as_the_source() -> None:
    # The SDK's own switch makes every signal a no-op: the settings say off and why, so the
    # summary, resolved.json and doctor never claim an "on" run that writes nothing.
    env = {"MEGATRON_OTEL_ENABLED": "1", "OTEL_SDK_DISABLED": "true"}
    settings = load_settings(environ=env)
    assert settings.telemetry.enabled is False
    assert settings.source("telemetry.enabled") == Source("env", "OTEL_SDK_DISABLED")
    flagged = load_settings(flags={"telemetry.enabled": True}, environ=env)
    assert flagged.telemetry.enabled is False
    assert load_settings(environ={"MEGATRON_OTEL_ENABLED": "1"}).telemetry.enabled is True
