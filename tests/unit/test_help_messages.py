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
