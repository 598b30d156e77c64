"""Run a module (torchrun) so that it stops when the ``mlaunch train`` process that started it dies.

``python -m mlaunch.launcher.orphan_guard MODULE ARGS...`` arms the kernel's parent-death signal
(``prctl(PR_SET_PDEATHSIG, SIGTERM)``) and then runs ``MODULE`` as ``__main__`` in this same
process (no extra exec, so torchrun's pid, signals and exit code are its own). If the launcher dies
by any signal, SIGKILL included (the OOM killer, a scheduler, a dropped SSH session), the kernel
sends torchrun SIGTERM, and torchrun takes its ordinary shutdown path: it sends its workers SIGTERM,
which they handle as a preemption (finish or abandon the iteration, save when a save directory is
set, end their spans truncated, flush within the deadline).

The launcher starts torchrun in a session of its own (so a terminal's Ctrl-C reaches the launcher
first): without this guard nothing would tell torchrun that its launcher is gone.

Where ``prctl`` does not exist (not Linux), a daemon thread polls the parent pid once a second and
sends the same SIGTERM; so does a launcher that died before the signal was armed (checked once,
right after arming). Standard library only: this runs before torchrun's own imports.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

from mlaunch.envcontract import LAUNCHER_PID

_PR_SET_PDEATHSIG = 1
_POLL_S = 1.0


def _arm_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where the call is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def guard(parent: int | None) -> None:
    """Make this process receive SIGTERM when ``parent`` (default: the current parent) dies."""
    parent = parent if parent is not None else os.getppid()
    armed = _arm_pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:
        # The launcher died before the signal was armed: nobody would ever send it.
        os.kill(os.getpid(), signal.SIGTERM)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m mlaunch.launcher.orphan_guard MODULE [ARGS...]")
    given = os.environ.pop(LAUNCHER_PID, "")
    guard(int(given) if given.isdigit() else None)
    module, *args = argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
