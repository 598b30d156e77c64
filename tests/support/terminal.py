"""A real terminal for tests: a private tmux server (its own socket, so nothing of the user's
tmux is touched) running one command in a pane whose screen the test reads."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from support.apt import apt_install


def find_or_install_tmux() -> tuple[str | None, str]:
    """The tmux binary, installing Debian's package when missing: (path, why not)."""
    why = apt_install(["tmux"], lambda: shutil.which("tmux") is not None)
    return (shutil.which("tmux"), "") if not why else (None, why)


class Pane:
    """One command in a detached tmux pane of ``width`` x ``height`` (a real pty), started in
    ``cwd`` with ``env``. After the command ends the pane prints ``[exit N]`` and stays, so
    its last screen can still be read."""

    def __init__(self, tmux: str, command: str, cwd: Path, env: dict[str, str],
                 width: int = 140, height: int = 45, history: int = 2000) -> None:  # fmt: skip
        self.tmux = tmux
        self.socket = f"mlaunch-test-{uuid.uuid4().hex[:8]}"
        self.env = {**env, "TERM": "xterm-256color"}
        shell = f'{command}; echo "[exit $?]"; sleep 600'
        # The scrollback (``history`` lines, read by :meth:`history`) is fixed when the pane is
        # made: set before it.
        self._run("-f", "/dev/null", "start-server", ";", "set-option", "-g", "history-limit",
                  str(history), ";", "new-session", "-d", "-s", "t", "-x", str(width),
                  "-y", str(height), "-c", str(cwd), shell)  # fmt: skip

    def _run(self, *args: str) -> str:
        return subprocess.run(
            [self.tmux, "-L", self.socket, *args], env=self.env, capture_output=True,
            text=True, check=True, timeout=30,
        ).stdout  # fmt: skip

    def screen(self) -> str:
        """What the pane shows now."""
        return self._run("capture-pane", "-p", "-t", "t")

    def history(self) -> str:
        """Everything the pane printed that its scrollback still holds, the screen included,
        each line the terminal wrapped joined again (``-J``)."""
        return self._run("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def keys(self, *keys: str) -> None:
        """Type ``keys`` (tmux key names, e.g. ``C-c``)."""
        self._run("send-keys", "-t", "t", *keys)

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        """Poll the screen until ``predicate`` holds; the screen then (fails past ``timeout``)."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"the terminal never showed {what}; it shows:\n{text}")

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], env=self.env,
                       capture_output=True, timeout=30)  # fmt: skip
