"""``mlaunch train --help`` shows the defaults plain ``mlaunch train`` really uses: its default
config's values where that sets them, not the schema's bare ones."""

from __future__ import annotations

from typer.testing import CliRunner

from mlaunch.cli import build_app
from mlaunch.cli.setting_flags import _default_text, _shown, setting_paths
from mlaunch.launcher.plan import build_plan, settings_table


def test_every_default_in_help_is_the_value_plain_train_runs_with(tmp_path):
    plan = build_plan(flags={}, environ={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    table = settings_table(plan.settings)
    checked = 0
    for path, info in setting_paths():
        text = _default_text(path, info)
        if not text:
            continue
        shown = text.removeprefix(" (default: ").split(" from ")[0].removesuffix(")")
        assert shown == _shown(table[path]["value"]), path
        checked += 1
    assert checked > 30


def test_help_names_the_default_config_and_the_schema_default_beside_it():
    result = CliRunner().invoke(build_app("train"), ["train", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "(default: 30 from tiny.toml, else 40)" in text  # --train-iters
    assert "(default: all_ranks from tiny.toml, else single_rank)" in text
    assert "(default: cpu from tiny.toml, else auto)" in text
    assert "(default: on from tiny.toml, else off)" in text  # --otel-enabled
