"""``mlaunch groups``: output content, JSON shape, error paths (exit 2, no traceback)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlaunch.cli import build_app

# Wide enough that Rich does not wrap names inside table cells.
runner = CliRunner(env={"COLUMNS": "200"})


def run(args: list[str], env: dict[str, str] | None = None, monkeypatch=None):
    if monkeypatch is not None:
        for key in list(__import__("os").environ):
            if key.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_")):
                monkeypatch.delenv(key)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
    return runner.invoke(build_app(), args, catch_exceptions=False)


def test_list_shows_every_group_and_preset(monkeypatch) -> None:
    result = run(["groups", "list", "--json"], monkeypatch=monkeypatch)
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert len(data["groups"]) == 16
    assert set(data["presets"]) == {"default", "per_step", "all", "profiling", "goodput"}
    text = run(["groups", "list"], monkeypatch=monkeypatch).stdout
    assert "activation_offload" in text and "goodput" in text


def test_resolve_per_step_shows_groups_and_tree(monkeypatch) -> None:
    result = run(["groups", "resolve", "per_step"], monkeypatch=monkeypatch)
    assert result.exit_code == 0
    assert "megatron.train.iteration" in result.stdout
    assert "spans per iteration" in result.stdout


def test_resolve_json_marks_spans_and_placement(monkeypatch) -> None:
    result = run(
        ["groups", "resolve", "default,microbatch", "--json", "--microbatches", "4"],
        monkeypatch=monkeypatch,
    )
    data = json.loads(result.stdout)
    assert "microbatch" in data["groups"] and "step" in data["disabled"]
    spans = {s["name"]: s for s in data["spans"]}
    assert spans["megatron.microbatch.forward"]["enabled"] is True
    assert spans["megatron.microbatch.forward"]["attaches_to"] == "megatron.train"
    assert spans["megatron.train.iteration"]["enabled"] is False
    # default,microbatch with 4 microbatches: forward + backward per microbatch.
    assert data["estimate"]["spans_per_iteration_per_stage"] == [8]


def test_resolve_all_minus_layer_json(monkeypatch) -> None:
    data = json.loads(
        run(["groups", "resolve", "all,-layer", "--json"], monkeypatch=monkeypatch).stdout
    )
    assert "layer" not in data["groups"] and len(data["groups"]) == 15


def test_typo_exits_2_with_suggestion_and_no_traceback(monkeypatch) -> None:
    result = run(["groups", "resolve", "per_stepp"], monkeypatch=monkeypatch)
    assert result.exit_code == 2
    assert "did you mean 'per_step'" in result.stderr
    assert "Traceback" not in result.output


def test_environment_spec_and_its_source(monkeypatch) -> None:
    env = {"MEGATRON_OTEL_SPAN_GROUPS": "per_step", "NEMO_LENS_SPAN_GROUPS": "all"}
    result = run(["groups", "resolve", "--json"], env=env, monkeypatch=monkeypatch)
    data = json.loads(result.stdout)
    assert data["spec"] == "per_step"
    assert data["sources"]["telemetry.span_groups"]["source"] == "MEGATRON_OTEL_SPAN_GROUPS"
    text = run(["groups", "resolve"], env=env, monkeypatch=monkeypatch).stdout
    assert "from MEGATRON_OTEL_SPAN_GROUPS" in text


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MEGATRON_OTEL_SPAN_GROUP": "all"}, "MEGATRON_OTEL_SPAN_GROUPS"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        ({"MEGATRON_OTEL_SPAN_GROUPS": "everything"}, "MEGATRON_OTEL_SPAN_GROUPS"),
    ],
)
def test_bad_environment_exits_2(monkeypatch, env: dict, named: str) -> None:
    result = run(["groups", "resolve"], env=env, monkeypatch=monkeypatch)
    assert result.exit_code == 2
    assert named in result.stderr
    assert "Traceback" not in result.output


def test_headers_are_never_shown(monkeypatch) -> None:
    result = run(
        ["groups", "resolve", "--json"],
        env={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=supersecret"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 0
    assert "supersecret" not in result.output


def test_layers_must_split_across_stages(monkeypatch) -> None:
    result = run(
        ["groups", "resolve", "all", "--layers", "3", "--pp", "2"], monkeypatch=monkeypatch
    )
    assert result.exit_code == 2 and "--layers" in result.stderr
