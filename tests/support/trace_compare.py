"""Comparing two readers' results (the JSON reader and the span store's)."""

from __future__ import annotations

import math
from typing import Any


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal, floats to the last bits (two paths may add the same floats in another order;
    the store's percentiles are exact: tests/trace/test_trace_store.py pins them with ==)."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
