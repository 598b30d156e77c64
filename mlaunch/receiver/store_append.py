"""The span store written where the spans arrive: the embedded receiver appends the run's
columnar store (:mod:`mlaunch.trace.store`) from the OTLP-JSON it writes, while the run goes on.

A watcher thread counts the trace bytes the writer thread wrote and, once enough are new, runs
one :func:`~mlaunch.trace.store.update_store` in a process of its own (niced, under the store's
lock) and waits for it. The writer thread and the request handlers never wait for it: they only
add to a counter. The JSON is always written first and stays: it is the interchange format, and
what the store does not hold yet (the tail written since the last append) is read from it.

When: after ``min_bytes`` of new trace lines, then each time the new bytes reach ``growth`` times
what the store already holds. Geometric steps keep the number of appends, and of the compactions
they cause (a full rewrite once a rank has many small parts), logarithmic in the run's size, so
the store costs a bounded multiple of one build however long the run. The rest is appended by
the launcher at the end of the run (:mod:`mlaunch.launcher.run`), or by the first read.

A failure (a full disk, an unreadable line) is logged once and ends the appends; the JSON is
untouched, and the next read rebuilds the store from it.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

#: New trace bytes (OTLP-JSON) before the first append: a small run's store is left to its end
#: or its first read; a big one's starts early enough that the end has only a tail left. Also the
#: launcher's floor for the run-end build: below it (about 200,000 spans) the first read builds
#: the store in under a second, and a small run's end need not wait for it.
MIN_APPEND_BYTES = 64 * 1024 * 1024
#: An append once the new bytes reach this fraction of those already in the store.
APPEND_GROWTH = 0.25
#: How often the watcher looks at the counter.
POLL_S = 1.0


class StoreAppender:
    """Appends ``run_dir``'s span store from the receiver's trace files as they grow."""

    def __init__(
        self,
        run_dir: Path,
        problem: Callable[[str, str], None],
        *,
        min_bytes: int = MIN_APPEND_BYTES,
        growth: float = APPEND_GROWTH,
    ) -> None:
        self.run_dir, self.problem = run_dir, problem
        self.min_bytes, self.growth = min_bytes, growth
        #: Trace bytes written so far (the writer thread adds; one int, no lock needed).
        self.written = 0
        self.stored = 0  # ``written`` when the last append started
        self.appends = 0
        self.failed = False
        self._proc: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlaunch-store", daemon=True)
        self._thread.start()

    def note(self, nbytes: int) -> None:
        """``nbytes`` more of trace lines written (called by the writer thread)."""
        self.written += nbytes

    def due(self) -> bool:
        """Whether enough is new for an append."""
        new = self.written - self.stored
        return new > 0 and new >= max(self.min_bytes, self.growth * self.stored)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.failed or not self.due():
                continue
            self.stored = self.written
            self._append()

    def _append(self) -> None:
        from mlaunch.trace.store import spawn_update

        try:
            self._proc = proc = spawn_update(self.run_dir)
            _, err = proc.communicate()
        except Exception as exc:  # cannot start a process: the store is left to the first read
            err, proc = f"{exc}", None
        if proc is not None and proc.returncode == 0:
            self.appends += 1
            return
        self.failed = True
        line = (err or "").strip().splitlines()
        self.problem(
            "store",
            f"cannot append the span store ({line[-1] if line else 'it exited with an error'});"
            " the OTLP-JSON is complete and `mlaunch trace` rebuilds the store from it",
        )

    def close(self) -> None:
        """Stop appending. An append in flight is left to finish on its own (the run-end build
        waits for it on the store's lock; one cut short would be harmless: parts are written
        under temporary names and the manifest last)."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._thread.join(0.1)
