"""Fixtures shared by the ``mlaunch trace`` tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.synthetic_traces import hand_example


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """The hand-written example run (two ranks, a straggler, an error span) as a run directory."""
    return hand_example()[0].write_run_dir(tmp_path / "run")
