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


def fresh_store(path: Any) -> Any:
    """The span store of a copy of ``path``'s OTLP-JSON (a run directory's ``telemetry/``, or
    one file), built afresh in a directory of its own: the reference that a store built another
    way (appends, a compaction, small parts, during the run) must read the same as."""
    import shutil
    import tempfile
    from pathlib import Path

    from mlaunch.trace.store import open_store

    path = Path(path)
    scratch = Path(tempfile.mkdtemp(prefix="fresh-store-"))
    if path.is_file():
        shutil.copy2(path, scratch / path.name)
        store = open_store(scratch / path.name)
    else:
        src = path / "telemetry" if (path / "telemetry").is_dir() else path
        shutil.copytree(src, scratch / "telemetry", ignore=shutil.ignore_patterns("trace-store*"))
        store = open_store(scratch)
    assert store is not None
    return store


def stragglers_unwindowed(reader: Any) -> Any:
    """The stragglers of every batch ``reader`` hands out (a store's), every phase span of every
    rank in memory at once (the live tail's :class:`StragglerAggregator`, then ``analyse``): the
    reference that the store's window-at-a-time analysis must equal whatever its window size."""
    from mlaunch.model.spans import ResourceAttr
    from mlaunch.trace.stragglers import SYNC_NAMES, StragglerAggregator, analyse, check_input

    agg = StragglerAggregator()
    reader.feed(agg.add)
    ranks = {k: v for k, v in agg.ranks.items() if v.spans or v.steps}
    world = next(
        (w for r in ranks.values() if (w := r.attr_int(ResourceAttr.WORLD_SIZE)) is not None), None
    )
    synced = any(s.name in SYNC_NAMES for r in ranks.values() for s in r.spans)
    check_input(reader, list(ranks), world, synced)
    return analyse(ranks)
