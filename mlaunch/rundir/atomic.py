"""The one atomic write and the one lock of the run directory.

Every file a reader may open while it is being rewritten (a capture request, an ack, a launcher
record, a hang report, a Parquet part, a checkpoint's tracker) is written under a temporary name
in the same folder and renamed over the final one: a reader sees the old file or the new one,
never half of one, and a crash or a full disk leaves no file under the final name.

The temporary name carries the process and thread id (``.NAME.PID.TID.tmp``): nodes sharing a run
directory, and threads of one process, may write the same file at once without clobbering each
other's half-written copy. It is created with ``O_EXCL`` and the final mode from the start, so a
private file (``resolved.env``) is never briefly readable by others, and removed on any failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


@contextlib.contextmanager
def atomic_path(path: str | Path, *, mkdir: bool = True) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that needs a file name (pyarrow): renamed
    over ``path`` when the block ends without an error, removed otherwise."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_atomic(
    path: str | Path,
    data: str | bytes,
    *,
    mode: int = 0o644,
    fsync: bool = False,
    mkdir: bool = True,
) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically, the file created with ``mode``
    (less the umask). ``fsync``: the data is on disk before the rename, and the rename before
    the return (a checkpoint's files, which must survive a power loss)."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = _tmp_name(path)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a crashed writer with this pid: O_EXCL must not inherit it
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def write_json(
    path: str | Path, body: Any, *, indent: int | None = None, mode: int = 0o644
) -> None:
    """``body`` as one JSON document (with a final newline), written by :func:`write_atomic`."""
    write_atomic(path, json.dumps(body, indent=indent) + "\n", mode=mode)


def read_json(path: str | Path) -> Any:
    """The JSON document at ``path``; None when it is missing or unreadable (every record of
    the run directory is written atomically, so a reader never needs to retry a half file)."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Busy(Exception):
    """Another process holds the lock (:func:`locked` with ``blocking=False``)."""


def flock(fd: int, *, shared: bool = False, blocking: bool = True) -> None:
    """The one ``flock`` of the tree: take (or convert: shared <-> exclusive) the lock on the
    open descriptor ``fd``. Raises :class:`Busy` when ``blocking`` is False and another process
    holds it. A lock ends when its descriptor closes, with the process, a crash included."""
    op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        raise Busy(f"fd {fd}") from None


def take_lock(path: str | Path, *, blocking: bool = True, shared: bool = False) -> int:
    """Hold an ``flock`` on ``path`` (created when missing) until the returned descriptor is
    closed: a lifetime lock (the launcher's on its node's run directory). O_CLOEXEC (Python's
    default): a child process never holds it. Raises :class:`Busy` as :func:`flock`, the
    descriptor closed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flock(fd, shared=shared, blocking=blocking)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, Busy):
            raise Busy(str(path)) from None
        raise
    return fd


@contextlib.contextmanager
def locked(path: str | Path, *, blocking: bool = True, shared: bool = False) -> Iterator[int]:
    """Hold an ``flock`` on ``path`` (created when missing) for the block; yields its open
    descriptor (a holder may write who it is into it). Raises :class:`Busy` when ``blocking`` is
    False and another process holds it. The lock ends with the process, a crash included."""
    fd = take_lock(path, blocking=blocking, shared=shared)
    try:
        yield fd
    finally:
        os.close(fd)
