"""A full disk for child processes: the span store is written by a process of its own, where a
test's monkeypatch cannot reach."""

from __future__ import annotations

from pathlib import Path


def full_disk_site(tmp_path: Path) -> Path:
    """A directory holding a ``sitecustomize`` that makes every Parquet write fail with ENOSPC,
    as a full disk does: put it on a child's PYTHONPATH."""
    site = tmp_path / "full-disk-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import errno\nimport pyarrow.parquet as pq\n\n\n"
        "def _full(*args, **kwargs):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n\n\n"
        "pq.write_table = _full\n"
    )
    return site
