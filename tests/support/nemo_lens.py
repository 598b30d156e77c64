"""The real nemo-lens, for tests that must behave as a Megatron-LM worker does.

nemo-lens 0.1.0 (what Megatron-LM's workers configure telemetry with) needs Python >= 3.13, while
mlaunch runs on 3.11. :func:`lens_python` makes (once, cached across runs) a virtual environment
with a newer interpreter found on this machine and ``nemo-lens[sdk]==0.1.0`` installed from the
package index, and returns its ``python``. :func:`write_worker_shim` writes a script that
``mlaunch train --script`` can start: torchrun runs scripts with the launcher's own interpreter, so
the shim ``os.execv``s the nemo-lens interpreter on ``lens_worker.py`` with the same arguments.

The cache lives in ``$MLAUNCH_TEST_CACHE`` (default ``~/.cache/mlaunch-tests``); a lock file keeps
parallel test processes from building it twice.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: Exactly what the reference workers use.
LENS_REQUIREMENT = "nemo-lens[sdk]==0.1.0"
#: nemo-lens 0.1.0's own Requires-Python (its package metadata asks for 3.13, not 3.12).
LENS_MIN_PYTHON = (3, 13)
#: The Megatron-like worker this module's shim starts.
WORKER = Path(__file__).resolve().parent / "lens_worker.py"


class LensUnavailable(RuntimeError):
    """No interpreter new enough for nemo-lens exists on this machine."""


def _cache_dir() -> Path:
    root = os.environ.get("MLAUNCH_TEST_CACHE") or Path.home() / ".cache" / "mlaunch-tests"
    return Path(root)


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.split()
    return int(major), int(minor)


def find_interpreter() -> str | None:
    """A Python >= 3.13 on this machine: on PATH, or under pyenv's versions."""
    candidates: list[str] = []
    for name in ("python3.13", "python3.14"):
        if found := shutil.which(name):
            candidates.append(found)
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    versions = Path(pyenv_root) / "versions"
    if versions.is_dir():
        for d in sorted(versions.iterdir(), reverse=True):
            py = d / "bin" / "python"
            if py.exists() and d.name[:1].isdigit():
                candidates.append(str(py))
    for python in candidates:
        # pyenv shims may point at a version that is not installed: ask the interpreter itself.
        if (v := _version(python)) is not None and v >= LENS_MIN_PYTHON:
            return python
    return None


def lens_python() -> Path:
    """The ``python`` of a venv with ``nemo-lens[sdk]==0.1.0`` (built on first use, then cached)."""
    base = find_interpreter()
    if base is None:
        raise LensUnavailable(
            f"nemo-lens 0.1.0 needs Python >= {'.'.join(map(str, LENS_MIN_PYTHON))}; none found"
            " on PATH or under pyenv"
        )
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / "nemo-lens-0.1.0"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    with open(cache / "nemo-lens.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", LENS_REQUIREMENT],
                check=True,
                timeout=900,
            )
            check = "import nemo.lens, opentelemetry.sdk; print(nemo.lens.__version__)"
            subprocess.run([str(python), "-c", check], check=True, timeout=120)
            marker.write_text(LENS_REQUIREMENT + "\n")
    return python


def write_worker_shim(
    directory: Path, python: Path | None = None, name: str = "pretrain_gpt.py"
) -> Path:
    """A script that runs :data:`WORKER` under the nemo-lens interpreter, for ``--script``.

    The shim is itself started by the launcher's Python (torchrun does that); it replaces itself
    with the nemo-lens interpreter, so the worker's pid, environment and signals are the shim's.
    """
    python = python or lens_python()
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / name
    shim.write_text(
        "import os, sys\n"
        f"os.execv({str(python)!r}, [{str(python)!r}, {str(WORKER)!r}, *sys.argv[1:]])\n"
    )
    return shim


def run_worker_directly(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120):
    """Run the worker as one rank without torchrun (RANK/WORLD_SIZE from ``env``)."""
    full = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **env}
    return subprocess.run(
        [str(lens_python()), str(WORKER), *args],
        env=full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


if __name__ == "__main__":  # `python tests/support/nemo_lens.py` builds the cache by hand
    print(lens_python(), file=sys.stdout)
