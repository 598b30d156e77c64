"""One rule for every command that writes a file the user names (``trace export -o``,
``trace report -o``), so that writing an output never destroys what is there.

The rule (docs/trace.md, "Output files"; each command's ``--output`` help points at it):

* a **symlink** is followed: its target is written and the link itself stays a link;
* an existing target that is **not a regular file** (``/dev/null``, ``/dev/stdout``, a FIFO, a
  terminal) is written through, in place, never replaced; a **directory** is refused;
* a **regular file** (new or existing) is written to a temporary file in the same directory and
  renamed over the target only once complete: a failure (a full disk, Ctrl-C, bad input found
  while writing) leaves the old file as it was and removes the temporary file;
* a target that is one of the **input** trace files, or an existing file inside the **run
  directory being read** that is not an earlier output of ``mlaunch trace export``/``report``,
  is refused (paths are compared after resolving symlinks), so ``-o progress.jsonl`` cannot
  overwrite the run's own records;
* missing **parent directories** are created;
* ``-`` is **standard output** (never a file named ``-``; ``./-`` is one).

A refused target raises :class:`OutputError`; the CLI prints its one line and exits 2.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from mlaunch.rundir.atomic import atomic_path

#: What the first bytes of ``mlaunch trace export``'s and ``mlaunch trace report``'s files hold:
#: an existing file inside a run directory whose head contains one of these is an earlier output,
#: which may be replaced. Pinned against the writers by tests/trace/test_trace_hostile.py
#: (test_a_file_of_the_run_directory_is_refused_but_earlier_outputs_are_replaced).
OWN_OUTPUT_MARKERS: tuple[bytes, ...] = (
    b'{"displayTimeUnit":"ms","otherData":{"generator":"mlaunch trace export"',
    b'<meta name="generator" content="mlaunch trace report">',
)
_SNIFF = 512

#: The output name that means standard output, as in most Unix tools (``./-`` names a file).
STDOUT_NAME = "-"


def is_stdout(path: Path | str) -> bool:
    """Whether ``path`` is :data:`STDOUT_NAME`, i.e. the output goes to standard output."""
    return str(path) == STDOUT_NAME


class OutputError(Exception):
    """An output path the rule refuses: ``str()`` is the one line for the user."""

    def __init__(self, flag: str, path: Path, message: str, fix: str) -> None:
        self.path = path
        super().__init__(f"{flag} {path}: {message}; fix: {fix}")


def _is_own_output(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
    except OSError:
        return False
    return any(m in head for m in OWN_OUTPUT_MARKERS)


def check_output(
    path: Path,
    *,
    inputs: Iterable[Path] = (),
    run_dir: Path | None = None,
    flag: str = "--output",
) -> Path:
    """Check ``path`` against the rule before any work is done; return the path to write (the
    symlink's target for a symlink). Raises :class:`OutputError` for a refused target."""
    path = Path(path)
    if is_stdout(path):
        return path  # nothing on disk to check or protect
    try:
        st = os.stat(path)  # follows symlinks: /dev/stdout is a link to the process's fd
    except FileNotFoundError:
        st = None
    except OSError as e:  # e.g. a name too long for the file system
        raise OutputError(flag, path, f"cannot write: {e.strerror}", "choose a writable output "
                          "path") from None  # fmt: skip
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(flag, path, "is a directory", "pass a file name, e.g. -o trace.json")
    if st is not None and not stat.S_ISREG(st.st_mode):
        return path  # a device, FIFO or terminal: written through in place, never replaced
    target = Path(os.path.realpath(path))  # a symlink's (maybe missing) target
    for p in inputs:
        with contextlib.suppress(OSError):
            if Path(os.path.realpath(p)) == target:
                raise OutputError(flag, path, "is an input trace file of this command",
                                  "write the output to another file")  # fmt: skip
    if st is not None and run_dir is not None:
        root = Path(os.path.realpath(run_dir))
        if target.is_relative_to(root) and not _is_own_output(target):
            raise OutputError(
                flag, path, f"is a file of the run directory {run_dir} being read",
                "write to a new file name, or outside the run directory",
            )  # fmt: skip
    return target


@contextlib.contextmanager
def open_output(
    path: Path, *, encoding: str = "utf-8", flag: str = "--output"
) -> Iterator[IO[str]]:
    """Open ``path`` (already checked by :func:`check_output`) for writing text by the rule:
    regular files atomically through a temporary file in the same directory, devices and FIFOs
    in place. The temporary file is removed on any failure, Ctrl-C included."""
    path = Path(path)
    if is_stdout(path):
        # Written through as it comes, like a FIFO; closing it is the interpreter's business.
        yield sys.stdout
        sys.stdout.flush()
        return
    st = None
    with contextlib.suppress(OSError):
        st = os.stat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "w", encoding=encoding) as f:  # never replaced: /dev/null stays a device
            yield f
        return
    with atomic_path(path) as tmp, open(tmp, "w", encoding=encoding) as f:
        if st is not None:  # keep the replaced file's permissions
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        yield f
