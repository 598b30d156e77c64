"""The subprocesses doctor's probes run (torch, the all-reduces, the worker's nemo-lens): each in its
own session, so a timeout kills it and everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence


class ProbeProcess:
    """A subprocess in its own session, so a timeout kills it and everything it started."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.error: str | None = None
        self.popen: subprocess.Popen[str] | None = None
        self.started = time.monotonic()
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )
        except OSError as exc:
            self.error = f"cannot start {self.argv[0]}: {exc}"

    def wait(self, timeout_s: float) -> tuple[int | None, str, str]:
        """``(returncode, stdout, stderr)``; returncode None when it ran past ``timeout_s``
        (measured from the start) and was killed."""
        if self.popen is None:
            return -1, "", self.error or ""
        remaining = max(0.0, timeout_s - (time.monotonic() - self.started))
        try:
            out, err = self.popen.communicate(timeout=remaining)
            return self.popen.returncode, out, err
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.popen.communicate()
            return None, out, err

    def kill(self) -> None:
        """Kill the process group (no-op once it exited)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.popen.pid, signal.SIGKILL)


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, stripped ("" when there is none)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""
