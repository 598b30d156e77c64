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


def store_rows(store: Any) -> tuple[list[tuple[str, dict]], list[dict]]:
    """An opened span store's rows, comparable across stores: every span row (its rank
    directory, its JSON columns decoded) in read order, and the resources. Two stores of the
    same spans are equal here however their parts were cut (one build, appends, a compaction)."""
    import orjson
    import pyarrow.parquet as pq

    out = []
    for part in store.parts:
        for row in pq.ParquetFile(part).read().to_pylist():
            for c in ("attributes", "links", "events", "extra"):
                row[c] = None if row[c] is None else orjson.loads(row[c])
            out.append((part.parent.name, row))
    res = pq.read_table(store.root / "resources.parquet").to_pylist()
    for r in res:
        r["attributes"] = orjson.loads(r["attributes"])
    return out, res


def json_store_rows(run_dir: Any, scratch: Any) -> tuple[list[tuple[str, dict]], list[dict]]:
    """:func:`store_rows` of a store built afresh from a copy of ``run_dir``'s OTLP-JSON (its
    ``telemetry/`` only) in ``scratch``: the reference a store written during the run equals."""
    import shutil

    from mlaunch.trace.store import open_store

    shutil.copytree(run_dir / "telemetry", scratch / "telemetry")
    store = open_store(scratch)
    assert store is not None
    return store_rows(store)
