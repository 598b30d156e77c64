"""Shared pytest setup: makes ``tests/support`` importable as ``support`` from every test folder."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))


def pytest_collection_modifyitems(config, items) -> None:
    """``gpu`` tests need a CUDA device: skipped, with the reason, where there is none."""
    import pytest

    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected; the fast suites never pay for it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in gpu_items:
        item.add_marker(skip)
