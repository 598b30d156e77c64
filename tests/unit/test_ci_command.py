"""CI runs exactly the README's test command (Quick start, second command), and that command
holds the tree to ``ruff check`` and ``ruff format --check`` before the suite runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    quick = REPO.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("\n## ")[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(blocks) >= 2, "Quick start lost its second command (the tests)"
    (command,) = blocks[1].strip().splitlines()
    return command


def _ci_command() -> str:
    lines = REPO.joinpath(".ci/run").read_text().splitlines()
    commands = [s for s in lines if s.strip() and not s.startswith(("#", "set ", "cd "))]
    (command,) = commands
    return command


def test_ci_runs_exactly_the_readme_test_command() -> None:
    assert _ci_command() == _readme_test_command()


def test_the_test_command_lints_and_checks_the_format_before_the_suite() -> None:
    steps = [s.strip() for s in _readme_test_command().split("&&")]
    assert "ruff check ." in steps and "ruff format --check ." in steps
    assert steps.index("ruff format --check .") < steps.index("python -m pytest")
    assert steps.index("ruff check .") < steps.index("python -m pytest")
