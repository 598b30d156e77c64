"""Whether the hang watchdog can read the workers' stacks here: py-spy is installed and may read
a process started the way torchrun starts a worker (a sibling of py-spy, not its child, which is
what Yama's ``ptrace_scope=1`` refuses)."""

from __future__ import annotations

import sys

from mlaunch.doctor.process import ProbeProcess
from mlaunch.doctor.results import CheckResult, ok, warn
from mlaunch.launcher.hang_report import dump_stacks, py_spy
from mlaunch.settings import Settings

NAME = "hang stacks"
#: How long the sleeper waits for py-spy (it is killed as soon as the read is done).
SLEEPER_S = 30
_FIX = (
    "run as root or with CAP_SYS_PTRACE, or allow same-user tracing (sysctl"
    " kernel.yama.ptrace_scope=0); without it a hang's verdict comes from the open spans alone"
)


def check_hang_stacks(settings: Settings) -> list[CheckResult]:
    """py-spy reads a worker-like process, or why it cannot (a warning: training runs anyway)."""
    if settings.launch.hang_timeout == "off":
        return [ok(NAME, "the hang watchdog is off (--hang-timeout off)")]
    if py_spy() is None:
        return [warn(NAME, "py-spy is not installed: a hang's verdict will have no stacks",
                     "pip install py-spy")]  # fmt: skip
    sleeper = ProbeProcess(
        [sys.executable, "-c", f"import time; print('ready', flush=True); time.sleep({SLEEPER_S})"]
    )
    try:
        if sleeper.popen is None or sleeper.popen.stdout is None:
            return [warn(NAME, sleeper.error or "cannot start a test process", _FIX)]
        sleeper.popen.stdout.readline()
        threads, error, took = dump_stacks(sleeper.popen.pid)
    finally:
        sleeper.kill()
    if threads is None:
        return [warn(NAME, f"py-spy cannot read a worker's stacks here ({error})", _FIX)]
    return [ok(NAME, f"py-spy reads a worker's stacks ({took * 1e3:.0f} ms for one process)")]
