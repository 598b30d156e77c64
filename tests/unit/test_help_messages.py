"""Help and messages, as a user sees them (real subprocesses at a fixed width).

Rules pinned here: no help table cuts a name with "…" at 80 columns (names keep their width,
help text wraps and folds); choice lists are spelled out; defaults are shown; docstrings flow
at any width; an unknown command is one plain line (exit 2); plain doctor does not contradict
plain train about telemetry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlaunch.cli.errors import reflow
from mlaunch.cli.setting_flags import setting_paths
from mlaunch.settings import TRACE_SAMPLERS, flag_name

REPO = Path(__file__).resolve().parents[2]


def mlaunch(*args: str, columns: int = 80, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns), "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def train_help_80() -> str:
    proc = mlaunch("train", "--help")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_train_help_at_80_columns_cuts_nothing(train_help_80: str) -> None:
    assert "…" not in train_help_80
    assert max(len(line) for line in train_help_80.splitlines()) <= 80
    words = set(re.findall(r"--[a-z0-9-]+", train_help_80))
    for path, _ in setting_paths():
        assert flag_name(path) in words, flag_name(path)


def test_train_help_lists_sampler_names_and_defaults(train_help_80: str) -> None:
    flat = " ".join(train_help_80.replace("│", " ").split())
    assert "TRACE_SAMPLERS" not in flat
    for name in TRACE_SAMPLERS:
        assert name in flat
    assert "(default: 40)" in flat or "(default: " in flat  # train_iters and friends
    assert "One of: fp32, bf16, fp16." in flat  # a Literal's names, not a cut metavar


def test_groups_list_at_80_columns_cuts_no_name() -> None:
    proc = mlaunch("groups", "list")
    assert proc.returncode == 0 and "…" not in proc.stdout
    from mlaunch.model.groups import GROUPS, PRESETS

    for name in [g.value for g in GROUPS] + list(PRESETS):
        assert re.search(rf"│ {re.escape(name)}\s", proc.stdout), name


#: A name a user types or greps for: a flag, an environment variable, a dotted span name, a
#: snake_case setting or group. None of them may be split across lines.
_NAME = re.compile(r"(?<![\w.-])(?:--[a-z0-9][a-z0-9-]*|[A-Za-z][A-Za-z0-9]*(?:[_.][A-Za-z0-9]+)+)")


def _names(page: str) -> set[str]:
    """The names in a help page, its frame and line breaks taken out (a name split across two
    lines reads as two words here, so it is not found whole)."""
    return set(_NAME.findall(" ".join(re.sub(r"[│╭╮╰╯─]", " ", page).split())))


@pytest.fixture(scope="module")
def pages_80() -> dict[tuple[str, ...], str]:
    from support.help_pages import help_pages

    return help_pages({**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80", "TERM": "dumb"})


def test_every_help_page_reads_at_80_columns_and_splits_no_name(pages_80) -> None:
    # Every line fits; every name the page holds at 400 columns is whole at 80 (train --help
    # split OTEL_EXPORTER_OTLP_TRACES_E|NDPOINT, mlaunch --help broke summaries mid-sentence).
    from support.help_pages import help_pages

    wide = help_pages({**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400", "TERM": "dumb"})
    assert set(wide) == set(pages_80)
    for path, page in pages_80.items():
        assert max(map(len, page.splitlines())) <= 80, path
        lost = _names(wide[path]) - _names(page)
        assert not lost, (path, sorted(lost))
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in _names(pages_80[("train",)])
    # A command's summary in its group's list flows: its docstring's line break after "CPU,"
    # no longer ends the line there.
    assert any("CPU, telemetry on" in line for line in pages_80[()].splitlines())


def test_train_help_in_a_real_80_column_terminal_splits_no_name(pages_80, tmp_path) -> None:
    # A real terminal (a tmux pane 80 columns wide, tall enough for the whole page): Rich takes
    # the width from the terminal, and a line one character too long would wrap on screen.
    from support.terminal import Pane, find_or_install_tmux

    tmux, why = find_or_install_tmux()
    if tmux is None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    pane = Pane(tmux, f"{sys.executable} -m mlaunch train --help", tmp_path, env, width=80,
                height=400)  # fmt: skip
    try:
        pane.wait_for(lambda s: "[exit " in s, 120, "the help ending")
        joined = pane._run("capture-pane", "-p", "-J", "-t", "t")  # wrapped lines joined
    finally:
        pane.close()
    assert "[exit 0]" in joined
    page = joined.split("[exit 0]")[0].rstrip() + "\n"
    assert max(map(len, page.splitlines())) <= 80  # nothing wrapped by the terminal
    assert _names(page) == _names(pages_80[("train",)])
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in _names(page)


def test_a_flag_shows_no_value_type(pages_80) -> None:
    # Typer wrote <bool> beside every flag, as if it took a value.
    for path, page in pages_80.items():
        assert "<bool>" not in page, path
    assert re.search(r"│ --dry-run +Print the command", pages_80[("train",)])


def test_the_trace_summary_names_every_trace_command(pages_80) -> None:
    # The one-line summary of `mlaunch trace` left out stragglers, sql and capture.
    commands = sorted(p[1] for p in pages_80 if len(p) == 2 and p[0] == "trace")
    assert {"capture", "sql", "stragglers"} <= set(commands)
    head = " ".join(pages_80[("trace",)].split("╭")[0].split())
    listed = " ".join(re.sub(r"[│╭╮╰╯─]", " ", pages_80[()].split("│ trace ")[1]).split())
    for name in commands:
        assert re.search(rf"\b{name}\b", head), name
        assert re.search(rf"\b{name}\b", listed), name


def test_a_missing_argument_is_named_as_the_help_names_it() -> None:
    # `mlaunch status` said "target: a required argument is missing" under a help that
    # calls it RUN_DIR|JOB_ID.
    proc = mlaunch("status")
    assert proc.returncode == 2
    assert proc.stderr.startswith("RUN_DIR|JOB_ID: a required argument is missing"), proc.stderr
    proc = mlaunch("trace", "summary")  # no metavar: the help names it path, as does this
    assert proc.returncode == 2 and proc.stderr.startswith("path: a required argument is missing")


def test_groups_resolve_at_80_columns_splits_no_group_name() -> None:
    # `groups resolve per_step` printed its groups as one comma-joined word, split as optimiz|er.
    from mlaunch.model.groups import PRESETS
    from mlaunch.model.spec import resolve

    proc = mlaunch("groups", "resolve", "per_step")
    assert proc.returncode == 0, proc.stderr
    head = proc.stdout.split("span groups")[0]
    assert max(map(len, head.splitlines())) <= 80
    words = set(re.findall(r"[a-z_]+", head))
    assert {g.value for g in resolve("per_step")} <= words
    assert PRESETS["per_step"]


def test_docstrings_flow_at_120_columns() -> None:
    proc = mlaunch("trace", "replay", "--help", columns=120)
    assert "is recorded in telemetry/replayed.json" in proc.stdout  # one flowing paragraph
    assert reflow("a\nb\n\n- x\n- y") == "a b\n\n- x\n- y"


def test_trace_help_names_report_and_replay() -> None:
    out = mlaunch("trace", "--help", columns=120).stdout
    head = out.split("╭")[0]
    assert "report" in head and "replay" in head


def test_unknown_command_is_one_plain_line() -> None:
    proc = mlaunch("trian")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "╭" not in proc.stderr
    assert "did you mean 'train'" in proc.stderr


def test_groups_resolve_dash_spec_says_to_use_dashes() -> None:
    proc = mlaunch("groups", "resolve", "-layer")
    assert proc.returncode == 2 and "groups resolve -- -layer" in proc.stderr


def test_plain_doctor_does_not_contradict_plain_train(tmp_path: Path) -> None:
    from mlaunch.doctor.configuration import check_configuration

    env = {"PATH": os.environ.get("PATH", "")}
    results, _ = check_configuration(env, None)
    line = next(r for r in results if r.name == "telemetry")
    assert "no config" in line.message
    assert "plain `mlaunch train` uses config 'tiny': telemetry enabled" in line.fix
