"""Installing Debian packages from a test fixture (CI starts from a clean machine).

One function for every fixture that needs a system package (chromium, slurm-wlm + munge, tmux):
under pytest-xdist two workers may reach their fixtures at once, and two concurrent ``apt-get``
runs fail on dpkg's lock, so installs take a machine-wide file lock first and re-check under it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable

#: Held while apt-get runs (in /tmp: every test process of this machine sees the same file).
LOCK_FILE = "/tmp/mlaunch-tests-apt.lock"
APT_TIMEOUT_S = 900


def apt_install(
    packages: list[str], present: Callable[[], bool], *, recommends: bool = False
) -> str:
    """Install ``packages`` (and, with ``recommends``, what they recommend) unless ``present()``;
    returns "" on success, else why not."""
    if present():
        return ""
    if os.geteuid() != 0:
        return f"{', '.join(packages)} not installed and not root to install them"
    if not shutil.which("apt-get"):
        return f"{', '.join(packages)} not installed and no apt-get here"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q"] + (
        [] if recommends else ["--no-install-recommends"]
    )
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if present():  # another test process installed them while this one waited
            return ""
        for argv in (
            ["apt-get", "update", "-q"],
            [*install, *packages],
        ):
            try:
                r = subprocess.run(
                    argv, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"`{' '.join(argv)}` failed: {e}"
            if r.returncode != 0:
                return f"`{' '.join(argv)}` failed:\n{r.stdout[-1500:]}{r.stderr[-1500:]}"
    return "" if present() else f"apt-get installed {', '.join(packages)} but they are not found"
